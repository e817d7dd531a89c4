"""The optimizer the actor builds is the one the dry run counts (mcore_rl/actor/optimizer.py).

A tiny bf16 Qwen3-MoE actor on 2 CPU/gloo ranks (ep=2: dense dp=2, expert dp=1), with and without Megatron's
distributed optimizer, takes real update steps; its parameters, main-grad buffers, fp32 masters, Adam state and
reference copy are counted from the live objects and compared with `estimate_memory` fed by `rank_params` (the
meta-device model) and the same `OptimizerPlan`. The lr schedule is read back from the optimizer's param groups.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_qwen3_moe

HF = tiny_qwen3_moe(vocab_size=100)
WARMUP, DECAY, LR, MIN_LR = 2, 6, 1e-3, 1e-4


def _optim(distributed: bool):  # noqa: ANN202
    from mcore_rl.config import OptimConfig

    return OptimConfig(
        lr=LR, min_lr=MIN_LR, distributed=distributed, lr_warmup_steps=WARMUP, lr_decay_style="cosine",
        lr_decay_steps=DECAY,
    )  # fmt: skip


def _nbytes(tensors) -> int:  # noqa: ANN001
    return sum(t.numel() * t.element_size() for t in tensors)


def _rank(rank: int, world: int, distributed: bool) -> dict:
    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig

    cfg = ActorConfig(
        world_size=world, layout=LayoutConfig(ep=2), optim=_optim(distributed), mini_batches=1, use_ref=True
    )
    actor = MegatronActor(rank, world, ModelConfig(hf_config=HF, dtype="bfloat16"), cfg)
    actor.initialize(("127.0.0.1", 0))  # the harness already started torch.distributed
    gen = torch.Generator().manual_seed(0)
    lrs, grad_norms = [], []
    for _ in range(4):  # 4 optimizer steps (one mini-batch per update)
        batch = TrainBatch(
            [[1, 2, 3]] * 8,
            torch.randint(1, 90, (8, 4), generator=gen),
            torch.ones(8, 4),
            {"old_logprobs": torch.full((8, 4), -4.0), "advantages": torch.randn(8, 4, generator=gen)},
        )
        out = actor.update(batch).payload
        lrs.append(out["actor/lr"])
        grad_norms.append(out["actor/grad_norm"])
    params = [p for chunk in actor.chunks for p in chunk.parameters()]
    # What the optimizer's inner torch Adam steps (fp32 masters of the bf16 weights) and its state (m, v).
    inner = [opt.optimizer for opt in actor.optimizer.chained_optimizers]
    masters = [p for opt in inner for group in opt.param_groups for p in group["params"]]
    state = [t for opt in inner for s in opt.state.values() for k, t in s.items() if k != "step"]
    return {
        "weights": _nbytes(params),
        "grads": _nbytes(p.main_grad for p in params),
        "masters": _nbytes(masters),
        "master_dtypes": sorted({str(p.dtype) for p in masters}),
        "optimizer": _nbytes(masters) + _nbytes(state),
        "reference": _nbytes(p for chunk in actor.ref_chunks for p in chunk.parameters()),
        "lrs": lrs,
        "optimizer_class": type(actor.optimizer.chained_optimizers[0]).__name__,
        "grad_norms": grad_norms,
        "checksum": float(sum(p.float().double().sum() for p in params)),
    }


def _estimate(rank: int, world: int, distributed: bool):  # noqa: ANN202
    from mcore_rl.actor.optimizer import optimizer_plan
    from mcore_rl.models.estimate import estimate_memory, rank_params
    from mcore_rl.parallel.layout import ParallelLayout

    layout = ParallelLayout(ep=2)
    params = rank_params(HF, layout, 64, "bfloat16")
    plan = optimizer_plan(_optim(distributed), "bfloat16", "cpu")
    est = estimate_memory(HF, 2, tp=1, pp=1, ep=2, plan=plan, params=params, use_ref=True)
    return {k: getattr(est, k) for k in ("weights", "grads", "optimizer", "reference", "dp", "expert_dp")}


@pytest.fixture(scope="module")
def built() -> dict[bool, list[dict]]:
    from mcore_rl.parallel.harness import run_on_ranks

    return {d: run_on_ranks(_rank, 2, (d,)) for d in (False, True)}


@pytest.mark.slow
@pytest.mark.parametrize("distributed", [False, True])
def test_dry_run_estimate_equals_what_the_ranks_allocate(built, distributed: bool) -> None:
    from mcore_rl.parallel.harness import run_on_ranks

    (est,) = run_on_ranks(_estimate, 1, (distributed,))
    ranks = built[distributed]
    assert (est["dp"], est["expert_dp"]) == (2, 1)
    for got in ranks:
        assert got["weights"] == est["weights"] and got["reference"] == est["reference"]
        assert got["grads"] == est["grads"]
        assert got["master_dtypes"] == ["torch.float32"]  # bf16 weights, fp32 masters
    if distributed:
        # Shard boundaries follow Megatron's bucket padding, so one rank may hold a few elements more than the other;
        # together the dp ranks hold the dense state once and each its own experts, exactly as estimated.
        assert sum(g["optimizer"] for g in ranks) == pytest.approx(2 * est["optimizer"], abs=0)
        assert all(abs(g["optimizer"] - est["optimizer"]) < 0.05 * est["optimizer"] for g in ranks)
    else:
        assert all(g["optimizer"] == est["optimizer"] for g in ranks)


@pytest.mark.slow
def test_distributed_optimizer_steps_like_the_replicated_one(built) -> None:
    for replicated, sharded in zip(built[False], built[True]):
        assert replicated["grad_norms"] == pytest.approx(sharded["grad_norms"], rel=1e-5)
        assert replicated["checksum"] == pytest.approx(sharded["checksum"], rel=1e-6)
    assert built[True][0]["optimizer"] < built[False][0]["optimizer"]  # the dense state is sharded
    assert built[True][0]["optimizer_class"] == "DistributedOptimizer"
    assert built[False][0]["optimizer_class"] == "Float16OptimizerWithFloat16Params"


@pytest.mark.slow
def test_lr_warms_up_then_decays_by_megatron_schedule(built) -> None:
    def expected(step: int) -> float:
        if step <= WARMUP:
            return LR * step / WARMUP
        ratio = (step - WARMUP) / (DECAY - WARMUP)
        return MIN_LR + (LR - MIN_LR) * 0.5 * (math.cos(math.pi * ratio) + 1)

    assert built[True][0]["lrs"] == pytest.approx([expected(i) for i in range(1, 5)])


def test_bad_optimizer_settings_are_refused() -> None:
    from mcore_rl.config import ConfigError, OptimConfig

    with pytest.raises(ConfigError, match="actor.optim.lr_decay_style='cosine_restarts'"):
        OptimConfig(lr_decay_style="cosine_restarts").validate()
    with pytest.raises(ConfigError, match="actor.optim.offload_fraction=0.5 .*distributed"):
        OptimConfig(offload_fraction=0.5, distributed=False).validate()
    with pytest.raises(ConfigError, match="actor.optim.lr_warmup_steps=6 .*fewer than actor.optim.lr_decay_steps=6"):
        OptimConfig(lr_warmup_steps=6, lr_decay_steps=6).validate()
    with pytest.raises(ConfigError, match="actor.optim.min_lr"):
        OptimConfig(lr=1e-4, min_lr=1e-3).validate()


def test_lr_decay_spans_the_run_by_default() -> None:
    from mcore_rl.config import ConfigError, RLConfig

    cfg = RLConfig()
    cfg.model.hf_config = HF
    cfg.trainer.steps, cfg.actor.mini_batches, cfg.actor.ppo_epochs = 5, 2, 3
    cfg.validate()
    assert cfg.actor.optim.lr_decay_steps == 5 * 2 * 3
    cfg.actor.optim.offload_fraction, cfg.actor.optim.distributed = 1.0, True
    with pytest.raises(ConfigError, match="actor.optim.offload_fraction=1.0 .*trainer.runtime=cpu"):
        cfg.validate()
