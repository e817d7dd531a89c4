"""KL between the policy and the reference policy: per-token estimators, the KL loss, the in-reward KL penalty and
the KL-coefficient controllers.

Two ways to keep the policy near the reference (both are estimated from the sampled tokens only):

    GRPO-style KL loss:     loss = pg_loss + kl_loss_coef * kl_loss(logp, ref_logp, mask, kind="low_var_kl")
    PPO-style KL in reward: token_rewards = scores - beta * kl_penalty(old_logp, ref_logp, kind="k1"),
                            beta from FixedKLController or AdaptiveKLController (Ziegler et al. 2019)

Estimators (John Schulman, "Approximating KL Divergence", 2020), with x ~ pi and log-ratio d = logp - ref_logp:

    k1 / kl          d                              unbiased, high variance, can be negative
    abs              |d|
    k2 / mse         0.5 * d^2                      biased, low variance, >= 0
    k3 / low_var_kl  exp(-d) - (-d) - 1             unbiased, low variance, >= 0; clamped to [-10, 10] as verl does
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mcore_rl.algorithms.masked import aggregate_loss, masked_mean, masked_sum

KL_ESTIMATORS: tuple[str, ...] = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")

# k3 = exp(x) - x - 1 with x = ref - logp. The inner clamp of x to [-20, 20] keeps exp finite in fp32;
# the outer clamp to [-10, 10] caps the penalty of a token the reference finds wildly unlikely, so one token
# cannot dominate the loss (verl's `low_var_kl` uses the same two bounds).
_K3_LOG_RATIO_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token KL(pi || ref) estimate from sampled-token log-probs (same shape in and out); see module docstring.

    Gradients flow through `logp` (and `ref_logp` if it requires grad), so this serves both as a loss term and,
    under no_grad or on detached inputs, as a reward penalty.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} shapes differ")
    log_ratio = logp - ref_logp
    if kind in ("k1", "kl"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        x = (-log_ratio).clamp(-_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
        return (torch.exp(x) - x - 1.0).clamp(-_K3_VALUE_CLAMP, _K3_VALUE_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    response_mask: Tensor,
    *,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    max_response_len: int | None = None,
    agg_denominator: float | Tensor | None = None,
) -> Tensor:
    """GRPO's KL loss term (Shao et al. 2024): aggregate(kl_penalty(logp, ref_logp, kind)) over valid tokens.

    The caller adds `kl_loss_coef * kl_loss(...)` to the policy loss; use the same aggregation mode and
    denominator as the policy loss so the two terms are on one scale. GRPO's paper uses k3 ("low_var_kl").
    """
    per_token = kl_penalty(logp, ref_logp, kind)
    return aggregate_loss(
        per_token, response_mask, loss_agg_mode, max_response_len=max_response_len, denominator=agg_denominator
    )


def apply_kl_penalty(
    token_level_scores: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    response_mask: Tensor,
    *,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[Tensor, dict[str, Tensor]]:
    """In-reward KL for PPO (Ziegler et al. 2019; InstructGPT): r_t = score_t - kl_coef * KL_t on valid tokens.

    `token_level_scores` [batch, response_len] is usually the outcome reward on the last token
    (`advantages.outcome_to_token_rewards`); `logp` is the rollout policy's (old) log-prob, so the penalty is a
    fixed reward, never differentiated. Returns (token_rewards, metrics) with metrics
        kl_token_mean: per-sequence mean of KL_t, averaged over sequences (verl's `actor/reward_kl_penalty`),
        kl_seq_sum:    per-sequence sum of KL_t, averaged over sequences (Ziegler et al.'s per-sample KL),
        kl_coef.
    Feed the controller whichever of the two its target is expressed in.
    """
    with torch.no_grad():
        kl = kl_penalty(logp, ref_logp, kind) * response_mask
        token_rewards = token_level_scores - kl_coef * kl
        non_empty = (response_mask.sum(dim=-1) > 0).to(kl.dtype)
        metrics = {
            "kl_token_mean": masked_mean(masked_mean(kl, response_mask, dim=-1), non_empty),
            "kl_seq_sum": masked_mean(masked_sum(kl, response_mask, dim=-1), non_empty),
            "kl_coef": torch.tensor(kl_coef, dtype=kl.dtype, device=kl.device),
        }
    return token_rewards, metrics


@dataclass
class FixedKLController:
    """A constant KL coefficient; `update` is a no-op so the trainer can treat both controllers alike."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""


@dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences").

        e_t   = clip(KL_t / target - 1, -0.2, 0.2)
        beta <- beta * (1 + e_t * n_steps / horizon)

    A proportional controller: beta grows while the measured KL exceeds `target` and shrinks below it; the clip to
    +-0.2 bounds the change per update, and `horizon` (in samples) sets how fast beta responds. `n_steps` is the
    number of samples in the batch that produced `current_kl`.
    """

    value: float
    target: float
    horizon: int

    def __post_init__(self) -> None:
        if self.target <= 0 or self.horizon <= 0:
            raise ValueError(f"target ({self.target}) and horizon ({self.horizon}) must be positive")

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move `value` towards the coefficient that keeps KL at `target`."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


# Keys are verl's `algorithm.kl_ctrl.type` names.
KL_CONTROLLERS: dict[str, type] = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}
