"""One sync leader for vLLM's one NCCL weight-transfer group: a vLLM worker holds one transfer group whose
rank 0 sends every broadcast, so for rollout.engine=vllm on CUDA with the distributed transport the plan puts every
stream (a MoE's dense and expert ones) on one actor rank (build_plan's `one_leader`, asked by
controller/weight_sync.py `one_sync_leader`), and a MoE over several actor ranks runs where it was refused.

Checked: the plan of a tiny Qwen3-MoE over 2 ranks (tp=2, dp=2) with one leader keeps every bucket as the spread plan
has it; pp=2 and ep=2 are refused naming the streams; the dry run (launch/submit.py --dry-run) of such a run passes;
and (slow, 2 gloo ranks) the controller's WeightSync asks the real actor ranks for the same plan as the dry run's.

Run: `.venv/bin/pytest tests/test_vllm_one_leader.py`
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tiny_models import tiny_qwen3_moe

from mcore_rl.controller.weight_sync import one_sync_leader
from mcore_rl.parallel.harness import run_on_ranks

MOE = tiny_qwen3_moe(vocab_size=70, initializer_range=0.5, max_position_embeddings=64, num_hidden_layers=2)
BUCKET = 1 << 15
LAYOUTS = {
    "tp2": {"actor.layout.tp": 2, "actor.layout.sequence_parallel": True},
    "dp2": {},  # world 2 at the default layout: two data-parallel replicas
    "pp2": {"actor.layout.pp": 2},
    "ep2": {"actor.layout.ep": 2},
}


def vllm_cfg(**over: Any) -> Any:
    """A run's config: the tiny MoE over 2 actor ranks, rollout.engine=vllm on CUDA, split, distributed, and `over`
    (dotted keys)."""
    from _config_keys import set_keys

    from mcore_rl.config import RLConfig

    given = {
        "trainer.runtime": "cuda", "rollout.engine": "vllm", "trainer.placement": "split",
        "sync.transport": "distributed", "sync.bucket_bytes": BUCKET, "model.hf_config": MOE,
        "actor.world_size": 2, "actor.use_ref": False, "rollout.num_engines": 1, **over,
    }  # fmt: skip
    return set_keys(RLConfig(), given)


def _dry_run_plans(rank: int, world: int) -> dict[str, Any]:
    """Rank body (a world of one): the dry run's plans (recipe_check.build_run_plan) of every layout, with one leader
    as the run asks (vLLM on CUDA) and spread (one_leader=False); the PlanError where one leader cannot be."""
    from mcore_rl.controller.recipe_check import build_run_plan, meta_inventory
    from mcore_rl.resharding.sync.plan import PlanError

    out: dict[str, Any] = {}
    for name, over in LAYOUTS.items():
        cfg = vllm_cfg(**over)
        inventory = meta_inventory(MOE, cfg.actor.layout.to_layout(), cfg.model.make_vocab_size_divisible_by, "float32")
        out[name, "spread"] = build_run_plan(cfg, MOE, inventory=inventory, one_leader=False)
        try:
            out[name, "vllm"] = build_run_plan(cfg, MOE, inventory=inventory)
        except PlanError as err:
            out[name, "vllm"] = str(err)
        out[name, "sglang"] = build_run_plan(vllm_cfg(**over, **{"rollout.engine": "sglang"}), MOE, inventory=inventory)
    return out


@pytest.fixture(scope="module")
def plans() -> dict[str, Any]:
    return run_on_ranks(_dry_run_plans, 1)[0]


def test_the_run_asks_for_one_leader_exactly_where_vllms_nccl_group_carries_the_push() -> None:
    assert one_sync_leader("vllm", "cuda", "distributed")
    assert not one_sync_leader("vllm", "cuda", "tensor")  # colocated: vLLM's IPC backend, no broadcast group
    assert not one_sync_leader("vllm", "cpu", "distributed")  # the CPU plugin's gloo groups: one per stream
    assert not one_sync_leader("sglang", "cuda", "distributed")  # SGLang joins one group per stream


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_one_leader_sends_every_stream_and_leaves_the_buckets_as_they_were(plans, layout: str) -> None:
    """With pp=1 and ep=1 every rank holds (a TP shard of) every stream: rank 0 leads the dense and the expert
    stream, and every bucket, byte and tensor is the spread plan's; only who sends differs."""
    one, spread = plans[layout, "vllm"], plans[layout, "spread"]
    assert [s.name for s in one.streams] == ["pp0-dense", "pp0-ep0"]
    assert {s.leader for s in spread.streams} == {0, 1}  # the spread plan: two senders, which vLLM cannot take
    assert [s.leader for s in one.streams] == [0, 0]
    for stream in one.streams:
        assert stream.leader in stream.group
        assert stream.group == ((0, 1) if layout == "tp2" else (0,))  # the leader's TP group gathers to it
    assert one.buckets == spread.buckets and one.sources == spread.sources
    assert (one.nbytes, one.max_bucket_bytes, one.largest_tensor_bytes) == (
        spread.nbytes, spread.max_bucket_bytes, spread.largest_tensor_bytes,
    )  # fmt: skip
    assert one.check_coverage() == []
    assert plans[layout, "sglang"] == spread  # other engines: the default placement, unchanged


@pytest.mark.parametrize(
    "layout, streams", [("pp2", "['pp0-dense', 'pp0-ep0', 'pp1-dense', 'pp1-ep0']"), ("ep2", "'pp0-ep0', 'pp0-ep1'")]
)
def test_one_leader_is_refused_naming_the_streams_where_no_rank_holds_them_all(plans, layout: str, streams: str):
    """Pipeline stages and EP ranks hold different weights: no rank can send them all (gpu_plan refuses these
    layouts for vLLM before anything starts; the planner says why too)."""
    message = plans[layout, "vllm"]
    assert isinstance(message, str), "expected a PlanError"
    assert "no actor rank holds every stream" in message and streams in message
    assert "expected actor.layout.pp=1 and actor.layout.ep=1" in message


def test_the_dry_run_of_a_moe_over_two_actor_ranks_into_vllm_passes_with_one_sender() -> None:
    """launch/submit.py --dry-run of rollout.engine=vllm, trainer.runtime=cuda, split, the default tiny Qwen3-MoE at
    actor.world_size=2 (tp=2): it was refused (exit 2, 'actor.world_size=2 with a MoE model'); now it passes and its
    sync plan has one leader for both streams."""
    from test_submit import run_submit

    overrides = ["trainer.runtime=cuda", "rollout.engine=vllm", "trainer.placement=split", "sync.transport=distributed",
                 "actor.world_size=2", "actor.layout.tp=2", "actor.layout.ep=1", "actor.layout.sequence_parallel=true",
                 "rollout.num_engines=1"]  # fmt: skip
    done = run_submit("--nodes", "1", "--gpus-per-node", "4", "--partition", "gpu", "--time", "1:00:00",
                      "--job-name", "t", "--dry-run", "--gpu-memory-gb", "80", "--", *overrides)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sync plan: 2 streams from 1 leader rank(s) (all on one: vLLM's one NCCL weight-transfer group)" in (
        done.stdout
    ), done.stdout


# ---------------------------------------------------------------- the ranks' plan, as the controller asks for it
def _weight_sync_rank(rank: int, world: int, over: dict) -> dict[str, Any]:
    """Rank body: a real actor rank of the run's config, and the controller's WeightSync.__init__ as written (it asks
    the ranks for the plan, checks the digests agree and vLLM's one leader); stood in: Ray (each rank's own call
    runs here, collectively with the other rank's) and the engine pool (one engine answering /model_info)."""
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.controller import weight_sync
    from mcore_rl.resharding.sync.transports import InProcessTransport
    from mcore_rl.resharding.weight_map import export_hf_weights

    cfg = vllm_cfg(**over)
    actor = MegatronActor(rank, world, cfg.model, cfg.actor)
    actor.initialize(("127.0.0.1", 0))
    weight_sync.ray = SimpleNamespace(get=lambda ref: ref)  # this rank process only
    group = SimpleNamespace(  # ActorGroup's calls, given MegatronActor methods
        call=lambda method, *args: [getattr(actor, method.__name__)(*args)],
        call_rank=lambda rank, method, *args: getattr(actor, method.__name__)(*args),
    )
    pool = SimpleNamespace(
        client=SimpleNamespace(get=lambda url, path: (200, {"model_type": MOE["model_type"]})),
        urls=["http://engine"], replace=lambda url, why: None,
    )  # fmt: skip
    ws = weight_sync.WeightSync(group, pool, cfg.sync, cfg.rollout, cfg.trainer.runtime, "/nonexistent", model=MOE)
    sender = actor._sender()
    delivered: dict[str, torch.Tensor] = {}

    def receive(stream: Any, bucket: Any, buffer: torch.Tensor) -> None:
        for e in bucket.entries:
            assert e.name not in delivered, f"{e.name} arrived twice"
            delivered[e.name] = (
                buffer[e.offset : e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape).clone()
            )

    stats = sender.executor.run(InProcessTransport(receive))  # each rank's part: gather, and the leader packs
    reference = export_hf_weights(actor.chunks, actor.contexts, actor.weight_map, actor.pg.tp, actor.pg.expt_tp)
    return {"digest": ws.digest, "leaders": ws.summary["stream_leaders"], "plan": sender.plan_, "delivered": delivered,
            "reference": {n: t.clone() for n, t in reference}, "peak": stats.peak_extra_bytes}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_the_ranks_plan_for_vllm_has_one_leader_and_is_the_dry_runs(plans, layout: str) -> None:
    """WeightSync asks the real ranks for their plan with one leader (before: two leaders, and its own guard,
    check_vllm_streams, refused the run at start); the ranks' plan is the dry run's, byte for byte (same digest); run
    through the in-process transport, rank 0 sends every tensor bit exact (at tp=2 gathered from both ranks) within
    the sender's memory the dry run prints, and rank 1 sends none."""
    ranks = run_on_ranks(_weight_sync_rank, 2, (LAYOUTS[layout],))
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert ranks[0]["leaders"] == [0, 0]
    dry = plans[layout, "vllm"]
    assert [(s.name, s.leader, s.group) for s in ranks[0]["plan"].streams] == [
        (s.name, s.leader, s.group) for s in dry.streams
    ]
    assert ranks[0]["plan"].buckets == dry.buckets
    assert ranks[0]["digest"] == dry.digest()
    reference = ranks[0]["reference"]
    assert ranks[1]["delivered"] == {} and sorted(ranks[0]["delivered"]) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(ranks[0]["delivered"][name], tensor), name
    assert ranks[0]["peak"] <= 2 * dry.max_bucket_bytes + dry.largest_tensor_bytes


# The long tier: the run's own plan with one leader is the CI tier's test above (the real ranks, the dry run's digest);
# this runs tools/plan_sync.py four times (about 45 s in CI).
@pytest.mark.long
def test_plan_sync_puts_the_streams_on_one_leader_as_the_run_would() -> None:
    """tools/plan_sync.py plans as the run does (one leader for vLLM on CUDA, split), or as --[no-]one-leader says."""
    import subprocess
    import sys

    base = [sys.executable, "tools/plan_sync.py", "--recipe", "default", "--engine-nodes", "1", "--gpus-per-node", "2",
            "--engine-tp", "1", "--engine-ep", "1", "--mode", "full", "--set", "actor.layout.ep=1",
            "--set", "actor.layout.tp=2", "--set", "actor.layout.sequence_parallel=true"]  # fmt: skip
    vllm = ["--set", "trainer.runtime=cuda", "--set", "rollout.engine=vllm", "--set", "trainer.placement=split"]
    for extra, leaders in [(vllm, 1), ([], 2), ([*vllm, "--no-one-leader"], 2)]:
        out = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"2 streams from {leaders} leader rank(s)" in out.stdout, (extra, out.stdout)
    ep2 = [arg.replace("actor.layout.ep=1", "actor.layout.ep=2") for arg in base[:-4]]  # and tp=1
    refused = subprocess.run([*ep2, "--one-leader"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "no actor rank holds every stream" in refused.stderr, refused.stderr[-2000:]
