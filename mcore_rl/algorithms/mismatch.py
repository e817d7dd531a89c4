"""Corrections for the mismatch between the rollout engine's and the training engine's log-probabilities.

The rollout engine (SGLang: different kernels, FP8 weights, batch-variant reductions) samples from pi_rollout, but
the policy gradient is computed for pi_old, the training engine's log-probs under the *same* weights. Even with
identical weights pi_rollout != pi_old, so on-policy RL is silently off-policy (Yao et al. 2025, "Your Efficient RL
Framework Secretly Brings You Off-Policy RL Training"). Importance weights pi_old / pi_rollout, computed here, are
multiplied into the per-token policy loss (`importance_weights=` of the losses in losses.py):

    rollout_logp, old_logp -> log ratio -> TIS: per-token min(ratio, C)
                                        -> MIS: per-sequence ratio, sequences outside [lower, upper] dropped

Both weights are constants for the update: they carry no gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mcore_rl.algorithms.masked import masked_mean, masked_sum


def truncated_importance_weights(
    old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor, *, cap: float = 2.0
) -> Tensor:
    """Truncated importance sampling (TIS, Yao et al. 2025): w_t = min(exp(old_logp_t - rollout_logp_t), C).

    Per token, [batch, response_len], 0 on masked positions, detached. Truncating at C bounds the variance that
    a token the rollout engine under-sampled would otherwise add; the bias this introduces is small when C is a few
    times 1 (the write-up uses C = 2). Computed as exp(min(log ratio, log C)), which is the same number and cannot
    overflow.
    """
    if cap <= 0:
        raise ValueError(f"TIS cap must be positive, got {cap}")
    _check_tok(old_logp, rollout_logp, response_mask)
    log_ratio = (old_logp - rollout_logp).detach()
    return torch.exp(log_ratio.clamp(max=math.log(cap))) * response_mask


def sequence_masked_importance_weights(
    old_logp: Tensor,
    rollout_logp: Tensor,
    response_mask: Tensor,
    *,
    upper: float = 2.0,
    lower: float | None = None,
    geometric: bool = False,
) -> Tensor:
    """Sequence-level masked importance sampling (Seq-MIS; Liu, Li et al. 2025, "When Speed Kills Stability").

        rho_i = exp( sum_t (old_logp_{i,t} - rollout_logp_{i,t}) )                   (geometric=False)
        rho_i = exp( mean_t (old_logp_{i,t} - rollout_logp_{i,t}) )                  (geometric=True)
        w_{i,t} = rho_i * 1[lower <= rho_i <= upper]

    Instead of truncating, a sequence whose ratio leaves [lower, upper] is rejected outright (weight 0 on all its
    tokens): such sequences are the ones where the engines disagree badly, and truncating them still trains on
    them. `lower=None` means 1 / upper. The geometric mean is length-independent and needs much tighter bounds
    (e.g. 0.999 / 1.001) than the product. To reject sequences but keep token-level TIS weights, multiply TIS
    weights by `(this > 0)`. Returns [batch, response_len], 0 on masked positions, detached.
    """
    if upper <= 0 or (lower is not None and not 0 <= lower <= upper):
        raise ValueError(f"need 0 <= lower <= upper and upper > 0; got lower={lower}, upper={upper}")
    _check_tok(old_logp, rollout_logp, response_mask)
    lower = 1.0 / upper if lower is None else lower
    log_ratio = (old_logp - rollout_logp).detach()
    if geometric:
        seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)
    else:
        seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1)
    # Compare in log space: a long sequence's summed log-ratio can exceed the float range of exp.
    log_lower = math.log(lower) if lower > 0 else float("-inf")
    keep = (seq_log_ratio <= math.log(upper)) & (seq_log_ratio >= log_lower)
    rho = torch.exp(seq_log_ratio.clamp(max=math.log(upper)))
    weights = torch.where(keep, rho, torch.zeros_like(rho))
    return weights.unsqueeze(-1) * response_mask


def mismatch_metrics(old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """Diagnostics of the rollout/training mismatch over valid tokens (detached scalars).

    mismatch_kl_k1: mean of rollout_logp - old_logp, KL(rollout || old) estimated with the rollout's samples;
    mismatch_kl_k3: the non-negative k3 estimate of the same KL; mismatch_abs_diff_max: the worst token;
    mismatch_ratio_mean: mean of pi_old / pi_rollout (1 when the engines agree).
    """
    _check_tok(old_logp, rollout_logp, response_mask)
    log_ratio = (old_logp - rollout_logp).detach()
    # Clamped like the policy loss's ratio: exp(20) stays finite in fp32, and these are only metrics.
    clamped = log_ratio.clamp(-20.0, 20.0)
    ratio = torch.exp(clamped)
    return {
        "mismatch_kl_k1": masked_mean(-log_ratio, response_mask),
        "mismatch_kl_k3": masked_mean(ratio - 1.0 - clamped, response_mask),
        "mismatch_abs_diff_max": (log_ratio.abs() * response_mask).max(),
        "mismatch_ratio_mean": masked_mean(ratio, response_mask),
    }


def _check_tok(old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor) -> None:
    if old_logp.shape != response_mask.shape or rollout_logp.shape != response_mask.shape:
        raise ValueError(
            f"old_logp {tuple(old_logp.shape)}, rollout_logp {tuple(rollout_logp.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must have one shape"
        )


def sequence_truncated_importance_weights(
    old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor, *, cap: float = 2.0
) -> Tensor:
    """Sequence-level truncated IS: w_{i,t} = min(exp(sum_t (old_logp - rollout_logp)), C) on every token of i.

    The product of the token ratios is the exact sequence importance weight; truncating it (instead of each token's)
    keeps the correlation of a sequence's tokens. [batch, response_len], 0 on masked positions, detached.
    """
    if cap <= 0:
        raise ValueError(f"sequence IS cap must be positive, got {cap}")
    _check_tok(old_logp, rollout_logp, response_mask)
    seq_log_ratio = masked_sum((old_logp - rollout_logp).detach(), response_mask, dim=-1)
    return torch.exp(seq_log_ratio.clamp(max=math.log(cap))).unsqueeze(-1) * response_mask


# verl's algorithm.rollout_correction.rollout_is / rollout_rs values.
IS_LEVELS: tuple[str, ...] = ("token", "sequence")
RS_LEVELS: tuple[str, ...] = ("sequence", "geometric")


def rollout_correction(
    old_logp: Tensor,
    rollout_logp: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float = 2.0,
    rollout_rs_threshold_lower: float | None = None,
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The policy loss's importance weights for the rollout/training mismatch, and the mismatch metrics.

        rollout_is="token":     TIS, per-token min(ratio, C)                    (truncated_importance_weights)
        rollout_is="sequence":  min(sequence ratio, C) on every token          (sequence_truncated_importance_weights)
        rollout_rs="sequence" / "geometric": sequences whose summed / mean-per-token ratio leaves [lower, upper]
                                get weight 0 (sequence_masked_importance_weights); kept ones keep their IS weight
    Returns (weights [batch, response_len] or None when both are off, metrics). Metrics always include
    `mismatch_metrics` plus `mismatch_log_ratio_mean` / `_max`; with IS, `is_truncated_frac` (tokens whose
    weight the cap cut); with RS, `rs_masked_frac` (non-empty sequences rejected).
    """
    _check_tok(old_logp, rollout_logp, response_mask)
    log_ratio = (old_logp - rollout_logp).detach()
    metrics = mismatch_metrics(old_logp, rollout_logp, response_mask)
    metrics["mismatch_log_ratio_mean"] = masked_mean(log_ratio, response_mask)
    metrics["mismatch_log_ratio_max"] = log_ratio.masked_fill(response_mask == 0, float("-inf")).max()
    weights = None
    if rollout_is == "token":
        weights = truncated_importance_weights(old_logp, rollout_logp, response_mask, cap=rollout_is_threshold)
        cut = (log_ratio > math.log(rollout_is_threshold)).to(log_ratio.dtype)
        metrics["is_truncated_frac"] = masked_mean(cut, response_mask)
    elif rollout_is == "sequence":
        weights = sequence_truncated_importance_weights(old_logp, rollout_logp, response_mask, cap=rollout_is_threshold)
        seq_cut = (masked_sum(log_ratio, response_mask, dim=-1) > math.log(rollout_is_threshold)).to(log_ratio.dtype)
        metrics["is_truncated_frac"] = masked_mean(seq_cut, (response_mask.sum(-1) > 0).to(log_ratio.dtype))
    elif rollout_is is not None:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; known: {', '.join(IS_LEVELS)}")
    if rollout_rs is not None:
        if rollout_rs not in RS_LEVELS:
            raise ValueError(f"unknown rollout_rs {rollout_rs!r}; known: {', '.join(RS_LEVELS)}")
        rs = sequence_masked_importance_weights(
            old_logp,
            rollout_logp,
            response_mask,
            upper=rollout_rs_threshold,
            lower=rollout_rs_threshold_lower,
            geometric=rollout_rs == "geometric",
        )
        keep = (rs.sum(-1) > 0).to(log_ratio.dtype)
        non_empty = (response_mask.sum(-1) > 0).to(log_ratio.dtype)
        metrics["rs_masked_frac"] = masked_mean(1.0 - keep, non_empty)
        weights = (weights if weights is not None else response_mask.to(log_ratio.dtype)) * keep.unsqueeze(-1)
    return weights, metrics
