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

from mcore_rl.models.base import HFConfig, ModelFamily, UnsupportedModel, gqa_transformer_config, register
from mcore_rl.models.qwen3_moe import attention_rules, dense_mlp_rules, embedding_rules, qk_norm_rules
from mcore_rl.parallel.layout import ModelShape, ParallelLayout
from mcore_rl.resharding.weight_map import WeightMap

#: HF names that are derived state, never weights (older checkpoints saved the rotary cache)
IGNORE_HF = (r".*rotary_emb\.inv_freq$",)


def refuse_sliding_window(hf: HFConfig) -> None:
    """Qwen2/Qwen3 configs may enable sliding-window attention on some layers; Megatron's local spec has no window."""
    hf.refuse_unless("use_sliding_window", False, "sliding-window attention has no Megatron equivalent here")
    kinds = set(hf.get("layer_types", ["full_attention"]))
    if kinds - {"full_attention"}:
        raise UnsupportedModel(
            f"{hf.model_type} config.json: layer_types contains {sorted(kinds - {'full_attention'})}; only "
            "full_attention layers are supported"
        )


def dense_shape(hf: HFConfig) -> ModelShape:
    """Sizes a layout must divide, for a dense GQA model."""
    heads = hf.req("num_attention_heads")
    return ModelShape(
        num_layers=hf.req("num_hidden_layers"),
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads", heads),
        vocab_size=hf.req("vocab_size"),
        ffn_hidden_size=hf.req("intermediate_size"),
    )


def dense_weight_map(hf: HFConfig, padded_vocab: int, *, qkv_bias: bool = False, qk_norm: bool = False) -> WeightMap:
    """Embedding/output + GQA attention (optional q/k/v biases and per-head q/k norms) + SwiGLU MLP rules."""
    # attention_rules adds the bias rule when the config says attention_bias; Qwen2 has q/k/v biases without it.
    attention_hf = HFConfig({**hf.raw, "attention_bias": qkv_bias})
    rules = embedding_rules(hf, padded_vocab) + attention_rules(attention_hf) + dense_mlp_rules()
    if qk_norm:
        rules += qk_norm_rules()
    return WeightMap(rules, ignore_hf=IGNORE_HF)


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
