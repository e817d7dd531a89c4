"""The weight-sync plan as data: coverage for the five families across actor layouts x engine layouts x modes,
determinism, shard-aware receivers, and the refusals. Inventories come from meta-device models (no ranks move
bytes); one spawned process builds them all.

Run: `.venv/bin/pytest tests/test_sync_plan.py`
"""

from __future__ import annotations

import pytest
from _parity import DEEPSEEK_TINY
from tiny_models import tiny_qwen3_moe

from mcore_rl.parallel.harness import run_on_ranks
from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.resharding.sync.plan import EngineLayout, PlanError, ReceiveTogether, build_plan

DENSE = dict(
    vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
)  # fmt: skip
FAMILIES = {
    "llama": dict(DENSE, model_type="llama", tie_word_embeddings=True),
    "qwen2": dict(DENSE, model_type="qwen2"),
    "qwen3": dict(DENSE, model_type="qwen3"),
    "qwen3_moe": tiny_qwen3_moe(num_hidden_layers=4),
    "deepseek_v3": dict(DEEPSEEK_TINY, model_type="deepseek_v3", num_hidden_layers=4),
}
DENSE_LAYOUTS = {
    "tp2": ParallelLayout(tp=2, sequence_parallel=True),
    "pp2": ParallelLayout(pp=2),
    "pp2-uneven": ParallelLayout(pp=2, first_stage_layers=1),
    "tp2pp2": ParallelLayout(tp=2, pp=2, sequence_parallel=True),
}
MOE_LAYOUTS = {
    "ep2": ParallelLayout(ep=2),
    "etp1": ParallelLayout(tp=2, ep=2, etp=1, sequence_parallel=True),
    "tp2ep2": ParallelLayout(tp=2, ep=2, sequence_parallel=True),
    "pp2ep2": ParallelLayout(pp=2, ep=2),
    "pp2ep2-uneven": ParallelLayout(pp=2, ep=2, first_stage_layers=1),
}
ENGINES = [
    EngineLayout(2),
    EngineLayout(1, tp=2),
    EngineLayout(2, tp=4, ep=4),
    EngineLayout(1, tp=4, ep=2, dp_attention=2),
]
WORLD = 8


def _inventories(rank: int, world: int, cases: dict) -> dict:
    """(family, layout) -> (sources, hf names of the whole model, shape facts), built on the meta device."""
    from mcore_rl.models.base import HFConfig
    from mcore_rl.models.builder import ModelSpec, build_gpt_chunks
    from mcore_rl.models.registry import get_family
    from mcore_rl.parallel.groups import initialize_model_parallel
    from mcore_rl.resharding.sync.inventory import meta_sources

    pg = initialize_model_parallel(ParallelLayout())
    out = {}
    for key, (hf_dict, layout) in cases.items():
        hf = HFConfig(hf_dict)
        family = get_family(hf.model_type)
        spec = ModelSpec(
            hf, ParallelLayout(), make_vocab_size_divisible_by=16 * layout.tp,
            config_overrides={"perform_initialization": False},
        )  # fmt: skip
        shape = family.shape(hf)
        sources = meta_sources(
            lambda spec=spec: build_gpt_chunks(spec, pg, meta=True),
            spec.weight_map(),
            layout,
            shape.num_layers,
            shape.num_experts,
        )
        out[key] = (sources, shape, family.engine_shards, family.engine_receive_together)
    return out


@pytest.fixture(scope="module")
def inventories() -> dict:
    cases = {}
    for family, hf in FAMILIES.items():
        layouts = dict(DENSE_LAYOUTS, **(MOE_LAYOUTS if family in ("qwen3_moe", "deepseek_v3") else {}))
        for name, layout in layouts.items():
            cases[(family, name)] = (hf, layout)
    return run_on_ranks(_inventories, 1, (cases,))[0]


def _plan(entry, layout_name: str, engines: EngineLayout, mode: str, bucket_bytes: int = 1 << 15, together=None):
    sources, shape, rules, family_together = entry
    layout = {**DENSE_LAYOUTS, **MOE_LAYOUTS}[layout_name]
    return build_plan(
        sources, actor_layout=layout, world_size=WORLD, engines=engines, rules=rules, bucket_bytes=bucket_bytes,
        mode=mode, num_experts=shape.num_experts, num_kv_heads=shape.num_query_groups,
        num_heads=shape.num_attention_heads,
        receive_together=family_together if together is None else together,
    )  # fmt: skip


def test_every_family_layout_engine_and_mode_is_covered(inventories) -> None:
    checked = 0
    for (family, layout_name), entry in inventories.items():
        sources, shape, *_ = entry
        expected = sorted(name for s in sources for name in s.hf)
        for engines in ENGINES:
            if shape.num_experts == 0 and engines.ep > 1:
                continue
            for mode in ("full", "shard_aware"):
                plan = _plan(entry, layout_name, engines, mode)
                assert plan.check_coverage() == [], (family, layout_name, engines, mode)
                sent = sorted(e.name for b in plan.buckets for e in b.entries)
                assert sent == expected, "every exported HF tensor is in exactly one bucket"
                for bucket in plan.buckets:  # packed back to back, every offset aligned to its dtype
                    offset = 0
                    for e in bucket.entries:
                        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[e.dtype]
                        assert e.offset == offset and e.offset % itemsize == 0
                        offset += e.nbytes
                    assert bucket.nbytes == offset
                    # over bucket_bytes only as one oversized unit: a tensor, or a group received together
                    assert offset <= plan.bucket_bytes or len({e.source for e in bucket.entries}) <= 2
                checked += 1
    assert checked > 100


def test_streams_follow_stages_and_ep_owners(inventories) -> None:
    plan = _plan(inventories[("qwen3_moe", "pp2ep2")], "pp2ep2", EngineLayout(), "full")
    layout = MOE_LAYOUTS["pp2ep2"]
    assert sorted(s.name for s in plan.streams) == [
        "pp0-dense",
        "pp0-ep0",
        "pp0-ep1",
        "pp1-dense",
        "pp1-ep0",
        "pp1-ep1",
    ]
    for stream in plan.streams:
        coords = layout.coords(stream.leader, WORLD)
        assert coords.pp_rank == stream.pp_rank and stream.leader in stream.group
        if stream.ep_rank is not None:  # EP is carved out of data parallelism: EP rank e's owner is dp replica e
            assert coords.ep_rank == stream.ep_rank
        for bucket in plan.buckets_of(stream.index):
            for e in bucket.entries:
                if ".experts." in e.name:
                    expert = int(e.name.split(".experts.")[1].split(".")[0])
                    assert expert // 2 == stream.ep_rank, "experts leave from their EP owner"


def test_stream_leaders_spread_over_the_ranks_that_hold_them(inventories) -> None:
    """Each stream leaves from a rank that holds it; while a stage has ranks to spare, no rank leads two streams (so
    the stage's sends run in parallel: TP2 x EP2's dense stream no longer leaves from an expert stream's leader)."""
    for name, layout in MOE_LAYOUTS.items():
        plan = _plan(inventories[("deepseek_v3", name)], name, EngineLayout(), "full")
        for pp_rank in {s.pp_rank for s in plan.streams}:
            streams = [s for s in plan.streams if s.pp_rank == pp_rank]
            ranks = [r for r in range(WORLD) if layout.coords(r, WORLD).pp_rank == pp_rank]
            for s in streams:
                assert s.leader in s.group and set(s.group) <= set(ranks), (name, s)
            if len(streams) <= len(ranks):
                assert len({s.leader for s in streams}) == len(streams), (name, [(s.name, s.leader) for s in streams])


def test_plan_is_deterministic_and_its_digest_sees_changes(inventories) -> None:
    entry = inventories[("deepseek_v3", "tp2ep2")]
    a = _plan(entry, "tp2ep2", EngineLayout(2), "full")
    assert a.digest() == _plan(entry, "tp2ep2", EngineLayout(2), "full").digest()
    assert a.digest() != _plan(entry, "tp2ep2", EngineLayout(2), "full", bucket_bytes=1 << 16).digest()
    assert a.digest() != _plan(entry, "tp2ep2", EngineLayout(2), "shard_aware").digest()


def test_shard_aware_ranks_receive_only_what_they_keep(inventories) -> None:
    entry = inventories[("qwen3_moe", "ep2")]
    engines = EngineLayout(1, tp=2, ep=2)
    full, aware = (_plan(entry, "ep2", engines, mode) for mode in ("full", "shard_aware"))
    assert full.received_bytes(0) == full.nbytes
    assert aware.received_bytes(0) < 0.7 * full.nbytes and aware.received_bytes(1) < 0.7 * full.nbytes
    entries = {e.name: e for b in aware.buckets for e in b.entries}
    q = entries["model.layers.0.self_attn.q_proj.weight"]
    assert [aware.receive_slice(q, r) for r in (0, 1)] == [(0, 16), (16, 16)]  # 4 heads x 8 rows, rows split
    o = entries["model.layers.0.self_attn.o_proj.weight"]
    assert o.dim == 1 and aware.receive_slice(o, 1) == (16, 16)
    expert3 = entries["model.layers.0.mlp.experts.3.gate_proj.weight"]
    assert aware.receive_slice(expert3, 0) is None and aware.receive_slice(expert3, 1) == (0, 16)
    # 2 kv heads on an attention tp of 4: each head goes to the 2 ranks that use it
    kv = _plan(entry, "ep2", EngineLayout(1, tp=4, ep=2), "shard_aware")
    k = next(e for b in kv.buckets for e in b.entries if e.name == "model.layers.0.self_attn.k_proj.weight")
    assert [kv.receive_slice(k, r) for r in range(4)] == [(0, 8), (0, 8), (8, 8), (8, 8)]


def test_deepseek_mla_down_projections_reach_the_engine_in_one_bucket(inventories) -> None:
    """SGLang's DeepSeek loader drops a q_a_proj / kv_a_proj_with_mqa half that arrives without the other:
    at every layout and bucket size, a layer's two halves share a bucket."""
    checked = 0
    for layout_name in {**DENSE_LAYOUTS, **MOE_LAYOUTS}:
        entry = inventories[("deepseek_v3", layout_name)]
        together = entry[3]
        assert together, "the deepseek_v3 family declares its receive-together groups"
        for bucket_bytes in (1 << 10, 3000, 1 << 12, 1 << 13, 1 << 15):
            plan = _plan(entry, layout_name, EngineLayout(), "full", bucket_bytes=bucket_bytes)
            assert plan.check_coverage() == []
            assert plan.split_groups(together) == [], (layout_name, bucket_bytes)
            halves = [e.name for b in plan.buckets for e in b.entries if "_a_proj" in e.name]
            q = sum("q_a_proj" in n for n in halves)
            assert q >= 4 and len(halves) == 2 * q  # every layer (4, and MTP's) has both halves
            checked += 1
    # the same plan without the rule splits pairs: the check above is not vacuous
    plain = _plan(inventories[("deepseek_v3", "tp2")], "tp2", EngineLayout(), "full", bucket_bytes=3000, together=())
    assert plain.split_groups(inventories[("deepseek_v3", "tp2")][3])


def test_a_tensor_larger_than_the_bucket_travels_alone(inventories) -> None:
    """sync.bucket_bytes below the largest tensor (256 MiB against DeepSeek-V3's 1.85 GB embedding) is a target:
    the oversized tensor gets a bucket of its own size, the other buckets stay within bucket_bytes."""
    entry = inventories[("qwen3_moe", "ep2")]
    plan = _plan(entry, "ep2", EngineLayout(), "full", bucket_bytes=1024)
    assert plan.check_coverage() == []
    largest = max(s.hf_bytes for s in entry[0])
    assert largest > 1024 and plan.max_bucket_bytes == largest
    for bucket in plan.buckets:
        assert bucket.nbytes <= 1024 or len(bucket.entries) == 1 or len(bucket.sources) == 1


def test_refusals_name_the_problem(inventories) -> None:
    entry = inventories[("qwen3_moe", "ep2")]
    with pytest.raises(PlanError, match=r"sync.bucket_bytes=0 is invalid"):
        _plan(entry, "ep2", EngineLayout(), "full", bucket_bytes=0)
    pp = inventories[("qwen3", "pp2")]
    # one group of the embedding (stage 0) and the output layer (stage 1): no bucket can hold both
    split = (ReceiveTogether(r"^(lm_head|model\.embed_tokens)\.(?P<key>weight)$"),)
    with pytest.raises(PlanError, match=r"must reach an engine in one request, but leave from streams"):
        _plan(pp, "pp2", EngineLayout(), "full", together=split)
    with pytest.raises(PlanError, match="sync mode 'halves' is invalid"):
        _plan(entry, "ep2", EngineLayout(), "halves")
    with pytest.raises(PlanError, match="num_attention_heads=4 is not divisible by the engine's attention tp=8"):
        _plan(entry, "ep2", EngineLayout(1, tp=8), "full")
    with pytest.raises(PlanError, match="num_experts=4 is not divisible by the engine's ep=8"):
        _plan(entry, "ep2", EngineLayout(1, tp=8, ep=8, dp_attention=2), "full")


def test_coverage_names_a_missing_or_duplicated_tensor(inventories) -> None:
    import dataclasses

    plan = _plan(inventories[("qwen3", "tp2")], "tp2", EngineLayout(), "full")
    first, *rest = plan.buckets
    dropped = dataclasses.replace(first, entries=first.entries[1:])
    missing = dataclasses.replace(plan, buckets=(dropped, *rest))
    assert missing.check_coverage() == [f"{first.entries[0].name}: sent 0 times, expected once"]
    twice = dataclasses.replace(plan, buckets=(first, first, *rest))
    assert any("sent 2 times" in p for p in twice.check_coverage())


@pytest.mark.long
def test_plan_sync_tool_checks_a_1024_rank_deepseek_plan() -> None:
    import subprocess
    import sys

    cmd = [
        sys.executable, "tools/plan_sync.py", "--recipe", "deepseek_v3_671b_32n", "--actor-nodes", "64",
        "--engine-nodes", "64", "--engine-tp", "32", "--engine-ep", "32", "--dp-attention", "4",
        "--set", "actor.world_size=512",
    ]  # fmt: skip
    # ~34 s on an idle 2-core machine; how long it takes is tools/plan_sync.py's figure to print, not a test limit
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("plan: ")]
    assert [line.split()[3] for line in lines] == ["mode=full", "mode=shard_aware"]
    for line in lines:
        fields = dict(item.split("=") for item in line.split()[1:])
        assert fields["model"] == "deepseek_v3" and fields["ranks"] == "1024" and fields["coverage"] == "ok"
        assert float(fields["bound_s"]) <= float(fields["predicted_s"]) <= 1.5 * float(fields["bound_s"])
    assert float(dict(i.split("=") for i in lines[1].split()[1:])["predicted_s"]) <= 2.5


def test_plan_sync_tool_refuses_bad_arguments() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "tools/plan_sync.py", "--recipe", "no_such_recipe"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "--recipe no_such_recipe" in out.stderr
