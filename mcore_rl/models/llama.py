"""Llama (HF model_type "llama": Llama 2/3 dense models, and the dense GQA building blocks Qwen2/Qwen3 reuse).

Architecture: pre-norm decoder with RMSNorm, GQA attention with RoPE, SwiGLU MLP, optional tied embeddings. In Megatron
terms: `TransformerConfig` with normalization=RMSNorm, gated_linear_unit + silu, num_query_groups = KV heads,
kv_channels = head_dim; the weight map fuses q/k/v into linear_qkv (per query group) and gate/up into linear_fc1.

Refused settings (no exact Megatron equivalent here): `attention_bias` (Llama puts a bias on o_proj too, which Megatron
can only add together with MLP biases), `mlp_bias`, `pretraining_tp` != 1, a non-silu activation, and RoPE scaling
(llama3 / yarn / linear rope types; `HFConfig.rope_theta` refuses them).
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_rl.models.base import HFConfig, ModelFamily, gqa_transformer_config, register
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
            hf, layout, runtime, dtype, qk_layernorm=False, add_qkv_bias=False, overrides=overrides
        )

    def weight_map(self, hf: HFConfig, padded_vocab: int) -> WeightMap:
        return dense_weight_map(hf, padded_vocab)
