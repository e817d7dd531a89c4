"""actor.ref_placement=host keeps one model on the device and gives what the resident reference gives
(actor/reference.py).

A tiny bf16 Qwen3-MoE actor on 2 CPU/gloo ranks (ep=2, the distributed optimizer: parameters are views of DDP's flat
buffer) runs the same two RL steps with the reference resident and on the host: reference logprobs, the update's
losses, the parameters after it and the policy's logprobs must be equal to the bit; with `host` the modules the actor
holds have one model's parameters; a checkpoint written with the reference on the host holds the reference, and
loading it (into either placement) restores the reference after it was changed.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen3_moe

HF = tiny_qwen3_moe(vocab_size=100)


def _batch(seed: int):  # noqa: ANN202
    from mcore_rl.actor.batch import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    return TrainBatch(
        [[1, 2, 3]] * 8,
        torch.randint(1, 90, (8, 4), generator=gen),
        torch.ones(8, 4),
        {"old_logprobs": torch.full((8, 4), -4.0), "advantages": torch.randn(8, 4, generator=gen)},
    )


def _module_params(actor) -> tuple[int, int]:  # noqa: ANN001
    """(distinct storages, bytes) of every parameter of every module the actor holds: policy and resident reference."""
    params = [p for chunk in list(actor.chunks) + list(actor.ref_chunks) for p in chunk.parameters()]
    storages = {p.untyped_storage().data_ptr() for p in params}
    return len(storages), sum(p.numel() * p.element_size() for p in params)


def _rank(rank: int, world: int, placement: str, save: str | None, load: str | None) -> dict:
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig, OptimConfig

    cfg = ActorConfig(
        world_size=world, layout=LayoutConfig(ep=2), optim=OptimConfig(lr=1e-2, distributed=True), mini_batches=2,
        use_ref=True, ref_placement=placement, kl_loss_coef=0.1,
    )  # fmt: skip
    actor = MegatronActor(rank, world, ModelConfig(hf_config=HF, dtype="bfloat16"), cfg)
    actor.initialize(("127.0.0.1", 0))  # the harness already started torch.distributed
    policy_bytes = sum(p.numel() * p.element_size() for chunk in actor.chunks for p in chunk.parameters())
    out = {"placement": actor.reference.placement, "policy_bytes": policy_bytes, "built": _module_params(actor)}
    if placement == "host":
        from mcore_rl.actor.reference import model_tensors

        out["copies"] = (len(actor.reference._live), len(model_tensors(actor.chunks)))
    out["ref0"] = actor.logprobs(_batch(0), use_ref=True).payload
    out["policy0"] = actor.logprobs(_batch(0)).payload
    step = actor.logprobs_and_update(_batch(1), use_ref=True).payload  # old + ref pass, then 2 optimizer steps
    out["metrics"] = {k: v for k, v in step["metrics"].items() if not k.startswith(("timing", "perf"))}
    out["ref1"], out["old1"] = step["ref_logprobs"], step["old_logprobs"]
    out["training"] = _module_params(actor)  # after an update: still one model with `host`
    both = actor.policy_and_ref_logprobs(_batch(2)).payload  # a reference pass with a trained policy parked
    out["policy2"], out["ref2"] = both[:, 0], both[:, 1]
    out["policy2_after_ref"] = actor.logprobs(_batch(2)).payload
    step = actor.logprobs_and_update(_batch(4), use_ref=True).payload  # ref pass, then the update from the policy
    out["metrics2"] = {k: v for k, v in step["metrics"].items() if not k.startswith(("timing", "perf"))}
    out["params"] = [p.detach().clone() for chunk in actor.chunks for p in chunk.parameters()]
    out["policy4"] = actor.logprobs(_batch(2)).payload
    if save:
        actor.save_checkpoint(save, with_reference=True)
        # change the reference (and the policy, by one more update) after the save: loading must undo both
        with actor.reference.weights_in(actor, writeback=True) as chunks, torch.no_grad():
            for chunk in chunks:
                for p in chunk.parameters():
                    p.mul_(0.5)
        out["ref_changed"] = actor.logprobs(_batch(2), use_ref=True).payload
        actor.update(_batch(3))
    if load:
        actor.load_checkpoint(load)
        out["ref_loaded"] = actor.logprobs(_batch(2), use_ref=True).payload
        out["policy_loaded"] = actor.logprobs(_batch(2)).payload
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    from mcore_rl.parallel.harness import run_on_ranks

    ckpt = str(tmp_path_factory.mktemp("ref_ckpt"))
    host = run_on_ranks(_rank, 2, ("host", ckpt, ckpt))
    resident = run_on_ranks(_rank, 2, ("resident", None, ckpt))  # loads the checkpoint the host run wrote
    return {"host": host, "resident": resident}


@pytest.mark.slow
def test_host_reference_logprobs_are_the_resident_ones(runs) -> None:
    for host, resident in zip(runs["host"], runs["resident"]):
        assert (host["placement"], resident["placement"]) == ("host", "resident")
        for key in ("ref0", "ref1", "ref2"):
            assert torch.equal(host[key], resident[key]), key
        # the reference is the policy as built, and stays it while the policy trains
        assert torch.equal(host["ref0"], host["policy0"])
        assert not torch.equal(host["policy2"], host["ref2"])


@pytest.mark.slow
def test_policy_trains_the_same_with_the_reference_on_the_host(runs) -> None:
    for host, resident in zip(runs["host"], runs["resident"]):
        assert host["metrics"] == resident["metrics"] and host["metrics2"] == resident["metrics2"]
        assert host["metrics2"]["actor/kl_loss"] != 0.0  # the KL to the (now different) reference is in the loss
        assert len(host["params"]) == len(resident["params"])
        assert all(torch.equal(a, b) for a, b in zip(host["params"], resident["params"]))
        for key in ("old1", "policy2", "policy4"):
            assert torch.equal(host[key], resident[key]), key
        assert torch.equal(host["policy2_after_ref"], host["policy2"])  # the policy is back after a reference pass


@pytest.mark.slow
def test_host_reference_keeps_one_model_in_device_storage(runs) -> None:
    for host, resident in zip(runs["host"], runs["resident"]):
        policy = host["policy_bytes"]
        assert host["built"][1] == host["training"][1] == policy  # the policy's parameters only
        swapped, tensors = host["copies"]
        assert swapped < tensors  # DDP's flat parameter buffers are copied whole, not tensor by tensor
        assert resident["built"][1] == resident["training"][1] == 2 * policy  # a second model beside it
        assert host["training"][0] < resident["training"][0]  # the reference's storages are gone from the modules


@pytest.mark.slow
def test_checkpoint_writes_and_restores_the_host_reference(runs) -> None:
    for host, resident in zip(runs["host"], runs["resident"]):
        assert not torch.equal(host["ref_changed"], host["ref2"])  # the reference really changed after the save
        assert torch.equal(host["ref_loaded"], host["ref2"])  # ... and the checkpoint brought it back
        assert torch.equal(host["policy_loaded"], host["policy4"])  # the policy as saved
        # the same checkpoint into a resident reference: the on-disk format does not depend on the placement
        assert torch.equal(resident["ref_loaded"], host["ref2"])
        assert torch.equal(resident["policy_loaded"], host["policy4"])


def test_ref_placement_resolves_by_runtime_and_refuses_unknown_names() -> None:
    from mcore_rl.actor.reference import PLACEMENTS, resolve_placement
    from mcore_rl.config import ActorConfig, ConfigError
    from mcore_rl.config.names import REF_PLACEMENTS

    assert tuple(PLACEMENTS) == REF_PLACEMENTS
    assert resolve_placement(None, "cuda") == "host" and resolve_placement(None, "cpu") == "resident"
    assert resolve_placement("host", "cpu") == "host"
    with pytest.raises(ConfigError, match=r"actor.ref_placement='gpu' is invalid: expected null or one of"):
        ActorConfig(ref_placement="gpu").validate()


def test_estimate_counts_a_host_reference_on_the_host() -> None:
    from mcore_rl.actor.optimizer import optimizer_plan
    from mcore_rl.config import OptimConfig
    from mcore_rl.models.estimate import estimate_memory

    plan = optimizer_plan(OptimConfig(), "bfloat16", "cuda")
    resident = estimate_memory(HF, 2, tp=1, pp=1, ep=2, plan=plan, ref_placement="resident")
    host = estimate_memory(HF, 2, tp=1, pp=1, ep=2, plan=plan, ref_placement="host")
    assert resident.reference == resident.weights > 0 and resident.reference_host == 0
    assert host.reference == 0 and host.reference_host == 2 * host.weights  # the reference + the parked policy
    assert host.total == resident.total - resident.weights
    assert "swapped in per pass" in host.describe()


@pytest.mark.gpu
def test_cuda_host_reference_is_pinned_saves_device_memory_and_matches_resident() -> None:
    """On one GPU (NCCL, distributed optimizer, overlapped reduce and gather: the CUDA defaults): the host reference's
    weights are pinned, the actor holds one model's weights less on the device, and the reference logprobs before and
    after an update are those of the resident reference, and the update's losses and policy match it."""
    import gc

    from test_cuda_first_run import QWEN3_MOE_TINY

    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, ModelConfig, OptimConfig
    from mcore_rl.parallel.groups import destroy_model_parallel, free_port

    got = {}
    for placement in ("resident", "host"):
        torch.manual_seed(0)
        batch = TrainBatch([[3, 4, 5], [6, 7]] * 2, torch.randint(1, 90, (4, 4)), torch.ones(4, 4))
        batch.tensors.update(advantages=torch.randn(4, 4))
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        cfg = ActorConfig(
            world_size=1, use_ref=True, ref_placement=placement, kl_loss_coef=0.1, mini_batches=2,
            optim=OptimConfig(distributed=True),
        )  # fmt: skip
        actor = MegatronActor(0, 1, ModelConfig(hf_config=QWEN3_MOE_TINY, dtype="bfloat16"), cfg, runtime="cuda")
        try:
            actor.initialize(("127.0.0.1", free_port()))
            out = {"allocated": torch.cuda.memory_allocated() - before, "plan": actor.optim_plan}
            out["weights"] = sum(p.numel() * p.element_size() for c in actor.chunks for p in c.parameters())
            if placement == "host":
                out["pinned"] = all(t.is_pinned() for t in actor.reference._ref + actor.reference._park)
            out["ref0"] = actor.logprobs(batch, use_ref=True).payload
            step = actor.logprobs_and_update(batch, use_ref=True).payload
            out["metrics"] = {k: v for k, v in step["metrics"].items() if not k.startswith(("timing", "perf"))}
            out["ref1"] = actor.logprobs(batch, use_ref=True).payload
            out["policy1"] = actor.logprobs(batch).payload
            got[placement] = out
        finally:
            destroy_model_parallel()
            del actor
    host, resident = got["host"], got["resident"]
    assert host["plan"].overlap_grad_reduce and host["plan"].overlap_param_gather  # the CUDA defaults
    assert host["pinned"]
    assert resident["allocated"] - host["allocated"] >= 0.9 * host["weights"]
    assert torch.equal(host["ref0"], resident["ref0"]) and torch.equal(host["ref1"], resident["ref1"])
    assert torch.equal(host["ref0"], host["ref1"])  # the reference does not train
    # two separate trainings on a GPU: equal up to CUDA's non-deterministic reductions in the backward
    assert host["metrics"] == pytest.approx(resident["metrics"], rel=1e-3)
    assert torch.allclose(host["policy1"], resident["policy1"], atol=5e-2)
    assert not torch.equal(host["policy1"], host["ref1"])


@pytest.mark.long
@pytest.mark.slow
def test_a_run_with_the_reference_on_the_host_and_overlap_resumes_like_a_plain_run(tmp_path) -> None:
    """The whole loop (Ray, rollouts, weight sync after each update), GRPO with a KL loss on the distributed optimizer:
    2 steps with the reference resident and no overlap, saving each step; then its step-1 checkpoint resumed with
    actor.ref_placement=host and the overlapped reduce and gather for step 2: every logged metric of step 2 equal
    (the reference restored from the checkpoint onto the host, the KL to it, the update, the weights pushed)."""
    import json
    import subprocess
    import sys

    from _ray_cluster import ray_address_override, train_env

    common = [
        "data.batch_size=4", "rollout.n=4", "rollout.max_running_requests=4", "model.make_vocab_size_divisible_by=32",
        "trainer.steps=2", "actor.use_ref=true", "actor.kl_loss_coef=0.01", "actor.optim.distributed=true",
        ray_address_override(),
    ]  # fmt: skip
    swapped = [
        "actor.ref_placement=host",
        "actor.optim.overlap_grad_reduce=true",
        "actor.optim.overlap_param_gather=true",
    ]
    plain = ["actor.ref_placement=resident", "actor.optim.overlap_grad_reduce=false"]

    def train(run_dir, *overrides: str) -> list[dict]:  # noqa: ANN001
        args = [sys.executable, "-m", "mcore_rl.train", *common, f"trainer.run_dir={run_dir}", *overrides]
        out = subprocess.run(args, capture_output=True, text=True, timeout=600, env=train_env())
        assert out.returncode == 0, out.stderr[-3000:]
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        timed = ("timing_s/", "timing_per_token_ms/", "perf/")
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(timed)} for line in lines]

    want = train(tmp_path / "plain", *plain, "trainer.save_every=1", "trainer.keep_last=null")
    got = train(tmp_path / "swapped", *swapped, f"trainer.resume={tmp_path / 'plain/checkpoints/step_00000001'}")
    assert [m["step"] for m in got] == [2]
    assert got[0]["actor/kl_loss"] != 0.0
    assert got == [m for m in want if m["step"] == 2]
