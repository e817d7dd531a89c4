"""Qwen3 dense (HF model_type "qwen3", e.g. Qwen3-0.6B ... Qwen3-32B).

Llama's architecture (see llama.py) plus a per-head RMSNorm on queries and keys before RoPE (q_norm / k_norm over
head_dim): Megatron's qk_layernorm=True, whose q_layernorm / k_layernorm weights are replicated across TP. No linear
biases by default.

RoPE: default, linear, llama3 or yarn (Qwen3's long-context setting), as models/rope.py reads them.

Refused: `attention_bias` (Qwen3 then biases o_proj too, which Megatron cannot add without MLP biases), sliding-window
attention, other rope types.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_rl.models.base import HFConfig, ModelFamily, gqa_transformer_config, register
from mcore_rl.models.rope import RopeScaling, read_rope
from mcore_rl.models.rules import dense_shape, dense_weight_map, refuse_sliding_window
from mcore_rl.parallel.layout import ModelShape, ParallelLayout
from mcore_rl.resharding.weight_map import WeightMap


@register
class Qwen3Family(ModelFamily):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"

    def shape(self, hf: HFConfig) -> ModelShape:
        return dense_shape(hf)

    def transformer_config(
        self, hf: HFConfig, layout: ParallelLayout, runtime: str, dtype: torch.dtype, **overrides: Any
    ) -> Any:
        hf.refuse_unless("attention_bias", False, "Qwen3's attention_bias also biases o_proj; Megatron cannot")
        refuse_sliding_window(hf)
        return gqa_transformer_config(
            hf, layout, runtime, dtype, qk_layernorm=True, add_qkv_bias=False, overrides=overrides, rope=self.rope(hf)
        )

    def rope(self, hf: HFConfig) -> RopeScaling:
        return read_rope(hf)

    def weight_map(self, hf: HFConfig, padded_vocab: int) -> WeightMap:
        return dense_weight_map(hf, padded_vocab, qk_norm=True)
