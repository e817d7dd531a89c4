"""Fast CPU tests of mcore_rl.algorithms: advantage estimators, loss aggregation and the DAPO helpers.

Each test checks a hand-computable case and/or an invariant of the estimator it is named after.
Run: pytest tests/test_algorithms.py
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGG_MODES,
    aggregate_loss,
    compute_advantages,
    dynamic_sampling_mask,
    gae_advantages,
    grpo_advantages,
    opo_advantages,
    outcome_to_token_rewards,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    soft_overlong_penalty,
)


def _mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


# ---------------------------------------------------------------- GRPO / Dr.GRPO


def test_grpo_hand_example_broadcasts_over_valid_tokens() -> None:
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    mask = _mask([3, 1, 2, 2], 3)
    out = grpo_advantages(rewards, mask, group_ids)
    # Group 0: mean 0.5, unbiased std sqrt(0.5) -> +-0.5 / 0.7071 = +-0.7071. Group 1 is constant -> 0.
    a = 0.5 / math.sqrt(0.5)
    expected = torch.tensor([[a, a, a], [-a, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # eps = 1e-6 in the denominator shifts the value by ~1e-6 relative.
    torch.testing.assert_close(out.advantages, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.returns, rewards.unsqueeze(-1) * mask)


def test_grpo_has_zero_mean_and_unit_std_per_group() -> None:
    gen = torch.Generator().manual_seed(0)
    group_ids = torch.arange(4).repeat_interleave(5)[torch.randperm(20, generator=gen)]  # interleaved groups
    rewards = torch.randn(20, generator=gen)
    mask = _mask(torch.randint(1, 6, (20,), generator=gen).tolist(), 6)
    seq_adv = grpo_advantages(rewards, mask, group_ids).advantages[:, 0]  # every row has >= 1 token
    for g in range(4):
        adv = seq_adv[group_ids == g]
        assert abs(adv.mean().item()) < 1e-6
        # Unbiased std, as the estimator uses; eps = 1e-6 against std ~ 1 perturbs it by ~1e-6.
        assert abs(adv.std().item() - 1.0) < 1e-5


def test_dr_grpo_skips_std_normalisation() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0, 2.0])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.ones(6, 2)
    dr = grpo_advantages(rewards, mask, group_ids, norm_by_std=False).advantages[:, 0]
    torch.testing.assert_close(dr, torch.tensor([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0, 0.0]))
    # Dr.GRPO scales with the reward; GRPO is scale-invariant.
    dr10 = grpo_advantages(10 * rewards, mask, group_ids, norm_by_std=False).advantages[:, 0]
    torch.testing.assert_close(dr10, 10 * dr)
    grpo = grpo_advantages(rewards, mask, group_ids).advantages
    grpo10 = grpo_advantages(10 * rewards, mask, group_ids).advantages
    torch.testing.assert_close(grpo10, grpo, atol=1e-5, rtol=0)


def test_grpo_singleton_group_gets_raw_reward_like_verl() -> None:
    out = grpo_advantages(torch.tensor([0.7, 1.0, 0.0]), torch.ones(3, 2), torch.tensor([5, 9, 9]))
    assert out.advantages[0, 0].item() == pytest.approx(0.7, abs=1e-5)


def test_grpo_is_equivariant_to_batch_permutation() -> None:
    gen = torch.Generator().manual_seed(1)
    rewards = torch.rand(12, generator=gen)
    group_ids = torch.arange(3).repeat_interleave(4)  # contiguous
    mask = _mask(torch.randint(1, 5, (12,), generator=gen).tolist(), 4)
    perm = torch.randperm(12, generator=gen)
    base = grpo_advantages(rewards, mask, group_ids).advantages
    permuted = grpo_advantages(rewards[perm], mask[perm], group_ids[perm]).advantages
    torch.testing.assert_close(permuted, base[perm])


# ---------------------------------------------------------------- RLOO / OPO / ReMax


def test_rloo_equals_leave_one_out_loop() -> None:
    gen = torch.Generator().manual_seed(2)
    group_ids = torch.tensor([3, 1, 3, 1, 3, 7, 1, 3])  # interleaved, sizes 4, 3, 1
    rewards = torch.randn(8, generator=gen)
    mask = torch.ones(8, 3)
    got = rloo_advantages(rewards, mask, group_ids).advantages[:, 0]
    expected = torch.empty(8)
    for i in range(8):
        others = [rewards[j].item() for j in range(8) if j != i and group_ids[j] == group_ids[i]]
        expected[i] = rewards[i] - (sum(others) / len(others) if others else 0.0)
    torch.testing.assert_close(got, expected)


def test_opo_uses_length_weighted_baseline() -> None:
    rewards = torch.tensor([1.0, 0.0])
    mask = _mask([1, 3], 3)
    out = opo_advantages(rewards, mask, torch.tensor([0, 0]))
    # baseline = (1 * 1 + 3 * 0) / (1 + 3) = 0.25
    torch.testing.assert_close(out.advantages, torch.tensor([[0.75, 0.0, 0.0], [-0.25, -0.25, -0.25]]))


def test_remax_subtracts_greedy_baseline() -> None:
    out = remax_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]), _mask([2, 1], 2))
    torch.testing.assert_close(out.advantages, torch.tensor([[0.5, 0.5], [-0.5, 0.0]]))


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_discounted_returns_and_batch_whitening() -> None:
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])  # 5.0 sits on padding
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = reinforce_plus_plus_advantages(token_rewards, mask, gamma=0.5)
    torch.testing.assert_close(out.returns, torch.tensor([[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]]))
    valid = out.advantages[mask.bool()]
    assert abs(valid.mean().item()) < 1e-6
    assert abs(valid.var().item() - 1.0) < 1e-5  # unbiased over the 5 valid tokens, like masked_whiten
    assert torch.all(out.advantages[~mask.bool()] == 0)


def test_reinforce_pp_skips_masked_tokens_inside_a_response() -> None:
    # The masked middle token (tool output) neither adds its reward nor costs a discount step.
    out = reinforce_plus_plus_advantages(torch.tensor([[0.0, 7.0, 1.0]]), torch.tensor([[1.0, 0.0, 1.0]]), gamma=0.5)
    torch.testing.assert_close(out.returns, torch.tensor([[0.5, 0.0, 1.0]]))


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens_over_tokens() -> None:
    rewards = torch.tensor([1.0, 0.0, 4.0, 2.0])
    lengths = [2, 1, 3, 1]
    mask = _mask(lengths, 3)
    out = reinforce_plus_plus_baseline_advantages(rewards, mask, torch.tensor([0, 0, 1, 1]))
    centred = [0.5, -0.5, 1.0, -1.0]
    tokens = torch.tensor([c for c, n in zip(centred, lengths) for _ in range(n)])
    expected_tokens = (tokens - tokens.mean()) / tokens.std()
    torch.testing.assert_close(out.advantages[mask.bool()], expected_tokens, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- GAE


def test_gae_hand_example() -> None:
    out = gae_advantages(
        torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.2]]), torch.ones(1, 2), gamma=0.9, lam=0.8, whiten=False
    )
    # delta_1 = 1 - 0.2 = 0.8; delta_0 = 0.9 * 0.2 - 0.5 = -0.32; A_0 = -0.32 + 0.9 * 0.8 * 0.8 = 0.256
    torch.testing.assert_close(out.advantages, torch.tensor([[0.256, 0.8]]))
    torch.testing.assert_close(out.returns, torch.tensor([[0.756, 1.0]]))


def test_gae_with_unit_gamma_lambda_is_reward_to_go_minus_values() -> None:
    gen = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    out = gae_advantages(rewards, values, torch.ones(3, 6), gamma=1.0, lam=1.0, whiten=False)
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(out.advantages, reward_to_go - values)
    torch.testing.assert_close(out.returns, reward_to_go)


def test_gae_ignores_padding() -> None:
    gen = torch.Generator().manual_seed(4)
    rewards, values = torch.randn(2, 4, generator=gen), torch.randn(2, 4, generator=gen)
    mask = _mask([4, 2], 4)
    garbage_r, garbage_v = rewards.clone(), values.clone()
    garbage_r[1, 2:], garbage_v[1, 2:] = 1e3, -1e3
    for whiten in (False, True):
        a = gae_advantages(rewards, values, mask, gamma=0.99, lam=0.95, whiten=whiten)
        b = gae_advantages(garbage_r, garbage_v, mask, gamma=0.99, lam=0.95, whiten=whiten)
        torch.testing.assert_close(a.advantages, b.advantages)
        torch.testing.assert_close(a.returns, b.returns)
    # The short row equals GAE of that row alone, unpadded; padding comes back as 0.
    alone = gae_advantages(rewards[1:, :2], values[1:, :2], torch.ones(1, 2), gamma=0.99, lam=0.95, whiten=False)
    padded = gae_advantages(rewards, values, mask, gamma=0.99, lam=0.95, whiten=False)
    torch.testing.assert_close(padded.advantages[1:, :2], alone.advantages)
    assert torch.all(padded.advantages[1, 2:] == 0) and torch.all(padded.returns[1, 2:] == 0)


def test_gae_treats_masked_tokens_inside_a_response_as_absent() -> None:
    gen = torch.Generator().manual_seed(5)
    rewards, values = torch.randn(1, 5, generator=gen), torch.randn(1, 5, generator=gen)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    keep = [0, 1, 4]
    full = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.7, whiten=False)
    dropped = gae_advantages(rewards[:, keep], values[:, keep], torch.ones(1, 3), gamma=0.9, lam=0.7, whiten=False)
    torch.testing.assert_close(full.advantages[:, keep], dropped.advantages)


def test_outcome_to_token_rewards_places_reward_on_last_valid_token() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    got = outcome_to_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    torch.testing.assert_close(got, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]))


# ---------------------------------------------------------------- registry


def test_compute_advantages_dispatches_by_name() -> None:
    rewards, mask, group_ids = torch.tensor([1.0, 0.0, 1.0]), torch.ones(3, 2), torch.tensor([0, 0, 0])
    got = compute_advantages("rloo", rewards=rewards, response_mask=mask, group_ids=group_ids)
    torch.testing.assert_close(got.advantages, rloo_advantages(rewards, mask, group_ids).advantages)
    assert {"gae", "grpo", "rloo", "remax", "reinforce_plus_plus", "reinforce_plus_plus_baseline"} <= set(
        ADVANTAGE_ESTIMATORS
    )


def test_unknown_advantage_estimator_raises_listing_known_names() -> None:
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo2'") as info:
        compute_advantages("ppo2", rewards=torch.zeros(1))
    for name in ADVANTAGE_ESTIMATORS:
        assert name in str(info.value)


# ---------------------------------------------------------------- loss aggregation


def test_aggregation_modes_hand_example() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])  # 9s are padding
    mask = _mask([3, 1], 3)
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    got = aggregate_loss(loss, mask, "seq-mean-token-sum-norm", max_response_len=5).item()
    assert got == pytest.approx((6 / 5 + 4 / 5) / 2)


def test_token_mean_and_seq_mean_differ_only_for_unequal_lengths() -> None:
    gen = torch.Generator().manual_seed(6)
    loss = torch.rand(4, 5, generator=gen)
    unequal, equal = _mask([5, 1, 3, 2], 5), _mask([3, 3, 3, 3], 5)
    # token-mean weights each token equally, so long sequences dominate; seq-mean weights each sequence equally.
    assert not torch.isclose(
        aggregate_loss(loss, unequal, "token-mean"), aggregate_loss(loss, unequal, "seq-mean-token-mean")
    )
    torch.testing.assert_close(
        aggregate_loss(loss, equal, "token-mean"), aggregate_loss(loss, equal, "seq-mean-token-mean")
    )


def test_aggregation_denominator_makes_micro_batches_sum_to_the_global_mean() -> None:
    gen = torch.Generator().manual_seed(7)
    loss = torch.rand(6, 4, generator=gen)
    mask = _mask([4, 1, 2, 3, 1, 4], 4)
    for mode, global_count in (("token-mean", mask.sum()), ("seq-mean-token-mean", 6.0)):
        whole = aggregate_loss(loss, mask, mode)
        parts = sum(aggregate_loss(loss[i : i + 2], mask[i : i + 2], mode, denominator=global_count) for i in (0, 2, 4))
        torch.testing.assert_close(parts, whole)


def test_seq_mean_modes_skip_empty_sequences() -> None:
    loss = torch.tensor([[1.0, 3.0], [5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        torch.testing.assert_close(aggregate_loss(loss, mask, mode), aggregate_loss(loss[:1], mask[:1], mode))
    assert aggregate_loss(loss, torch.zeros(2, 2), "token-mean").item() == 0.0  # empty micro-batch: 0, not nan


def test_aggregation_rejects_unknown_mode_and_missing_max_len() -> None:
    loss, mask = torch.ones(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="known: " + ", ".join(LOSS_AGG_MODES)):
        aggregate_loss(loss, mask, "seq-sum")
    with pytest.raises(ValueError, match="max_response_len"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")


# ---------------------------------------------------------------- DAPO


def test_dynamic_sampling_keeps_only_groups_with_reward_variance() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 5.0])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # group 3 is a singleton: kept, as in verl
    keep = dynamic_sampling_mask(rewards, group_ids)
    assert keep.tolist() == [False, False, True, True, False, False, True]
    interleaved = dynamic_sampling_mask(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([2, 0, 2, 0]))
    assert interleaved.tolist() == [False, True, False, True]
    near_equal = torch.tensor([0.5, 0.5 + 1e-9, 0.0, 1.0], dtype=torch.float64)
    assert dynamic_sampling_mask(near_equal, torch.tensor([0, 0, 1, 1]), tol=1e-6).tolist() == [
        False,
        False,
        True,
        True,
    ]


def test_soft_overlong_penalty_ramps_over_the_buffer() -> None:
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    got = soft_overlong_penalty(lengths, max_response_len=10, overlong_buffer_len=4)
    # expected length 6: no penalty up to 6, then -1/4 per token, -1 at and beyond the maximum
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    doubled = soft_overlong_penalty(lengths, max_response_len=10, overlong_buffer_len=4, penalty_factor=2.0)
    torch.testing.assert_close(doubled, 2 * got)
    with pytest.raises(ValueError):
        soft_overlong_penalty(lengths, max_response_len=10, overlong_buffer_len=0)
