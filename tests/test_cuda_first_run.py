"""The first CUDA step, checked on a CPU machine: what a GPU run without Transformer Engine builds (`runtime=cuda` on
a machine where TE is not importable, as the GPU check kit's box is), where micro-batches and results live, and the
refusals a GPU run needs before any rank starts. Each test here failed before the fix it names (issue 27)."""

from __future__ import annotations

import pytest
import torch
from _parity import DEEPSEEK_TINY

from mcore_rl.models.base import HFConfig, get_family
from mcore_rl.parallel.layout import ParallelLayout

QWEN3_MOE_TINY = dict(
    model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
    num_experts_per_tok=2, norm_topk_prob=True, rope_theta=10000.0, rms_norm_eps=1e-6,
)  # fmt: skip
TE_ONLY = ("apply_rope_fusion", "moe_grouped_gemm", "masked_softmax_fusion", "persist_layer_norm")


def _no_te(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_rl.models import spec

    monkeypatch.setattr(spec, "transformer_engine_available", lambda: False)


@pytest.mark.parametrize("hf", [QWEN3_MOE_TINY, {**DEEPSEEK_TINY, "model_type": "deepseek_v3"}], ids=["qwen3_moe", "dsv3"])
def test_cuda_without_te_builds_no_te_only_setting(hf, monkeypatch) -> None:
    """runtime=cuda without TE: Megatron's local spec, so no TE-only fusion, no legacy GroupedMLP (which says "Grouped
    GEMM is not available" without TE) and no masked-softmax CUDA extension; one predicate decides (models/spec.py)."""
    from mcore_rl.models.spec import te_in_use

    _no_te(monkeypatch)
    assert not te_in_use("cuda")
    config = get_family(hf["model_type"]).transformer_config(HFConfig(hf), ParallelLayout(), "cuda", torch.bfloat16)
    assert {name: getattr(config, name) for name in TE_ONLY} == dict.fromkeys(TE_ONLY, False)
    # CUDA without TE still dispatches tokens with alltoall (a CUDA stream is there) and exchanges variable shapes
    assert config.moe_token_dispatcher_type == "alltoall" and config.variable_seq_lengths


def test_cuda_with_te_keeps_te_settings(monkeypatch) -> None:
    from mcore_rl.models import spec

    monkeypatch.setattr(spec, "transformer_engine_available", lambda: True)
    kwargs = dict(apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False)  # CPU can't check
    config = get_family("qwen3_moe").transformer_config(
        HFConfig(QWEN3_MOE_TINY), ParallelLayout(), "cuda", torch.bfloat16, **kwargs
    )
    assert config.moe_grouped_gemm and config.bias_activation_fusion


def test_dsv3_latent_projections_must_divide_tp_on_cuda_without_te(monkeypatch) -> None:
    """The local spec column-splits MLA's latent down projections over tp whatever the device: the check applies to
    runtime=cuda without TE too (it was skipped for every CUDA run)."""
    from mcore_rl.parallel.layout import LayoutError

    _no_te(monkeypatch)
    hf = HFConfig({**DEEPSEEK_TINY, "model_type": "deepseek_v3", "q_lora_rank": 30})
    with pytest.raises(LayoutError, match="q_lora_rank=30 is not divisible by tp=4"):
        get_family("deepseek_v3").transformer_config(hf, ParallelLayout(tp=4), "cuda", torch.bfloat16)
