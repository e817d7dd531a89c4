"""actor.optim.overlap_grad_reduce / overlap_param_gather: Megatron DDP's overlapped gradient reduce and parameter
all-gather train the same parameters as the synchronous path (actor/optimizer.py).

A tiny bf16 Qwen3-MoE actor on 2 CPU/gloo ranks (dp=2), 3 updates of 2 mini-batches of 2-3 micro-batches per rank,
DDP buckets of ~4k parameters (so the gradient reduces and parameter gathers run bucket by bucket, asynchronously,
under the backward and the next forward). At dp=2 each reduced value is the sum of two fp32 values, which does not
depend on order or bucketing: the parameters are bit-identical to the non-overlapped run. The gradient norm sums
squares per optimizer shard, whose bounds follow the buckets, so it differs in fp32 summation order (~3e-8 relative);
it stays far under the clip here, which would otherwise carry that difference into the parameters (as would more
data-parallel ranks: expect fp32 reduction-order tolerance there, not bits).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen3_moe

HF = tiny_qwen3_moe(vocab_size=100)
BUCKET = 4096  #: parameters per DDP bucket: several buckets in this model, as a large model has
#: samples per update: 2, 3, 2 micro-batches of 2 per rank and mini-batch. A count that changes between steps (as with
#: dynamic batching) is what DDP's `no_sync` is needed for: without it, Megatron starts a bucket's reduce when every
#: parameter has reported as often as in the first step, early when a step has more micro-batches
SIZES = (16, 24, 16)


def _rank(rank: int, world: int, distributed: bool, reduce: bool, gather: bool) -> dict:
    import dataclasses

    from mcore_rl.actor import optimizer as optimizer_module
    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, ModelConfig, OptimConfig

    plain = optimizer_module.OptimizerPlan.ddp_config
    if reduce:  # Megatron's default bucket is 40M parameters: one bucket here; several make the overlap real
        optimizer_module.OptimizerPlan.ddp_config = lambda self: dataclasses.replace(plain(self), bucket_size=BUCKET)
    optim = OptimConfig(
        lr=1e-2, clip_grad=1e9, distributed=distributed, overlap_grad_reduce=reduce, overlap_param_gather=gather
    )
    cfg = ActorConfig(world_size=world, optim=optim, mini_batches=2, micro_batch_size=2, use_ref=False)
    actor = MegatronActor(rank, world, ModelConfig(hf_config=HF, dtype="bfloat16"), cfg)
    actor.initialize(("127.0.0.1", 0))  # the harness already started torch.distributed
    ddp = actor.ddp_chunks[0]
    out = {
        "plan": (actor.optim_plan.overlap_grad_reduce, actor.optim_plan.overlap_param_gather),
        "buckets": len(ddp.bucket_groups),
        "forward_hooks": len(ddp.remove_forward_pre_hook_handles),
        "grad_norms": [],
    }
    gen = torch.Generator().manual_seed(0)
    for size in SIZES:
        batch = TrainBatch(
            [[1, 2, 3]] * size,
            torch.randint(1, 90, (size, 4), generator=gen),
            torch.ones(size, 4),
            {"old_logprobs": torch.full((size, 4), -4.0), "advantages": torch.randn(size, 4, generator=gen)},
        )
        metrics = actor.update(batch).payload
        out["grad_norms"].append(metrics["actor/grad_norm"])
        assert metrics["actor/update_ok"] == 1.0
    out["params"] = [p.detach().clone() for chunk in actor.chunks for p in chunk.parameters()]
    out["logprobs"] = actor.logprobs(batch).payload  # what a step after the update reads: the gathered parameters
    optimizer_module.OptimizerPlan.ddp_config = plain
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    from mcore_rl.parallel.harness import run_on_ranks

    return {
        "sync": run_on_ranks(_rank, 2, (True, False, False)),
        "overlap": run_on_ranks(_rank, 2, (True, True, True)),
        "replicated_sync": run_on_ranks(_rank, 2, (False, False, False)),
        "replicated_overlap": run_on_ranks(_rank, 2, (False, True, False)),
    }


@pytest.mark.slow
@pytest.mark.parametrize(("base", "overlapped"), [("sync", "overlap"), ("replicated_sync", "replicated_overlap")])
def test_overlapped_reduce_and_gather_train_the_same_parameters(runs, base: str, overlapped: str) -> None:
    for ref, got in zip(runs[base], runs[overlapped]):
        assert ref["plan"] == (False, False)
        assert got["plan"] == (True, overlapped == "overlap")
        assert got["buckets"] > 1  # the overlap really ran bucket by bucket
        if overlapped == "overlap":
            assert got["forward_hooks"] > 0  # Megatron's param-gather pre-hooks are installed
        # the norm sums squares per optimizer shard, whose bounds follow the buckets: fp32 summation order only
        assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(ref["params"], got["params"]))
        assert torch.equal(ref["logprobs"], got["logprobs"])
    # and the ranks agree with each other (every rank holds the whole gathered model)
    first, second = runs["overlap"]
    assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"]))


def test_overlap_keys_resolve_by_runtime() -> None:
    from mcore_rl.actor.optimizer import optimizer_plan
    from mcore_rl.config import OptimConfig

    cuda, cpu = optimizer_plan(OptimConfig(), "bfloat16", "cuda"), optimizer_plan(OptimConfig(), "bfloat16", "cpu")
    assert (cuda.distributed, cuda.overlap_grad_reduce, cuda.overlap_param_gather) == (True, True, True)
    assert (cpu.distributed, cpu.overlap_grad_reduce, cpu.overlap_param_gather) == (False, False, False)
    ddp = cuda.ddp_config()
    assert (ddp.overlap_grad_reduce, ddp.overlap_param_gather, ddp.use_distributed_optimizer) == (True, True, True)
    # null follows what it needs: no distributed optimizer, no param gather to overlap
    plan = optimizer_plan(OptimConfig(distributed=False), "bfloat16", "cuda")
    assert (plan.overlap_grad_reduce, plan.overlap_param_gather) == (True, False)


@pytest.mark.parametrize(
    ("optim", "message"),
    [
        ({"overlap_grad_reduce": "sometimes"}, "actor.optim.overlap_grad_reduce='sometimes' is invalid"),
        ({"overlap_param_gather": 1}, "actor.optim.overlap_param_gather=1 is invalid"),
        ({"overlap_param_gather": True, "distributed": False}, "actor.optim.overlap_param_gather=True is invalid"),
        ({"overlap_param_gather": True, "overlap_grad_reduce": False}, "overlap_param_gather=True is invalid"),
    ],
)
def test_bad_overlap_values_are_refused_naming_the_key(optim: dict, message: str) -> None:
    from mcore_rl.config import ConfigError, OptimConfig

    with pytest.raises(ConfigError, match=message):
        OptimConfig(**optim).validate()


def test_param_gather_without_what_it_needs_on_this_runtime_is_refused() -> None:
    from mcore_rl.actor.optimizer import optimizer_plan
    from mcore_rl.config import ConfigError, OptimConfig

    # null distributed resolves to off on the CPU runtime: an explicit overlap_param_gather cannot be honoured
    with pytest.raises(ConfigError, match=r"critic.optim.overlap_param_gather=true needs critic.optim.distributed"):
        optimizer_plan(OptimConfig(overlap_param_gather=True), "bfloat16", "cpu", "critic.optim")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("actor.optim.overlap_param_gather=true", "overlap_param_gather=true needs actor.optim.distributed"),
        ("actor.optim.overlap_grad_reduce=sometimes", "actor.optim.overlap_grad_reduce"),
        ("actor.ref_placement=gpu", "actor.ref_placement='gpu' is invalid"),
    ],
)
def test_cli_refuses_bad_values_before_any_rank_starts(override: str, needle: str) -> None:
    import subprocess
    import sys
    from pathlib import Path

    res = subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", override],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    assert needle in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "Started a local Ray instance" not in res.stdout + res.stderr
