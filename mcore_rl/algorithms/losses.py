"""Policy and value losses of the RL update, plus per-token entropy from logits.

    logp (current policy), old_logp (policy that the batch is on-policy for), advantages, response_mask
      -> per-token surrogate -> optional per-token importance weights (rollout/training mismatch, see mismatch.py)
      -> aggregate_loss(mode) -> LossOutput(loss, metrics)

All log-probabilities are of the sampled tokens, [batch, response_len]. Losses are to be *minimised*. Metrics are
detached scalar tensors, left on device so the caller can all-reduce them before logging.

`POLICY_LOSSES` / `get_policy_loss(name)` map verl-style `policy_loss.loss_mode` names to functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from mcore_rl.algorithms.masked import aggregate_loss, masked_mean

# exp(20) ~ 4.9e8 is still finite in fp32 and bf16; a token whose log-ratio leaves [-20, 20] is so far off-policy
# that its (zero) gradient through the clamp does not matter, while an inf ratio would turn the whole loss into nan.
_LOG_RATIO_CLAMP = 20.0
# GSPO's sequence log-ratio is clamped from above at 10 (ratio ~ 2.2e4), as verl does, for the same reason.
_GSPO_LOG_RATIO_MAX = 10.0


class LossOutput(NamedTuple):
    """A scalar loss to minimise and detached scalar metrics keyed by name."""

    loss: Tensor
    metrics: dict[str, Tensor]


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    importance_weights: Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    max_response_len: int | None = None,
    agg_denominator: float | Tensor | None = None,
) -> LossOutput:
    """PPO clipped surrogate (Schulman et al. 2017) with DAPO clip-higher and dual-clip.

        ratio_t = exp(logp_t - old_logp_t)
        L_t     = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_low, 1 + eps_high))
        if A_t < 0 and clip_ratio_c is set:  L_t = min(L_t, -A_t * clip_ratio_c)     (dual-clip, Ye et al. 2020)
        loss    = aggregate(w_t * L_t)                                              (w = importance_weights or 1)

    `clip_ratio_high=None` uses `clip_ratio_low` (symmetric PPO); DAPO (Yu et al. 2025) raises it (e.g. 0.28) so
    low-probability tokens can grow. Dual-clip bounds the loss of negative-advantage tokens whose ratio exploded.
    Gradients are zero where clipping is active, i.e. on the *profitable* side: ratio > 1 + eps_high with A > 0,
    ratio < 1 - eps_low with A < 0.

    Metrics: clip_frac (fraction of valid tokens where the clipped term is active), clip_frac_lower (fraction where
    dual-clip is active), ppo_kl (k1 estimate of KL(old || new), mean of old_logp - logp, verl's name),
    approx_kl_k3 (the non-negative k3 estimate of the same KL), ratio_mean, ratio_max.
    """
    clip_ratio_high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"dual-clip needs clip_ratio_c > 1, got {clip_ratio_c}")
    _check_tok(response_mask, logp=logp, old_logp=old_logp, advantages=advantages)

    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped).to(ratio.dtype)

    dual_active = torch.zeros_like(ratio)
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        negative = advantages < 0
        dual_active = (negative & (per_token > bound)).to(ratio.dtype)
        per_token = torch.where(negative, torch.minimum(per_token, bound), per_token)

    if importance_weights is not None:
        _check_tok(response_mask, importance_weights=importance_weights)
        # The weights are a fixed correction (computed from logprobs of other engines): never differentiate them.
        per_token = per_token * importance_weights.detach()

    loss = aggregate_loss(
        per_token, response_mask, loss_agg_mode, max_response_len=max_response_len, denominator=agg_denominator
    )
    metrics = _ratio_metrics(ratio, log_ratio, response_mask)
    metrics["clip_frac"] = masked_mean(clip_active, response_mask).detach()
    metrics["clip_frac_lower"] = masked_mean(dual_active, response_mask).detach()
    return LossOutput(loss, metrics)


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float | None = 4e-4,
    importance_weights: Tensor | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    max_response_len: int | None = None,
    agg_denominator: float | Tensor | None = None,
) -> LossOutput:
    """GSPO (Group Sequence Policy Optimization, Zheng et al. 2025, Qwen): a sequence-level importance ratio.

        s_i     = exp( (1 / |y_i|) * sum_t (logp_{i,t} - old_logp_{i,t}) )          (length-normalised)
        s_{i,t} = sg[s_i] * exp(logp_{i,t} - sg[logp_{i,t}])                         (GSPO-token form)
        L_{i,t} = max(-A_{i,t} * s_{i,t}, -A_{i,t} * clip(s_{i,t}, 1 - eps_low, 1 + eps_high))

    s_{i,t} has the value s_i and the gradient s_i * grad(logp_{i,t}). With a per-sequence advantage (A_{i,t} = A_i,
    as GRPO gives) and "seq-mean-token-mean" aggregation, the gradient equals that of the sequence-level objective
        J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i),   grad = (1/G) sum_i A_i s_i (1/|y_i|) sum_t grad(logp_{i,t})
    for unclipped sequences (the paper's eq. for GSPO), while the token form also admits per-token advantages.
    Whole sequences are clipped together, hence ranges of order 1e-4 (paper: 3e-4 / 4e-4) rather than PPO's 0.2.
    Metrics as for `ppo_clip_loss`; clip_frac is token-weighted, ratio_* describe s_i over non-empty sequences.
    """
    clip_ratio_high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    _check_tok(response_mask, logp=logp, old_logp=old_logp, advantages=advantages)

    log_ratio = logp - old_logp
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)  # [batch]
    log_s = seq_log_ratio.detach().unsqueeze(-1) + logp - logp.detach()
    ratio = torch.exp(log_s.clamp(max=_GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped).to(ratio.dtype)

    if importance_weights is not None:
        _check_tok(response_mask, importance_weights=importance_weights)
        per_token = per_token * importance_weights.detach()

    loss = aggregate_loss(
        per_token, response_mask, loss_agg_mode, max_response_len=max_response_len, denominator=agg_denominator
    )
    non_empty = (response_mask.sum(dim=-1) > 0).to(ratio.dtype)
    seq_ratio = torch.exp(seq_log_ratio.detach().clamp(max=_GSPO_LOG_RATIO_MAX))
    metrics = _ratio_metrics(seq_ratio, seq_log_ratio.detach(), non_empty)
    # KL diagnostics are per token, comparable with PPO's.
    token_metrics = _ratio_metrics(torch.exp(log_ratio.detach()), log_ratio.detach(), response_mask)
    metrics["ppo_kl"], metrics["approx_kl_k3"] = token_metrics["ppo_kl"], token_metrics["approx_kl_k3"]
    metrics["clip_frac"] = masked_mean(clip_active, response_mask).detach()
    return LossOutput(loss, metrics)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip_range_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    max_response_len: int | None = None,
    agg_denominator: float | Tensor | None = None,
) -> LossOutput:
    """PPO critic loss with value clipping (as in OpenAI baselines' PPO2, verl's `compute_value_loss`).

        V_clip = old_V + clip(V - old_V, -c, c)
        L_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)

    Clipping keeps the critic from moving far from the values the advantages were computed with. `clip_range_value
    =None` gives the plain 0.5 * (V - R)^2. Metrics: vf_clipfrac (fraction where the clipped term is active),
    vpred_mean.
    """
    _check_tok(response_mask, values=values, old_values=old_values, returns=returns)
    losses = (values - returns) ** 2
    clip_active = torch.zeros_like(losses)
    if clip_range_value is not None:
        clipped_values = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
        clipped_losses = (clipped_values - returns) ** 2
        clip_active = (clipped_losses > losses).to(losses.dtype)
        losses = torch.maximum(losses, clipped_losses)
    loss = 0.5 * aggregate_loss(
        losses, response_mask, loss_agg_mode, max_response_len=max_response_len, denominator=agg_denominator
    )
    metrics = {
        "vf_clipfrac": masked_mean(clip_active, response_mask).detach(),
        "vpred_mean": masked_mean(values, response_mask).detach(),
    }
    return LossOutput(loss, metrics)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy H = -sum_v p_v log p_v of the softmax over the last dim: logits [..., vocab] -> [...].

    Computed in float32 at least (bf16 log-softmax loses the small-probability tail that dominates the entropy of a
    peaked distribution). Logits of -inf (masked vocabulary entries) contribute exactly 0, with finite gradients.
    This is the single-device reference; under tensor parallelism the vocab dim is sharded and the sums over it
    need an all-reduce, which belongs with the model code.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_p = torch.log_softmax(logits, dim=-1)
    p = log_p.exp()
    # 0 * log 0 = 0 by convention. masked_fill (not torch.where on p * log_p) keeps the backward free of 0 * -inf.
    safe_log_p = log_p.masked_fill(p == 0, 0.0)
    return -(p * safe_log_p).sum(dim=-1)


# Keys follow verl's `actor.policy_loss.loss_mode` ("vanilla" there is "ppo" here).
POLICY_LOSSES: dict[str, Callable[..., LossOutput]] = {
    "ppo": ppo_clip_loss,
    "gspo": gspo_loss,
}


def get_policy_loss(name: str) -> Callable[..., LossOutput]:
    """The policy loss registered under `name`; ValueError lists the known names otherwise."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; known: {', '.join(sorted(POLICY_LOSSES))}") from None


def _ratio_metrics(ratio: Tensor, log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    ratio, log_ratio = ratio.detach(), log_ratio.detach()
    # k3 with r = new/old, sampled from old: r - 1 - log r >= 0, an unbiased low-variance KL(old || new) estimate.
    k3 = ratio - 1.0 - log_ratio
    return {
        "ppo_kl": masked_mean(-log_ratio, mask),
        "approx_kl_k3": masked_mean(k3, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": ratio.masked_fill(mask == 0, float("-inf")).max(),
    }


def _check_tok(response_mask: Tensor, **tensors: Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.shape != response_mask.shape:
            raise ValueError(f"{name} {tuple(tensor.shape)} must match response_mask {tuple(response_mask.shape)}")
