"""verl's reference offload and DDP overlap keys on `python -m mcore_rl.train` (compat/verl/keys.py, derive.py).

- `actor_rollout_ref.ref.megatron.param_offload` (verl's default: actor.megatron.param_offload's; an FSDP reference:
  ref.fsdp_config.param_offload): true = actor.ref_placement=host, false = resident; none given = ours (null).
- `*.megatron.override_ddp_config.overlap_grad_reduce` / `overlap_param_gather` (actor and critic): our
  `<role>.optim.overlap_*`, down to the plan the ranks build (actor/optimizer.py `optimizer_plan`).
- the reference's override_ddp_config and the optimizer's copy of overlap_param_gather: ignored, with why.
"""

from __future__ import annotations

import pytest

from mcore_rl.compat.verl.cli import compose, translate
from mcore_rl.config import ConfigError, to_config

AR = "actor_rollout_ref"
DDP = f"{AR}.actor.megatron.override_ddp_config"


def _verl(model_dir: str, *extra: str) -> list[str]:
    return [f"{AR}.model.path={model_dir}", "trainer.total_training_steps=3", "trainer.n_gpus_per_node=2",
            f"{AR}.rollout.tensor_model_parallel_size=1", "data.train_batch_size=8",
            f"{AR}.actor.ppo_mini_batch_size=4", f"{AR}.rollout.name=sglang", "algorithm.adv_estimator=grpo",
            f"{AR}.actor.use_kl_loss=True", *extra]  # fmt: skip


def _run(args: list[str]):
    t = translate(args)
    assert t.errors == [], t.errors
    cfg = to_config(compose(t))
    assert t.errors == [], t.errors
    return cfg, "\n".join(t.lines)


@pytest.mark.parametrize(
    "overrides, placement",
    [
        ([], None),  # ours: host on CUDA (KEPT_DEFAULTS), resident on CPU
        ([f"{AR}.ref.megatron.param_offload=True"], "host"),
        ([f"{AR}.ref.megatron.param_offload=False"], "resident"),
        ([f"{AR}.actor.megatron.param_offload=True"], "host"),  # verl's default for the reference's
        ([f"{AR}.actor.megatron.param_offload=False"], "resident"),
        ([f"{AR}.actor.megatron.param_offload=True", f"{AR}.ref.megatron.param_offload=False"], "resident"),
        ([f"{AR}.ref.fsdp_config.param_offload=True"], "host"),  # an FSDP script's reference
        ([f"{AR}.ref.fsdp_config.param_offload=False"], "resident"),
        ([f"{AR}.ref.megatron.param_offload=True", "actor.ref_placement=resident"], "resident"),  # ours wins
    ],
)
def test_reference_param_offload_is_the_reference_placement(model_dir: str, overrides, placement) -> None:
    from mcore_rl.actor.reference import resolve_placement

    cfg, lines = _run(_verl(model_dir, *overrides))
    assert cfg.actor.use_ref and cfg.actor.ref_placement == placement
    resolved = resolve_placement(cfg.actor.ref_placement, cfg.trainer.runtime)
    assert resolved == (placement or "host")  # verl's runtime is cuda: our null is the host there
    if overrides and not overrides[-1].startswith("actor."):
        assert f"-> actor.ref_placement={placement!r}" in lines
    if any(o.startswith(f"{AR}.actor.megatron.param_offload") for o in overrides):  # what it means for the actor
        assert "megatron.param_offload=" in lines and "the actor's own weights: colocated placement" in lines


def test_a_reference_offload_that_is_not_a_switch_is_refused_by_name(model_dir: str) -> None:
    t = translate(_verl(model_dir, f"{AR}.ref.megatron.param_offload=sometimes"))
    assert len(t.errors) == 1, t.errors
    assert f"{AR}.ref.megatron.param_offload='sometimes' (our actor.ref_placement)" in t.errors[0]
    assert "expected True (host) or False (resident)" in t.errors[0]


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_ddp_overlap_keys_reach_the_plan_the_ranks_build(model_dir: str, role: str) -> None:
    from mcore_rl.actor.optimizer import optimizer_plan

    prefix = DDP if role == "actor" else "critic.megatron.override_ddp_config"
    extra = [] if role == "actor" else ["algorithm.adv_estimator=gae", f"critic.model.path={model_dir}"]
    cfg, lines = _run(_verl(model_dir, *extra))  # verl's keys absent: ours, on for CUDA
    group = getattr(cfg, role)
    assert group.optim.overlap_grad_reduce is None and group.optim.overlap_param_gather is None
    plan = optimizer_plan(group.optim, cfg.model.dtype, cfg.trainer.runtime, f"{role}.optim")
    assert plan.overlap_grad_reduce and plan.overlap_param_gather

    cfg, lines = _run(_verl(model_dir, *extra, f"+{prefix}.overlap_grad_reduce=False",
                            f"+{prefix}.overlap_param_gather=False"))  # fmt: skip
    plan = optimizer_plan(getattr(cfg, role).optim, cfg.model.dtype, cfg.trainer.runtime, f"{role}.optim")
    assert not plan.overlap_grad_reduce and not plan.overlap_param_gather
    assert f"overlap_grad_reduce=False -> {role}.optim.overlap_grad_reduce=False" in lines

    cfg, _ = _run(_verl(model_dir, *extra, f"+{prefix}.overlap_grad_reduce=True",
                        f"+{prefix}.overlap_param_gather=False"))  # fmt: skip
    plan = optimizer_plan(getattr(cfg, role).optim, cfg.model.dtype, cfg.trainer.runtime, f"{role}.optim")
    assert plan.overlap_grad_reduce and not plan.overlap_param_gather


def test_overlap_values_verl_could_not_run_either_are_refused(model_dir: str) -> None:
    t = translate(_verl(model_dir, f"+{DDP}.overlap_grad_reduce=maybe"))
    assert len(t.errors) == 1 and f"{DDP}.overlap_grad_reduce='maybe'" in t.errors[0], t.errors
    assert "(our actor.optim.overlap_grad_reduce) is invalid: expected true, false or null" in t.errors[0]
    # the overlapped gather without the overlapped reduce (Megatron's training loop refuses it too)
    t = translate(_verl(model_dir, f"+{DDP}.overlap_grad_reduce=False", f"+{DDP}.overlap_param_gather=True"))
    assert t.errors == []
    with pytest.raises(ConfigError, match=r"actor.optim.overlap_param_gather=True is invalid"):
        to_config(compose(t))


def test_siblings_without_a_meaning_here_are_ignored_with_why(model_dir: str) -> None:
    _, lines = _run(_verl(model_dir, f"+{AR}.ref.megatron.override_ddp_config.average_in_collective=False",
                          f"+{AR}.actor.optim.override_optimizer_config.overlap_param_gather=True",
                          f"{AR}.ref.megatron.grad_offload=True"))  # fmt: skip
    assert "average_in_collective=False: ignored: the reference is not trained" in lines
    assert "override_optimizer_config.overlap_param_gather=True: ignored: Megatron's OptimizerConfig copy" in lines
    assert "ref.megatron.grad_offload=True: ignored: the reference has no gradients" in lines
    # a DDP setting we do not have stays an unknown key, named with the closest one
    t = translate(_verl(model_dir, f"+{DDP}.bucket_size=1000"))
    assert len(t.errors) == 1 and f"unknown key '{DDP}.bucket_size'" in t.errors[0], t.errors


def test_offloading_the_critic_is_refused_not_dropped(model_dir: str) -> None:
    """Only the actor goes to the host while colocated engines generate: verl's critic offload would be lost."""
    gae = ["algorithm.adv_estimator=gae", f"critic.model.path={model_dir}"]
    offload = ["critic.megatron.param_offload=True", "critic.megatron.optimizer_offload=True"]
    t = translate(_verl(model_dir, *gae, *offload))
    assert len(t.errors) == 2, t.errors
    assert all("cannot be honoured here: offloading the critic" in e for e in t.errors)
    assert "critic.megatron.param_offload=True" in t.errors[0]
    _, lines = _run(_verl(model_dir, *gae, "critic.megatron.param_offload=False"))
    assert "critic.megatron.param_offload=False: ignored: the critic stays on its GPUs" in lines
