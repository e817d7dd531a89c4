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
