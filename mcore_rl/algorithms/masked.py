"""Masked reductions, per-group statistics and loss aggregation: the building blocks of the RL step's math.

Every token-level tensor in `mcore_rl.algorithms` is [batch, response_len] and comes with a float `response_mask`
(1 for a real response token, 0 for padding or for tokens that are not the policy's own, such as tool output in a
multi-turn rollout). Sequence-level tensors are [batch]. Samples of the same prompt share an integer `group_ids`
entry; groups need not be contiguous in the batch.

Loss aggregation (`aggregate_loss`) follows verl's `loss_agg_mode` names so that recipes carry over:

    token-mean               sum over all tokens / number of tokens                  (DAPO)
    seq-mean-token-sum       mean over sequences of the per-sequence token sum
    seq-mean-token-mean      mean over sequences of the per-sequence token mean       (original GRPO, GSPO)
    seq-mean-token-sum-norm  mean over sequences of (token sum / max_response_len)     (Dr.GRPO)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values * mask` over `dim` (all elements when `dim` is None)."""
    return (values * mask).sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` over the positions where `mask` is 1; an all-masked reduction gives 0, not nan.

    The denominator is clamped at 1e-8 rather than 1 so that fractional masks (token weights) still divide by
    their true sum; the clamp only changes anything when the mask sums to zero, and then the numerator is 0 too.
    """
    return masked_sum(values, mask, dim) / mask.sum(dim=dim).clamp_min(1e-8)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked elements (a scalar), with Bessel's correction when `unbiased`.

    With a single valid element the unbiased variance is undefined; the correction factor is then taken as 1
    (the variance is 0) instead of dividing by zero, which keeps the function free of host syncs.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        var = var * count / (count - 1).clamp_min(1.0)
    return var


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise the masked elements to zero mean and unit (unbiased) variance over the whole tensor.

    `shift_mean=False` rescales only, keeping the original mean. Padding positions come back as 0.
    `eps` guards the rsqrt when every valid element is equal (variance 0).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


class GroupStats(NamedTuple):
    """Per-sample view of per-group statistics: entry i describes the group of sample i. All [batch]."""

    mean: Tensor
    std: Tensor
    count: Tensor


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer group ids to dense indices 0..num_groups-1; returns (index [batch], num_groups)."""
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D [batch], got shape {tuple(group_ids.shape)}")
    if group_ids.is_floating_point():
        raise ValueError("group_ids must be an integer tensor")
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, unique.numel()


def group_stats(values: Tensor, group_ids: Tensor) -> GroupStats:
    """Mean, unbiased standard deviation and size of each sample's group.

    Uses index_add over dense group indices, so groups may be interleaved in the batch. A group of one sample has
    std 0 (Bessel's denominator clamped at 1); estimators decide what a singleton group means for them.
    Statistics are computed in at least float32 so bf16 rewards do not lose the mean.
    """
    if values.shape != group_ids.shape:
        raise ValueError(f"values {tuple(values.shape)} and group_ids {tuple(group_ids.shape)} must both be [batch]")
    dtype = torch.promote_types(values.dtype, torch.float32)
    values = values.to(dtype)
    index, num_groups = group_index(group_ids)
    zeros = torch.zeros(num_groups, dtype=dtype, device=values.device)
    count = zeros.index_add(0, index, torch.ones_like(values))
    mean = zeros.index_add(0, index, values) / count
    sq_dev = (values - mean[index]) ** 2
    var = zeros.index_add(0, index, sq_dev) / (count - 1).clamp_min(1.0)
    return GroupStats(mean=mean[index], std=var.sqrt()[index], count=count[index])


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    max_response_len: int | None = None,
    denominator: float | Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss [batch, response_len] to a scalar according to `mode` (see the module docstring).

    Args:
        loss_mat: per-token loss.
        mask: float response mask of the same shape.
        mode: one of LOSS_AGG_MODES.
        max_response_len: the constant divisor of "seq-mean-token-sum-norm" (Dr.GRPO's MAX_TOKENS). It is required
            for that mode rather than defaulting to `loss_mat.shape[-1]`, because with dynamic padding the tensor
            width changes from micro-batch to micro-batch and the loss scale would silently change with it.
        denominator: override of the default divisor, for micro-batched training where the mean must be over the
            *global* batch: the global number of valid tokens for "token-mean", the global number of non-empty
            sequences for the "seq-mean-*" modes. Each micro-batch then contributes sum / global_count and the
            summed gradients equal those of one big batch. None uses this tensor's own count.

    Sequences with no valid token are not counted by the "seq-mean-*" modes (they would dilute the mean).
    Note: verl's "seq-mean-token-sum-norm" sums over sequences without dividing by their number; here the name is
    taken literally (a mean over sequences), which differs from verl by the constant factor batch size.
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} shapes differ")
    if mode == "token-mean":
        count = mask.sum() if denominator is None else denominator
        return masked_sum(loss_mat, mask) / _clamp_count(count)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {', '.join(LOSS_AGG_MODES)}")

    token_count = mask.sum(dim=-1)
    seq_sum = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-sum":
        seq_loss = seq_sum
    elif mode == "seq-mean-token-mean":
        seq_loss = seq_sum / token_count.clamp_min(1e-8)
    else:  # seq-mean-token-sum-norm
        if max_response_len is None or max_response_len <= 0:
            raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs a positive constant max_response_len")
        seq_loss = seq_sum / max_response_len
    seq_mask = (token_count > 0).to(loss_mat.dtype)
    count = seq_mask.sum() if denominator is None else denominator
    return masked_sum(seq_loss, seq_mask) / _clamp_count(count)


def _clamp_count(count: float | Tensor) -> float | Tensor:
    # An empty micro-batch (all padding) must give loss 0 with zero gradients, not 0/0 = nan.
    if isinstance(count, Tensor):
        return count.clamp_min(1e-8)
    return max(float(count), 1e-8)
