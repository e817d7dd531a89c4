"""Checkpoint planning (resharding/dist_ckpt.py): the folded plan equals the plan of the whole model.

    .venv/bin/pytest -q tests/test_dist_ckpt_plan.py

`plan_checkpoint` builds one decoder layer per kind (dense, MoE) and repeats it; the whole-model plan is itself
compared with Megatron's own save in tests/test_convert.py. Here both are built for models whose layer kinds mix in
every way the families produce: DeepSeek-V3's dense-then-MoE with an MTP layer, Qwen3-MoE with mlp_only_layers and
decoder_sparse_step (a dense last layer, which the MTP-less model still folds), and an all-dense Qwen3.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tiny_models import tiny_qwen3_moe

from mcore_rl.parallel.harness import run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bench_convert import deepseek_like_config  # noqa: E402

CONFIGS = {
    "deepseek_v3 3 dense + 4 MoE + MTP": dict(deepseek_like_config(7, 8, 16, hidden=64), first_k_dense_replace=3),
    "qwen3_moe dense layers 1 and 5 of 6": tiny_qwen3_moe(num_hidden_layers=6, decoder_sparse_step=1,
                                                          mlp_only_layers=[1, 5]),
    "qwen3_moe every 2nd layer MoE": tiny_qwen3_moe(num_hidden_layers=5, decoder_sparse_step=2),
    "qwen3 dense": dict(tiny_qwen3_moe(num_hidden_layers=4), model_type="qwen3", num_experts=0),
}  # fmt: skip


def plans_rank(rank: int, world: int, configs: dict[str, dict]) -> dict[str, tuple]:
    import torch

    from mcore_rl.models.base import HFConfig
    from mcore_rl.models.builder import ModelSpec, build_gpt_chunks
    from mcore_rl.parallel.groups import initialize_model_parallel
    from mcore_rl.parallel.layout import ParallelLayout
    from mcore_rl.resharding.dist_ckpt import layer_kinds, plan_checkpoint

    pg = initialize_model_parallel(ParallelLayout())
    out = {}
    for name, config in configs.items():
        spec = ModelSpec(HFConfig(config), ParallelLayout(), dtype=torch.bfloat16)
        folded = plan_checkpoint(spec, pg, build_gpt_chunks)
        full = plan_checkpoint(spec, pg, build_gpt_chunks, fold_layers=False)
        kinds = layer_kinds(spec.transformer_config())
        out[name] = (folded.entries, full.entries, folded.objects, full.objects, kinds)
    return out


def test_folded_plan_equals_whole_model_plan() -> None:
    results = run_on_ranks(plans_rank, 1, (CONFIGS,))[0]
    for name, (folded, full, folded_objects, full_objects, kinds) in results.items():
        assert len(set(kinds)) <= 2 and len(full) > 0, name
        assert [e.name for e in folded] == [e.name for e in full], name
        assert folded == full, name  # shapes, chunk keys, offsets, sizes and views too
        assert folded_objects == full_objects, name
    # the cases really mix kinds (else folding would not be exercised)
    assert results["deepseek_v3 3 dense + 4 MoE + MTP"][4] == [0, 0, 0, 1, 1, 1, 1]
    assert results["qwen3_moe dense layers 1 and 5 of 6"][4] == [1, 0, 1, 1, 1, 0]
    assert results["qwen3_moe every 2nd layer MoE"][4] == [0, 1, 0, 1, 0]


#: (config, layout) pairs for the dry run's parameter count: pipeline stages that split the kinds unevenly, virtual
#: stages, expert and tensor parallelism, the MTP layer on the last stage
ESTIMATE_CASES = [
    ("deepseek_v3 3 dense + 4 MoE + MTP", dict(pp=2, ep=4, tp=2)),
    ("deepseek_v3 3 dense + 4 MoE + MTP", dict(pp=2, ep=2, first_stage_layers=2)),
    ("qwen3_moe dense layers 1 and 5 of 6", dict(pp=3, ep=2)),
    ("qwen3_moe every 2nd layer MoE", dict(pp=1, ep=2, tp=2, etp=2)),
    ("qwen3_moe dense layers 1 and 5 of 6", dict(pp=3, vpp=2, ep=1)),
]


def rank_params_rank(rank: int, world: int, cases: list[tuple[str, dict]]) -> list[tuple]:
    from mcore_rl.models.estimate import rank_params
    from mcore_rl.parallel.layout import ParallelLayout

    out = []
    for name, layout in cases:
        lay = ParallelLayout(**layout)
        out.append(
            (rank_params(CONFIGS[name], lay, 8, "bfloat16"), rank_params(CONFIGS[name], lay, 8, "bfloat16", False))
        )
    return out


def test_folded_rank_params_equal_the_whole_model_count() -> None:
    """launch/submit.py --dry-run counts the fullest rank's parameters from one layer of each kind
    (models/estimate.py: rank_params); the count equals the one from the whole model built layer by layer."""
    results = run_on_ranks(rank_params_rank, 1, (ESTIMATE_CASES,))[0]
    for (name, layout), (folded, full) in zip(ESTIMATE_CASES, results):
        assert full.dense > 0 and folded == full, (name, layout, folded, full)
    assert any(full.expert > 0 for _, full in results)
