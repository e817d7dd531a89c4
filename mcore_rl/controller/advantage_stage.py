"""From a scored batch with old/ref logprobs (and critic values) to what the update reads: advantages, critic returns
and rollout-correction weights.

    stage = AdvantageStage(cfg.algorithm, state.controllers)     # the KL controller's state lives in the loop state
    metrics = stage.compute(rollouts)        # fills batch.tensors: advantages, returns (critic), importance_weights

    old vs rollout logprobs -> rollout correction (TIS / MIS weights, mismatch metrics)      algorithms/mismatch.py
    scores -> token rewards (outcome on the last token) -> - kl_coef * KL(old || ref)        algorithms/kl.py
           -> the estimator named by algorithm.adv_estimator                                 algorithms/advantages.py

Estimators are called by the names of their parameters (rewards, token_level_rewards, values, baseline_rewards,
group_ids, gamma, lam, norm_by_std), so every entry of ADVANTAGE_ESTIMATORS runs without a per-name branch here.
Outcome estimators see the sequence reward as the sum of the token rewards, so the in-reward KL reaches them too
(as in verl).
"""

from __future__ import annotations

import inspect
from dataclasses import asdict
from typing import Any

import torch

from mcore_rl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_advantages,
    outcome_to_token_rewards,
    rollout_correction,
)
from mcore_rl.config import AlgorithmConfig
from mcore_rl.controller.producer import Rollouts

KL_STATE = "kl_ctrl"
"""The key of the in-reward KL controller's state in LoopState.controllers."""


class AdvantageStage:
    """Advantages for one step's batch; holds the in-reward KL controller (its coefficient is checkpointed)."""

    def __init__(self, cfg: AlgorithmConfig, controllers: dict[str, Any]) -> None:
        """`controllers` is LoopState.controllers: a resumed run continues with the saved coefficient."""
        self.cfg, self.controllers = cfg, controllers
        self.kl_ctrl: FixedKLController | AdaptiveKLController | None = None
        if cfg.use_kl_in_reward:
            k = cfg.kl_ctrl
            value = controllers.get(KL_STATE, {}).get("kl_coef", k.kl_coef)
            if k.type == "adaptive":
                self.kl_ctrl = AdaptiveKLController(value=value, target=k.target_kl, horizon=k.horizon)
            else:
                self.kl_ctrl = FixedKLController(value=value)

    @property
    def reads_old_logprobs(self) -> bool:
        """Whether `compute` needs old logprobs: for the KL penalty in the reward, or for rollout-correction weights.
        When it does not, the loop runs the old-logprob pass inside the update call (`correction` adds the mismatch
        metrics afterwards)."""
        rc = self.cfg.rollout_correction
        return self.kl_ctrl is not None or rc.rollout_is is not None or rc.rollout_rs is not None

    def correction(self, rollouts: Rollouts) -> dict[str, float]:
        """Rollout correction from old vs rollout logprobs: `importance_weights` when it is on, and the mismatch
        metrics (rollout_corr/*)."""
        tensors = rollouts.batch.tensors
        weights, corr = rollout_correction(
            tensors["old_logprobs"],
            tensors["rollout_logprobs"],
            rollouts.batch.response_mask,
            **asdict(self.cfg.rollout_correction),
        )
        if weights is not None:
            tensors["importance_weights"] = weights
        return {f"rollout_corr/{k}": float(v) for k, v in corr.items()}

    def compute(self, rollouts: Rollouts, correct: bool = True) -> dict[str, float]:
        """Fill `rollouts.batch.tensors` (advantages; returns when there are values; importance_weights when rollout
        correction is on) and return the step's metrics. `correct=False`: without `correction` (called later)."""
        batch = rollouts.batch
        tensors, mask = batch.tensors, batch.response_mask
        metrics: dict[str, float] = self.correction(rollouts) if correct else {}

        token_rewards = outcome_to_token_rewards(rollouts.scores, mask)
        if self.kl_ctrl is not None:
            token_rewards, kl = apply_kl_penalty(
                token_rewards,
                tensors["old_logprobs"],
                tensors["ref_logprobs"],
                mask,
                kl_coef=self.kl_ctrl.value,
                kind=self.cfg.kl_penalty,
            )
            metrics["actor/reward_kl_penalty"] = float(kl["kl_token_mean"])
            metrics["actor/reward_kl_penalty_coeff"] = self.kl_ctrl.value
            self.kl_ctrl.update(float(kl["kl_token_mean"]), n_steps=batch.size)
            self.controllers[KL_STATE] = {"kl_coef": self.kl_ctrl.value}

        # Outcome estimators: the sequence reward is the sum of the token rewards once the KL penalty is in them.
        rewards = rollouts.scores if self.kl_ctrl is None else token_rewards.sum(dim=-1)
        out = estimate(
            self.cfg, rewards, token_rewards, mask, rollouts.group_ids, tensors.get("values"), rollouts.baseline_scores
        )
        tensors["advantages"] = out.advantages
        if "values" in tensors:
            tensors["returns"] = out.returns
            metrics["critic/values/mean"] = float((tensors["values"] * mask).sum() / mask.sum().clamp_min(1))
            metrics["critic/returns/mean"] = float((out.returns * mask).sum() / mask.sum().clamp_min(1))
        return metrics


def estimate(
    cfg: AlgorithmConfig,
    rewards: torch.Tensor,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
) -> Any:
    """Run `cfg.adv_estimator` with the inputs its signature names; refuses a missing critic value or baseline."""
    available: dict[str, Any] = {
        "rewards": rewards,
        "token_level_rewards": token_rewards,
        "response_mask": response_mask,
        "group_ids": group_ids,
        "values": values,
        "baseline_rewards": baseline_rewards,
        "gamma": cfg.gamma,
        "lam": cfg.lam,
        "norm_by_std": cfg.norm_adv_by_std,
    }
    params = inspect.signature(ADVANTAGE_ESTIMATORS[cfg.adv_estimator]).parameters
    kwargs = {name: available[name] for name in params if name in available}
    missing = [name for name, value in kwargs.items() if value is None]
    if missing:
        raise ValueError(f"algorithm.adv_estimator={cfg.adv_estimator!r} needs {missing}, which this step lacks")
    return compute_advantages(cfg.adv_estimator, **kwargs)


def check_engine_agrees(rollouts: Rollouts, tolerance: float | None, setup: str) -> None:
    """The first step's check that the engines sample from the model the actor trains: the mean absolute difference
    of their logprobs of the sampled tokens (rollout_logprobs) and the actor's (old_logprobs), per token. Above
    `tolerance`, ConfigError (exit 2) naming the figure and the likely causes; `setup` describes the run's tokenizer,
    temperatures and engine for the message. Every later step only logs the figure (rollout/logprob_abs_diff)."""
    tensors, mask = rollouts.batch.tensors, rollouts.batch.response_mask
    if tolerance is None or "old_logprobs" not in tensors or "rollout_logprobs" not in tensors or not mask.any():
        return
    diff = float(((tensors["old_logprobs"] - tensors["rollout_logprobs"]).abs() * mask).sum() / mask.sum())
    if diff <= tolerance:
        return
    from mcore_rl.config.checks import ConfigError

    raise ConfigError(
        f"step 1: the engine's and the actor's logprobs of the same sampled tokens differ by {diff:.3g} per token "
        f"(actor.first_step_logprob_tolerance={tolerance}): the engines do not sample from the model the actor "
        f"trains. Likely causes: a tokenizer or chat template that is not the model's; a temperature the two apply "
        f"differently (the actor divides its logits by actor.logit_temperature, the engine samples at "
        f"rollout.temperature; vLLM reports T=1 logprobs unless asked otherwise); a weight the push did not reach "
        f"(tied embeddings, a name the engine does not map). This run: {setup}"
    )
