"""Logits parity and bit-exact export for the dense families: Llama, Qwen2, Qwen3 (CPU, gloo ranks).

    .venv/bin/pytest -q tests/test_families_dense.py

A tiny random transformers model is saved as safetensors, loaded into Megatron under every layout of
{TP1, TP2} x {PP1, PP2} on 4 ranks (data parallel fills the rest of the world) and run through Megatron's pipeline
schedule. Bound: fp32 logits within 1e-5 absolute of transformers' (measured ~1e-6: the two compute the same math in
a different order). The weights exported back to HF names equal the saved checkpoint bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _parity import assert_bit_exact, collect, hf_state, parity_rank

from mcore_rl.models.base import HFConfig, UnsupportedModel
from mcore_rl.models.registry import get_family
from mcore_rl.parallel.harness import run_on_ranks
from mcore_rl.parallel.layout import ParallelLayout

ATOL = 1e-5
SEQ, BATCH, VOCAB = 12, 2, 100
DENSE_LAYOUTS = [
    ParallelLayout(tp=1, pp=1),
    ParallelLayout(tp=2, pp=1, sequence_parallel=True),
    ParallelLayout(tp=1, pp=2),
    ParallelLayout(tp=2, pp=2),
]
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)


def _tiny_model(model_type: str, tie: bool):
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[model_type]
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, tie_word_embeddings=tie)).float().eval()
    with torch.no_grad():  # HF initialises biases and norms to constants: randomise them so the maps are exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
@pytest.mark.parametrize("model_type,tie", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_dense_family_parity_and_round_trip(tmp_path: Path, model_type: str, tie: bool) -> None:
    model = _tiny_model(model_type, tie)
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    results = collect(run_on_ranks(parity_rank, 4, (str(tmp_path), DENSE_LAYOUTS, ids)), len(DENSE_LAYOUTS))
    original = hf_state(tmp_path)
    for layout, (logits, exported) in zip(DENSE_LAYOUTS, results):
        got = logits[-1][..., :VOCAB]
        err = (got - ref).abs().max().item()
        assert err < ATOL, f"{model_type} {layout.describe()}: max |logits diff| {err:.2e} >= {ATOL}"
        assert_bit_exact(exported, original)


@pytest.mark.parametrize(
    "model_type,field,value",
    [
        ("llama", "attention_bias", True),
        ("llama", "mlp_bias", True),
        ("llama", "hidden_act", "gelu"),
        ("llama", "rope_parameters", {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}),
        ("qwen2", "use_sliding_window", True),
        ("qwen3", "layer_types", ["sliding_attention", "full_attention"]),
        ("qwen3", "attention_bias", True),
    ],
)
def test_dense_family_refuses_settings_without_megatron_equivalent(model_type: str, field: str, value) -> None:
    raw = dict(TINY, model_type=model_type, rope_theta=1e4, **{field: value})
    with pytest.raises(UnsupportedModel, match=field.split("_")[0]):
        get_family(model_type).transformer_config(HFConfig(raw), ParallelLayout(), "cpu", torch.float32)


def test_unknown_model_type_lists_supported() -> None:
    with pytest.raises(UnsupportedModel, match="deepseek_v3, llama, qwen2, qwen3, qwen3_moe"):
        get_family("gpt_bigcode")
