"""Uneven first/last pipeline stages: the layer split equals Megatron's, bad splits are refused naming the sizes.

    .venv/bin/pytest -q tests/test_layout_uneven.py

Megatron (megatron-core 0.16.1) is the reference: `pp_stage_layers` must give the layer ids that its
get_transformer_layer_offset / get_num_layers_to_build assign to each (pp rank, virtual stage) for a TransformerConfig
with num_layers_in_first/last_pipeline_stage set. No process is started here.
"""

from __future__ import annotations

import pytest
import torch

from mcore_rl.parallel.layout import LayoutError, ModelShape, ParallelLayout


def _megatron_stage_layers(num_layers: int, layout: ParallelLayout) -> list[list[int]]:
    """Megatron's own layer ids per (pp rank, virtual stage), in pp_stage_layers' order."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vpp = layout.vpp if layout.virtual_stages > 1 else None
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        pipeline_dtype=torch.float32,
    )
    out = []
    for pp_rank in range(layout.pp):
        for vstage in range(layout.virtual_stages):
            vp_stage = vstage if vpp else None
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
            count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
            out.append(list(range(offset, offset + count)))
    return out


@pytest.mark.parametrize(
    "num_layers, sizes",
    [
        (3, dict(pp=2, first_stage_layers=1)),
        (3, dict(pp=2, first_stage_layers=2)),
        (3, dict(pp=2, last_stage_layers=1)),
        (5, dict(pp=2, first_stage_layers=2, last_stage_layers=3)),
        (61, dict(pp=4, first_stage_layers=16, last_stage_layers=15)),  # DeepSeek-V3
        (61, dict(pp=4, last_stage_layers=13)),
        (61, dict(pp=8, first_stage_layers=5)),
        (9, dict(pp=2, vpp=3, first_stage_layers=3)),
        (9, dict(pp=3, vpp=3, first_stage_layers=3)),
        (14, dict(pp=4, vpp=2, first_stage_layers=2, last_stage_layers=4)),
        (10, dict(pp=3, vpp=2, first_stage_layers=2, last_stage_layers=4)),
        (14, dict(pp=3, vpp=2, last_stage_layers=2)),
        (8, dict(pp=2, vpp=2)),  # even stages: unchanged
        (94, dict(pp=2)),
    ],
)
def test_stage_layers_equal_megatrons_offsets(num_layers: int, sizes: dict) -> None:
    layout = ParallelLayout(**sizes)
    layout.validate(layout.model_parallel_size, ModelShape(num_layers, 4, 4))
    got = layout.pp_stage_layers(num_layers)
    assert got == _megatron_stage_layers(num_layers, layout)
    assert sorted(i for stage in got for i in stage) == list(range(num_layers))
    per_rank = layout.layers_per_pp_rank(num_layers)
    vpp = layout.virtual_stages
    assert per_rank == [sum(len(stage) for stage in got[p * vpp : (p + 1) * vpp]) for p in range(layout.pp)]
    if layout.first_stage_layers is not None:
        assert per_rank[0] == layout.first_stage_layers
    if layout.last_stage_layers is not None:
        assert per_rank[-1] == layout.last_stage_layers


def test_deepseek_v3_61_layers_at_pp4() -> None:
    layout = ParallelLayout(pp=4, first_stage_layers=16, last_stage_layers=15)
    assert layout.layers_per_pp_rank(61) == [16, 15, 15, 15]
    assert layout.pp_stage_layers(61)[-1] == list(range(46, 61))
    assert layout.describe() == "tp1 pp4 cp1 ep1 etp1 first16 last15"


@pytest.mark.parametrize(
    "num_layers, sizes, message, megatron_refuses",
    [
        (61, dict(pp=4, first_stage_layers=16, last_stage_layers=16), "leaves 29 layers, not divisible by the 2", True),
        (8, dict(pp=2, vpp=2, first_stage_layers=3), "first_stage_layers=3 is not divisible by vpp=2", True),
        (8, dict(pp=3, vpp=2, first_stage_layers=2, last_stage_layers=3), "last_stage_layers=3 is not divisible", True),
        (4, dict(pp=2, first_stage_layers=2, last_stage_layers=3), "= 5 must equal num_layers=4 with pp=2", True),
        (4, dict(pp=3, first_stage_layers=2, last_stage_layers=2), "leaves 0 layers for 1 middle", True),
        (12, dict(pp=4, vpp=2, first_stage_layers=2, last_stage_layers=4), "gets 3 layers", True),
        (2, dict(pp=2, first_stage_layers=3), "leaves -1 layers", False),
        # megatron-core 0.16.1 accepts this config, then divides by zero middle stages when placing layers
        (4, dict(pp=2, vpp=2, first_stage_layers=2, last_stage_layers=2), "leaves no middle stage", False),
        (61, dict(pp=4), "num_layers=61 is not divisible by pp*vpp = 4*1 = 4", True),
    ],
)  # fmt: skip
def test_bad_stage_splits_are_refused_naming_the_sizes(
    num_layers: int, sizes: dict, message: str, megatron_refuses: bool
) -> None:
    layout = ParallelLayout(**sizes)
    with pytest.raises(LayoutError) as err:
        layout.validate(layout.model_parallel_size, ModelShape(num_layers, 4, 4))
    assert message in str(err.value)
    if layout.uneven_stages:
        with pytest.raises(LayoutError, match="cannot split"):
            layout.pp_stage_layers(num_layers)
    if megatron_refuses:
        with pytest.raises((ValueError, AssertionError)):
            _megatron_stage_layers(num_layers, layout)


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(first_stage_layers=2), "layout.first_stage_layers=2 needs pp > 1"),
        (dict(pp=2, last_stage_layers=0), "layout.last_stage_layers must be a positive integer or null"),
        (dict(pp=2, first_stage_layers=True), "layout.first_stage_layers must be a positive integer or null"),
    ],
)
def test_stage_sizes_need_pipeline_and_positive_counts(sizes: dict, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        ParallelLayout(**sizes)


def test_actor_config_reads_the_stage_keys_and_names_them() -> None:
    """The Hydra config accepts actor.layout.first_stage_layers / last_stage_layers; a bad split names them."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from mcore_rl.config import register_schema, to_config

    register_schema()
    base = ["actor.layout.pp=4", "actor.layout.ep=16", "actor.layout.etp=4", "actor.layout.first_stage_layers=16"]
    GlobalHydra.instance().clear()
    with initialize_config_module("mcore_rl.configs", version_base=None):
        good = compose(config_name="deepseek_v3_671b_32n", overrides=[*base, "actor.layout.last_stage_layers=15"])
        bad = compose(config_name="deepseek_v3_671b_32n", overrides=[*base, "actor.layout.last_stage_layers=16"])
    GlobalHydra.instance().clear()
    layout = to_config(good).actor.layout.to_layout()
    assert (layout.first_stage_layers, layout.last_stage_layers) == (16, 15)
    with pytest.raises(LayoutError, match="first_stage_layers=16 \\+ last_stage_layers=16 leaves 29 layers"):
        to_config(bad)


def test_memory_estimate_uses_the_largest_stage() -> None:
    from mcore_rl.actor.optimizer import OptimizerPlan
    from mcore_rl.models.estimate import estimate_memory

    hf = dict(
        hidden_size=64, num_hidden_layers=61, num_attention_heads=4, vocab_size=1000, intermediate_size=128,
        n_routed_experts=8, moe_intermediate_size=32, first_k_dense_replace=3, num_experts_per_tok=2,
    )  # fmt: skip
    plan = OptimizerPlan(distributed=True, offload_fraction=0.0, dtype="bfloat16")
    even = estimate_memory(hf, 64, tp=1, pp=4, ep=8, plan=plan)
    uneven = estimate_memory(hf, 64, tp=1, pp=4, ep=8, first_stage_layers=16, last_stage_layers=15, plan=plan)
    # the largest stage holds 16 of the 61 layers, not 61/4
    assert uneven.params_per_rank == pytest.approx(even.params_per_rank * 16 / (61 / 4))
    assert uneven.activations > even.activations
