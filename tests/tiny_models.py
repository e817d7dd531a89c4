"""Tiny model shapes shared by tests: a Qwen3-MoE (2 layers, 4 experts top-2, GQA 4/2 heads of 8, hidden 32), a dense
Llama of the same size with tied embeddings, and the checkpoint of the MoE one as transformers saves it."""

from __future__ import annotations

from typing import Any


def tiny_qwen3_moe(**overrides: Any) -> dict[str, Any]:
    """An HF config.json dict for a tiny Qwen3-MoE; keyword arguments replace or add fields."""
    config: dict[str, Any] = dict(
        model_type="qwen3_moe",
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    config.update(overrides)
    return config


def tiny_qwen3_moe_transformers(**overrides: Any) -> Any:
    """The same shape as a transformers `Qwen3MoeConfig`."""
    from transformers import Qwen3MoeConfig

    fields = tiny_qwen3_moe(**overrides)
    fields.pop("model_type")
    return Qwen3MoeConfig(**fields)


def tiny_llama(**overrides: Any) -> dict[str, Any]:
    """An HF config.json dict for a tiny dense Llama with tied embeddings, as SmolLM2 (the real-model recipe) has."""
    config: dict[str, Any] = dict(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=128, tie_word_embeddings=True, hidden_act="silu",
    )  # fmt: skip
    config.update(overrides)
    return config


def save_tiny_qwen3_moe_checkpoint(path: Any) -> Any:
    """A seeded tiny Qwen3-MoE saved by transformers into `path` (safetensors + config.json, vocabulary 63); returns
    `path`."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_transformers(vocab_size=63, eos_token_id=2, pad_token_id=0))
    model.save_pretrained(path)
    return path
