"""Advantage estimators: rewards (and, for PPO, critic values) -> per-token advantages and returns.

    rewards [batch] (outcome) or token rewards [batch, response_len] -> estimator -> AdvantageOutput

Every estimator returns `AdvantageOutput(advantages, returns)`, both [batch, response_len] and 0 on masked
positions. `returns` is what a critic would regress on (GAE) or, for critic-free estimators, the un-normalised
reward-to-go the advantage was built from (useful as a metric). `compute_advantages(name, **kwargs)` dispatches by
the names verl uses for `algorithm.adv_estimator`.

GSPO and Dr.GRPO are not separate estimators: GSPO uses "grpo" advantages with the GSPO policy loss, Dr.GRPO uses
"grpo" with `norm_by_std=False` and the "seq-mean-token-sum-norm" loss aggregation.

Singleton groups (one sample per prompt) carry no baseline information; like verl, the group estimators then use
baseline 0 (and scale 1), which reduces them to plain REINFORCE on that sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from mcore_rl.algorithms.masked import group_index, group_stats, masked_whiten


class AdvantageOutput(NamedTuple):
    """Per-token advantages and returns, both [batch, response_len] and zero on masked positions."""

    advantages: Tensor
    returns: Tensor


def outcome_to_token_rewards(rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Place each sequence-level reward [batch] on its last valid response token: -> [batch, response_len].

    This is how an outcome reward enters token-level estimators (GAE, REINFORCE++), optionally before a per-token
    KL penalty is subtracted. A row with no valid token gets no reward.
    """
    _check_seq(rewards, response_mask, "rewards")
    batch, length = response_mask.shape
    positions = torch.arange(length, device=response_mask.device).expand(batch, length)
    last = torch.where(response_mask > 0, positions, -1).amax(dim=-1)
    token_rewards = torch.zeros_like(response_mask, dtype=torch.promote_types(rewards.dtype, response_mask.dtype))
    rows = torch.nonzero(last >= 0).squeeze(-1)
    token_rewards[rows, last[rows]] = rewards[rows].to(token_rewards.dtype)
    return token_rewards


def grpo_advantages(
    rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> AdvantageOutput:
    """GRPO outcome advantage, broadcast over each sample's response tokens.

        A_i = (r_i - mean_group(r)) / (std_group(r) + eps)     norm_by_std=True  (GRPO, Shao et al. 2024, DeepSeekMath)
        A_i =  r_i - mean_group(r)                             norm_by_std=False (Dr.GRPO, Liu et al. 2025)

    std is the unbiased (Bessel) group standard deviation, as in verl's `compute_grpo_outcome_advantage`.
    Dr.GRPO drops the std division because it up-weights groups whose rewards barely differ (too easy or too hard).
    A group whose rewards are all equal gets advantage 0 on every sample.
    """
    _check_seq(rewards, response_mask, "rewards")
    stats = group_stats(rewards, group_ids)
    singleton = stats.count == 1
    mean = torch.where(singleton, torch.zeros_like(stats.mean), stats.mean)
    centred = rewards.to(mean.dtype) - mean
    if norm_by_std:
        std = torch.where(singleton, torch.ones_like(stats.std), stats.std)
        centred = centred / (std + eps)
    return _broadcast(centred, rewards, response_mask)


def rloo_advantages(rewards: Tensor, response_mask: Tensor, group_ids: Tensor) -> AdvantageOutput:
    """REINFORCE Leave-One-Out: A_i = r_i - (1 / (n - 1)) * sum_{j != i in group} r_j.

    Kool et al. 2019 ("Buy 4 REINFORCE samples, get a baseline for free!"), Ahmadian et al. 2024 (RLOO for RLHF);
    verl's `compute_rloo_outcome_advantage`. The baseline excludes the sample itself, so it is unbiased.
    Equivalently A_i = n / (n - 1) * (r_i - mean_group(r)).
    """
    _check_seq(rewards, response_mask, "rewards")
    stats = group_stats(rewards, group_ids)
    r = rewards.to(stats.mean.dtype)
    others_mean = (stats.mean * stats.count - r) / (stats.count - 1).clamp_min(1.0)
    baseline = torch.where(stats.count > 1, others_mean, torch.zeros_like(others_mean))
    return _broadcast(r - baseline, rewards, response_mask)


def opo_advantages(rewards: Tensor, response_mask: Tensor, group_ids: Tensor) -> AdvantageOutput:
    """OPO (On-Policy RL with Optimal reward baseline, Hao et al. 2025): a length-weighted group baseline.

        A_i = r_i - sum_j |y_j| r_j / sum_j |y_j|     (j over the group; |y| = number of valid response tokens)

    The length weighting is the variance-minimising baseline when the per-token loss is summed over tokens.
    verl's `compute_opo_outcome_advantage`.
    """
    _check_seq(rewards, response_mask, "rewards")
    index, num_groups = group_index(group_ids)
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.to(dtype)
    lengths = response_mask.sum(dim=-1).to(dtype)
    zeros = torch.zeros(num_groups, dtype=dtype, device=r.device)
    weighted = zeros.index_add(0, index, lengths * r)
    total_len = zeros.index_add(0, index, lengths)
    count = zeros.index_add(0, index, torch.ones_like(r))
    baseline = (weighted / total_len.clamp_min(1e-8))[index]
    baseline = torch.where(count[index] > 1, baseline, torch.zeros_like(baseline))
    return _broadcast(r - baseline, rewards, response_mask)


def remax_advantages(rewards: Tensor, baseline_rewards: Tensor, response_mask: Tensor) -> AdvantageOutput:
    """ReMax (Li et al. 2023): A_i = r_i - r_greedy(prompt_i).

    `baseline_rewards` [batch] holds, for each sample, the reward of one greedy rollout of the same prompt (the
    caller repeats it for the n samples of a prompt). verl's `compute_remax_outcome_advantage`. With an outcome
    reward the reward-to-go equals r at every token, so the advantage is constant over the response.
    """
    _check_seq(rewards, response_mask, "rewards")
    _check_seq(baseline_rewards, response_mask, "baseline_rewards")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    advantages = rewards.to(dtype) - baseline_rewards.to(dtype)
    return _broadcast(advantages, rewards, response_mask)


def reinforce_plus_plus_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0
) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025): discounted token returns, whitened over the whole batch.

        G_t = r_t + gamma * G_{t+1}      (over valid tokens only)
        A_t = (G_t - mean_batch(G)) / std_batch(G)

    `token_level_rewards` is typically the outcome reward on the last token minus a per-token KL penalty
    (`kl.apply_kl_penalty`). Masked positions are skipped: they add no reward and no discount step, so nothing
    leaks in from padding and masked tool-output tokens inside a multi-turn response are transparent.
    Returns are the un-whitened G_t. verl's `compute_reinforce_plus_plus_outcome_advantage`.
    """
    _check_tok(token_level_rewards, response_mask, "token_level_rewards")
    mask = response_mask.to(torch.promote_types(token_level_rewards.dtype, torch.float32))
    rewards = token_level_rewards.to(mask.dtype) * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = m * (rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running
    returns = returns * mask
    return AdvantageOutput(masked_whiten(returns, mask), returns)


def reinforce_plus_plus_baseline_advantages(
    rewards: Tensor, response_mask: Tensor, group_ids: Tensor
) -> AdvantageOutput:
    """REINFORCE++-baseline (Hu 2025): subtract the group mean, then whiten over the whole batch.

        A_i = whiten_batch(r_i - mean_group(r))     broadcast over tokens, whitening over all valid tokens

    Unlike GRPO the scale comes from the batch, not the group, so low-variance groups are not up-weighted.
    verl's `compute_reinforce_plus_plus_baseline_outcome_advantage`.
    """
    _check_seq(rewards, response_mask, "rewards")
    stats = group_stats(rewards, group_ids)
    mean = torch.where(stats.count == 1, torch.zeros_like(stats.mean), stats.mean)
    centred = _broadcast(rewards.to(mean.dtype) - mean, rewards, response_mask).advantages
    mask = response_mask.to(centred.dtype)
    returns = rewards.to(mean.dtype).unsqueeze(-1) * mask
    return AdvantageOutput(masked_whiten(centred, mask), returns)


def gae_advantages(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> AdvantageOutput:
    """Generalised Advantage Estimation for PPO (Schulman et al. 2016), over valid tokens only.

        delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last valid token is 0: the episode ends)
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                            (the critic's target; computed before whitening)

    Masked positions are skipped rather than treated as steps: t+1 means the next *valid* token, so padding never
    leaks values or rewards into the response, and masked tool-output tokens inside a multi-turn response act as if
    absent (the same treatment as verl's current `compute_gae_advantage_return`). With gamma = lam = 1,
    A_t = sum_{s >= t} r_s - V_t. `whiten=True` whitens A over the batch (as verl and OpenRLHF do for PPO).
    """
    _check_tok(token_level_rewards, response_mask, "token_level_rewards")
    _check_tok(values, response_mask, "values")
    dtype = torch.promote_types(torch.promote_types(values.dtype, token_level_rewards.dtype), torch.float32)
    mask = response_mask.to(dtype)
    rewards, values = token_level_rewards.to(dtype), values.to(dtype)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        # On a masked position carry the successor's state through unchanged.
        next_value = m * values[:, t] + (1 - m) * next_value
        next_advantage = m * advantage + (1 - m) * next_advantage
        advantages[:, t] = advantage
    advantages = advantages * mask
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return AdvantageOutput(advantages, returns)


# Keys are verl's `algorithm.adv_estimator` names, so configs carry over.
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., AdvantageOutput]] = {
    "gae": gae_advantages,
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "opo": opo_advantages,
    "remax": remax_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
}


def compute_advantages(name: str, **kwargs: object) -> AdvantageOutput:
    """Run the estimator registered under `name` with `kwargs`; ValueError lists the known names otherwise."""
    try:
        estimator = ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; known: {known}") from None
    return estimator(**kwargs)


def _broadcast(seq_advantages: Tensor, rewards: Tensor, response_mask: Tensor) -> AdvantageOutput:
    # Outcome estimators: the same advantage on every valid token; returns are the raw reward, likewise broadcast.
    mask = response_mask.to(seq_advantages.dtype)
    advantages = seq_advantages.unsqueeze(-1) * mask
    returns = rewards.to(seq_advantages.dtype).unsqueeze(-1) * mask
    return AdvantageOutput(advantages, returns)


def _check_seq(x: Tensor, response_mask: Tensor, name: str) -> None:
    if response_mask.dim() != 2 or x.shape != response_mask.shape[:1]:
        raise ValueError(f"{name} must be [batch] for a [batch, response_len] mask; got {tuple(x.shape)}")


def _check_tok(x: Tensor, response_mask: Tensor, name: str) -> None:
    if x.shape != response_mask.shape or x.dim() != 2:
        raise ValueError(f"{name} {tuple(x.shape)} must match response_mask {tuple(response_mask.shape)}")
