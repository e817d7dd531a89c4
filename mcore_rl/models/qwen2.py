"""Qwen2 / Qwen2.5 dense (HF model_type "qwen2").

Llama's architecture (see llama.py) with biases on q_proj, k_proj and v_proj (always present, no config switch) and
none on o_proj or the MLP: Megatron's add_qkv_bias=True, add_bias_linear=False. The q/k/v biases are fused into
linear_qkv.bias with the same per-query-group interleave as the weights.

RoPE: default, linear, llama3 or yarn (Qwen2.5's long-context setting), as models/rope.py reads them.

Refused: sliding-window attention (`use_sliding_window`, or `layer_types` other than full_attention), other rope types.
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
class Qwen2Family(ModelFamily):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"

    def shape(self, hf: HFConfig) -> ModelShape:
        return dense_shape(hf)

    def transformer_config(
        self, hf: HFConfig, layout: ParallelLayout, runtime: str, dtype: torch.dtype, **overrides: Any
    ) -> Any:
        refuse_sliding_window(hf)
        return gqa_transformer_config(
            hf, layout, runtime, dtype, qk_layernorm=False, add_qkv_bias=True, overrides=overrides, rope=self.rope(hf)
        )

    def rope(self, hf: HFConfig) -> RopeScaling:
        return read_rope(hf)

    def weight_map(self, hf: HFConfig, padded_vocab: int) -> WeightMap:
        return dense_weight_map(hf, padded_vocab, qkv_bias=True)
