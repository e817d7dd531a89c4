"""Llama (HF model_type "llama": Llama 2/3 dense models, and the dense GQA building blocks Qwen2/Qwen3 reuse).

Architecture: pre-norm decoder with RMSNorm, GQA attention with RoPE, SwiGLU MLP, optional tied embeddings. In Megatron
terms: `TransformerConfig` with normalization=RMSNorm, gated_linear_unit + silu, num_query_groups = KV heads,
kv_channels = head_dim; the weight map fuses q/k/v into linear_qkv (per query group) and gate/up into linear_fc1.

RoPE: default, and the scaled rope types Llama checkpoints use: llama3 (Llama 3.1 / 3.2: factor, low/high_freq_factor,
original_max_position_embeddings), linear and yarn, read from `rope_scaling` or transformers 5's `rope_parameters`
(models/rope.py, shared with the Qwen families).

Refused settings (no exact Megatron equivalent here): `attention_bias` (Llama puts a bias on o_proj too, which Megatron
can only add together with MLP biases), `mlp_bias`, `pretraining_tp` != 1, a non-silu activation, and the rope types
models/rope.py refuses (dynamic, longrope, ...).
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_rl.models.base import HFConfig, ModelFamily, gqa_transformer_config, register
from mcore_rl.models.rope import RopeScaling, read_rope
from mcore_rl.models.rules import dense_shape, dense_weight_map
from mcore_rl.parallel.layout import ModelShape, ParallelLayout
from mcore_rl.resharding.weight_map import WeightMap


@register
class LlamaFamily(ModelFamily):
    model_type = "llama"
    architecture = "LlamaForCausalLM"

    def shape(self, hf: HFConfig) -> ModelShape:
        return dense_shape(hf)

    def transformer_config(
        self, hf: HFConfig, layout: ParallelLayout, runtime: str, dtype: torch.dtype, **overrides: Any
    ) -> Any:
        hf.refuse_unless("attention_bias", False, "Llama's attention_bias also biases o_proj; Megatron cannot")
        return gqa_transformer_config(
            hf, layout, runtime, dtype, qk_layernorm=False, add_qkv_bias=False, overrides=overrides, rope=self.rope(hf)
        )

    def rope(self, hf: HFConfig) -> RopeScaling:
        return read_rope(hf)

    def weight_map(self, hf: HFConfig, padded_vocab: int) -> WeightMap:
        return dense_weight_map(hf, padded_vocab)
