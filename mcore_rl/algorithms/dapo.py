"""DAPO's batch-level helpers (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale").

    group rewards -> dynamic_sampling_mask -> keep only groups that carry a learning signal
    response lengths -> soft_overlong_penalty -> added to the task reward before advantages

The other DAPO ingredients live elsewhere: clip-higher is `clip_ratio_high` of `losses.ppo_clip_loss`, and the
token-level loss is `loss_agg_mode="token-mean"`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcore_rl.algorithms.masked import group_index


def dynamic_sampling_mask(rewards: Tensor, group_ids: Tensor, *, tol: float = 0.0) -> Tensor:
    """DAPO dynamic sampling: True for each sample whose group's rewards are not all equal. [batch] -> bool [batch].

    A group whose samples all got the same reward (all solved or all failed) has zero group-relative advantage and
    contributes no policy gradient, only a smaller effective batch; DAPO drops such groups and samples more prompts
    until the batch is full. "All equal" means max - min <= tol (exact by default: rule rewards are discrete).
    Groups of a single sample are kept, as in verl, since with one sample per prompt there is nothing to compare and
    filtering would empty the batch. Index the batch with the result; `group_ids` need not be contiguous.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be [batch]")
    index, num_groups = group_index(group_ids)
    values = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    empty = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    group_max = empty.scatter_reduce(0, index, values, reduce="amax", include_self=False)
    group_min = empty.scatter_reduce(0, index, values, reduce="amin", include_self=False)
    count = torch.zeros(num_groups, dtype=torch.long, device=values.device).index_add(0, index, torch.ones_like(index))
    keep_group = (group_max - group_min > tol) | (count == 1)
    return keep_group[index]


def soft_overlong_penalty(
    response_lengths: Tensor,
    *,
    max_response_len: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """DAPO soft overlong punishment, a reward term <= 0 per sample: [batch] lengths -> [batch] penalties.

        L_expected = max_response_len - overlong_buffer_len
        R_length   = 0                                              if |y| <= L_expected
                   = penalty_factor * (L_expected - |y|) / buffer   if L_expected < |y| <= max_response_len
                   = -penalty_factor                                if |y| > max_response_len

    The linear ramp over the last `overlong_buffer_len` tokens tells the policy that long answers cost reward
    before they are truncated, instead of punishing a truncated and a nearly-truncated answer completely
    differently. Add the result to the task reward (verl: `reward_model.overlong_buffer`).
    """
    if overlong_buffer_len <= 0 or overlong_buffer_len > max_response_len:
        raise ValueError(
            f"need 0 < overlong_buffer_len <= max_response_len; got {overlong_buffer_len}, {max_response_len}"
        )
    expected_len = max_response_len - overlong_buffer_len
    lengths = response_lengths.to(torch.float32)
    ramp = (expected_len - lengths) / overlong_buffer_len
    return penalty_factor * ramp.clamp(min=-1.0, max=0.0)
