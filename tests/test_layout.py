"""ParallelLayout: validation against world size and model shape; rank mapping equal to Megatron's own groups."""

from __future__ import annotations

import pytest

from mcore_rl.parallel.layout import LayoutError, ModelShape, ParallelLayout

QWEN3_235B = ModelShape(
    num_layers=94,
    num_attention_heads=64,
    num_query_groups=4,
    vocab_size=151936,
    num_experts=128,
    ffn_hidden_size=12288,
    moe_ffn_hidden_size=1536,
)


@pytest.mark.parametrize(
    "layout, world",
    [
        (ParallelLayout(tp=4, pp=2, ep=8, etp=1, sequence_parallel=True), 256),
        (ParallelLayout(tp=2, pp=1, ep=4, sequence_parallel=True), 8),
        (ParallelLayout(tp=1, pp=2, ep=2), 4),
        (ParallelLayout(tp=4, pp=2, cp=2, ep=8, etp=1, sequence_parallel=True), 256),
    ],
)
def test_valid_layouts_are_accepted(layout, world):
    layout.validate(world, QWEN3_235B)
    assert layout.dp(world) * layout.tp * layout.pp * layout.cp == world


@pytest.mark.parametrize(
    "layout, world, message",
    [
        (ParallelLayout(tp=3), 6, "num_attention_heads=64 is not divisible by tp=3"),
        (ParallelLayout(tp=8, sequence_parallel=True), 8, "num_query_groups (KV heads)=4 is not divisible by tp=8"),
        (ParallelLayout(ep=3), 3, "num_experts=128 is not divisible by ep=3"),
        (ParallelLayout(pp=4), 4, "num_layers=94 is not divisible by pp*vpp"),
        (ParallelLayout(tp=2), 2, "MoE with tp=2 needs sequence_parallel=true"),
        (ParallelLayout(tp=2, sequence_parallel=True), 3, "world size 3 is not divisible by tp*cp*pp"),
        (ParallelLayout(ep=4), 6, "world size 6 is not divisible by etp*ep*pp"),
    ],
)
def test_invalid_layouts_are_refused_naming_the_sizes(layout, world, message):
    with pytest.raises(LayoutError) as err:
        layout.validate(world, QWEN3_235B)
    assert message in str(err.value)


@pytest.mark.parametrize("field, value", [("tp", 0), ("pp", -1), ("ep", 1.5), ("vpp", 0)])
def test_non_positive_sizes_are_refused(field, value):
    with pytest.raises(LayoutError, match=f"layout.{field} must be a positive integer"):
        ParallelLayout(**{field: value})


def test_vpp_needs_pipeline():
    with pytest.raises(LayoutError, match="vpp=2 needs pp > 1"):
        ParallelLayout(vpp=2)


@pytest.mark.parametrize(
    "world, sizes",
    [
        (8, dict(tp=2, pp=2, ep=2, etp=1)),
        (16, dict(tp=2, pp=2, cp=2, ep=4, etp=1)),
        (16, dict(tp=4, pp=1, ep=2, etp=2)),
        (64, dict(tp=4, pp=2, cp=2, ep=8, etp=2)),
        (64, dict(tp=8, pp=4, ep=8, etp=1)),
    ],
)
def test_rank_groups_equal_megatrons_rank_generator(world, sizes):
    from megatron.core.parallel_state import RankGenerator

    layout = ParallelLayout(**sizes)
    dense = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp(world), pp=layout.pp, cp=layout.cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(
        tp=layout.expert_tp, ep=layout.ep, dp=layout.expert_dp(world), pp=layout.pp, cp=1, order="tp-cp-ep-dp-pp"
    )
    for axis in ("tp", "cp", "dp", "pp"):
        assert layout.group_ranks(axis, world) == sorted(dense.get_ranks(axis)), axis
    for axis, megatron_axis in (("etp", "tp"), ("ep", "ep"), ("edp", "dp")):
        assert layout.group_ranks(axis, world) == sorted(expert.get_ranks(megatron_axis)), axis
    # coords and rank_of are inverse on the dense grid
    for rank in range(world):
        c = layout.coords(rank, world)
        assert layout.rank_of(world, tp_rank=c.tp_rank, cp_rank=c.cp_rank, dp_rank=c.dp_rank, pp_rank=c.pp_rank) == rank


def test_virtual_pipeline_layer_assignment_is_interleaved():
    layout = ParallelLayout(pp=2, vpp=2)
    # chunk v*pp + p goes to pp rank p, virtual stage v
    assert layout.pp_stage_layers(8) == [[0, 1], [4, 5], [2, 3], [6, 7]]
