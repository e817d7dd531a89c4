"""Fast CPU tests of mcore_rl.algorithms losses, KL estimators and rollout/training mismatch corrections.

Gradient properties are checked with torch.autograd against direct implementations of the papers' formulas.
Run: pytest tests/test_algorithms_losses.py
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algorithms import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    entropy_from_logits,
    get_policy_loss,
    gspo_loss,
    kl_loss,
    kl_penalty,
    mismatch_metrics,
    ppo_clip_loss,
    sequence_masked_importance_weights,
    truncated_importance_weights,
    value_loss,
)


def _mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


def _four_cases() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token each: (A>0, ratio 1.5), (A>0, ratio 0.5), (A<0, ratio 0.5), (A<0, ratio 1.5)."""
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5]])
    logp = ratio.log().clone().requires_grad_(True)
    return logp, torch.zeros(1, 4), torch.tensor([[1.0, 1.0, -1.0, -1.0]])


# ---------------------------------------------------------------- PPO clip


def test_ppo_clip_loss_hand_values_and_clip_fraction() -> None:
    logp, old, adv = _four_cases()
    out = ppo_clip_loss(logp, old, adv, torch.ones(1, 4), clip_ratio_low=0.2)
    # per token: max(-1.5, -1.2) = -1.2 (clipped), max(-0.5, -0.8) = -0.5, max(0.5, 0.8) = 0.8 (clipped), 1.5
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5) / 4)
    assert out.metrics["clip_frac"].item() == pytest.approx(0.5)
    assert out.metrics["ratio_max"].item() == pytest.approx(1.5)
    assert out.metrics["ppo_kl"].item() == pytest.approx(-(2 * math.log(1.5) + 2 * math.log(0.5)) / 4)


def test_ppo_gradient_is_zero_for_tokens_clipped_on_the_profitable_side() -> None:
    logp, old, adv = _four_cases()
    ppo_clip_loss(logp, old, adv, torch.ones(1, 4), clip_ratio_low=0.2).loss.backward()
    # Clipped tokens (0: A>0 ratio>1.2; 2: A<0 ratio<0.8) get no gradient; the unprofitable side is not clipped:
    # d(-A * ratio)/d logp = -A * ratio, divided by 4 tokens.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 / 4, 0.0, 1.5 / 4]]))


def test_clip_higher_uses_asymmetric_bounds() -> None:
    ratio = torch.tensor([[1.25, 1.3, 0.79]])
    logp = ratio.log().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    out = ppo_clip_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_ratio_low=0.2, clip_ratio_high=0.28)
    out.loss.backward()
    # 1.25 < 1.28 stays unclipped; 1.3 > 1.28 and 0.79 < 0.8 are clipped.
    assert logp.grad[0, 0] != 0 and logp.grad[0, 1] == 0 and logp.grad[0, 2] == 0
    assert out.metrics["clip_frac"].item() == pytest.approx(2 / 3)


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    ratio = torch.tensor([[5.0, 2.0, 5.0]])
    logp = ratio.log().requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    out = ppo_clip_loss(
        logp, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_ratio_c=3.0, loss_agg_mode="seq-mean-token-sum"
    )
    out.loss.backward()
    # token 0: min(max(5, 1.2), 3) = 3 (dual-clip, no gradient); token 1: 2 (< 3, gradient 2); token 2: -1.2 (clipped)
    assert out.loss.item() == pytest.approx(3.0 + 2.0 - 1.2)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0, 0.0]]))
    assert out.metrics["clip_frac_lower"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="clip_ratio_c > 1"):
        ppo_clip_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_ratio_c=0.9)


def test_clip_fraction_counts_active_clipping_on_valid_tokens_only() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = 0.5 * torch.randn(8, 10, generator=gen)
    adv = torch.randn(8, 10, generator=gen)
    mask = _mask(torch.randint(1, 11, (8,), generator=gen).tolist(), 10)
    ratio = logp.exp()
    active = ((adv > 0) & (ratio > 1.28)) | ((adv < 0) & (ratio < 0.8))
    expected = (active.float() * mask).sum() / mask.sum()
    out = ppo_clip_loss(logp, torch.zeros(8, 10), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert out.metrics["clip_frac"].item() == pytest.approx(expected.item())
    assert out.metrics["ratio_max"].item() == pytest.approx(ratio[mask.bool()].max().item())


def test_importance_weights_scale_per_token_loss_without_gradient() -> None:
    logp = torch.zeros(1, 2, requires_grad=True)
    weights = torch.tensor([[0.5, 2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0]])
    out = ppo_clip_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), importance_weights=weights)
    assert out.loss.item() == pytest.approx((-0.5 - 2.0) / 2)  # ratio 1: per-token loss -A, weighted
    out.loss.backward()
    assert weights.grad is None
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -1.0]]))


# ---------------------------------------------------------------- GSPO


def test_gspo_ratio_is_exp_of_mean_token_log_ratio() -> None:
    gen = torch.Generator().manual_seed(1)
    mask = _mask([4, 2], 4)
    old = torch.randn(2, 4, generator=gen)
    logp = old + 0.3 * torch.randn(2, 4, generator=gen)
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    # Wide clip range: the loss of one sequence with A = -1 is exactly s_i.
    for i in range(2):
        out = gspo_loss(logp[i : i + 1], old[i : i + 1], -torch.ones(1, 4), mask[i : i + 1], clip_ratio_low=10.0)
        assert out.loss.item() == pytest.approx(s[i].item(), rel=1e-6)
    metrics = gspo_loss(logp, old, torch.ones(2, 4), mask).metrics
    assert metrics["ratio_mean"].item() == pytest.approx(s.mean().item(), rel=1e-6)


def test_gspo_gradient_matches_sequence_level_objective() -> None:
    gen = torch.Generator().manual_seed(2)
    lengths = [5, 2, 4, 3]
    mask = _mask(lengths, 5)
    old = torch.randn(4, 5, generator=gen)
    # Sequences 0, 1 stay inside [1 - 3e-4, 1 + 4e-4]; 2 (A>0, s>1+4e-4) and 3 (A<0, s<1-3e-4) are clipped.
    mean_shift = torch.tensor([1e-4, -1e-4, 1e-2, -1e-2]).unsqueeze(-1)
    noise = 1e-3 * torch.randn(4, 5, generator=gen)
    noise = noise - (noise * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)  # zero mean per sequence
    logp_data = (old + mean_shift + noise) * mask + old * (1 - mask)
    seq_adv = torch.tensor([1.0, -2.0, 1.5, -0.5])
    adv = seq_adv.unsqueeze(-1) * mask

    logp = logp_data.clone().requires_grad_(True)
    out = gspo_loss(logp, old, adv, mask, clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    out.loss.backward()

    # Direct sequence-level GSPO objective (paper eq.): J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i), loss = -J.
    ref_logp = logp_data.clone().requires_grad_(True)
    s = torch.exp(((ref_logp - old) * mask).sum(-1) / mask.sum(-1))
    direct = -torch.minimum(s * seq_adv, s.clamp(1 - 3e-4, 1 + 4e-4) * seq_adv).mean()
    direct.backward()
    # Both compute the same float32 ops in a different order: agree to float32 rounding (~1e-7 relative).
    assert out.loss.item() == pytest.approx(direct.item(), rel=1e-5)
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-5, atol=1e-7)

    # And the closed form: grad_{i,t} = -A_i s_i / (G |y_i|) for unclipped sequences, 0 for clipped ones.
    s = s.detach()
    unclipped = torch.tensor([1.0, 1.0, 0.0, 0.0])
    closed = (-seq_adv * s * unclipped / (4 * torch.tensor(lengths, dtype=torch.float32))).unsqueeze(-1) * mask
    torch.testing.assert_close(logp.grad, closed, rtol=1e-5, atol=1e-7)
    assert out.metrics["clip_frac"].item() == pytest.approx((4 + 3) / sum(lengths))


# ---------------------------------------------------------------- value loss, entropy, registry


def test_value_loss_with_clipping_hand_values() -> None:
    values = torch.tensor([[1.0, 0.2]], requires_grad=True)
    old, returns = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    out = value_loss(values, old, returns, torch.ones(1, 2), clip_range_value=0.5)
    # token 0: V moved 1.0 > 0.5, clipped to 0.5: max(0, 0.25) = 0.25; token 1: 0.64 either way.
    assert out.loss.item() == pytest.approx(0.5 * (0.25 + 0.64) / 2)
    assert out.metrics["vf_clipfrac"].item() == pytest.approx(0.5)
    out.loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.5 * 2 * (0.2 - 1.0) / 2]]))
    unclipped = value_loss(values, old, returns, torch.ones(1, 2), clip_range_value=None)
    assert unclipped.loss.item() == pytest.approx(0.5 * (0.0 + 0.64) / 2)


def test_entropy_from_logits_matches_categorical_and_handles_masked_vocab() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(2, 3, 11, generator=gen)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    assert entropy_from_logits(torch.zeros(7)).item() == pytest.approx(math.log(7))
    masked = torch.tensor([0.0, 0.0, float("-inf")], requires_grad=True)
    h = entropy_from_logits(masked)
    h.backward()
    assert h.item() == pytest.approx(math.log(2))
    assert torch.isfinite(masked.grad).all()
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32


def test_unknown_policy_loss_raises_listing_known_names() -> None:
    assert get_policy_loss("gspo") is gspo_loss
    with pytest.raises(ValueError, match="unknown policy loss 'vanila'") as info:
        get_policy_loss("vanila")
    for name in POLICY_LOSSES:
        assert name in str(info.value)


# ---------------------------------------------------------------- KL


def test_kl_estimators_hand_values() -> None:
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])  # d = logp - ref = [1, -1]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5, 0.5]))
    expected_k3 = torch.tensor([math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1])
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), expected_k3)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), expected_k3)


def test_k3_is_nonnegative_zero_at_equality_and_clamped() -> None:
    gen = torch.Generator().manual_seed(4)
    logp, ref = 3 * torch.randn(1000, generator=gen), 3 * torch.randn(1000, generator=gen)
    k3 = kl_penalty(logp, ref, "k3")
    assert (k3 >= 0).all() and (k3 <= 10).all()
    assert torch.all(kl_penalty(logp, logp.clone(), "k3") == 0)
    # Both extremes hit verl's [-10, 10] clamp instead of exp overflowing.
    assert kl_penalty(torch.tensor([-50.0, 0.0]), torch.tensor([0.0, -50.0]), "k3").tolist() == [10.0, 10.0]


def test_k1_and_k3_are_unbiased_estimators_of_kl() -> None:
    # E_{x~p}[k(x)] summed exactly over a small vocabulary equals KL(p || q) for k1 and k3 (not for k2).
    gen = torch.Generator().manual_seed(5)
    logp = torch.log_softmax(torch.randn(7, generator=gen), -1)
    ref = torch.log_softmax(torch.randn(7, generator=gen), -1)
    exact = (logp.exp() * (logp - ref)).sum()
    for kind in ("k1", "k3"):
        torch.testing.assert_close((logp.exp() * kl_penalty(logp, ref, kind)).sum(), exact)


def test_kl_loss_gradient_and_masking() -> None:
    logp = torch.tensor([[-1.0, -0.5, -9.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss = kl_loss(logp, ref, mask, kind="low_var_kl")
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp); token-mean over 2 valid tokens; the padded token gets nothing.
    assert loss.item() == pytest.approx((math.exp(-0.5) + 0.5 - 1) / 2)
    torch.testing.assert_close(logp.grad, torch.tensor([[(1 - math.exp(-0.5)) / 2, 0.0, 0.0]]))


def test_apply_kl_penalty_subtracts_scaled_kl_on_valid_tokens() -> None:
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.5, 0.0], [-1.0, -3.0, -2.0]])  # k1 = [1, .5, pad], [0, 2, 1]
    mask = _mask([2, 3], 3)
    rewards, metrics = apply_kl_penalty(scores, logp, ref, mask, kl_coef=0.1, kind="k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.95, 0.0], [0.0, -0.2, 1.9]]))
    assert metrics["kl_token_mean"].item() == pytest.approx((0.75 + 1.0) / 2)
    assert metrics["kl_seq_sum"].item() == pytest.approx((1.5 + 3.0) / 2)


def test_kl_controllers() -> None:
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 64)
    assert fixed.value == 0.05
    up = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    up.update(current_kl=12.0, n_steps=100)  # error clipped to +0.2
    assert up.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    band = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    band.update(current_kl=6.6, n_steps=100)  # error 0.1, inside the clip
    assert band.value == pytest.approx(0.1 * (1 + 0.1 * 100 / 10000))
    down = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    down.update(current_kl=0.0, n_steps=100)
    assert down.value == pytest.approx(0.1 * (1 - 0.2 * 100 / 10000))


def test_unknown_kl_estimator_raises_listing_known_names() -> None:
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'") as info:
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
    for name in KL_ESTIMATORS:
        assert name in str(info.value)


# ---------------------------------------------------------------- rollout / training mismatch


def test_tis_weights_clamp_at_cap_and_carry_no_gradient() -> None:
    ratios = torch.tensor([[0.5, 1.0, 3.0, 100.0, 7.0]])
    old = ratios.log().requires_grad_(True)
    rollout = torch.zeros(1, 5)
    mask = _mask([4], 5)
    w = truncated_importance_weights(old, rollout, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 2.0, 2.0, 0.0]]))
    assert not w.requires_grad
    huge = truncated_importance_weights(torch.tensor([[1e4]]), torch.tensor([[0.0]]), torch.ones(1, 1), cap=2.0)
    assert huge.item() == pytest.approx(2.0)


def test_sequence_mis_drops_whole_sequences_outside_bounds() -> None:
    mask = _mask([2, 2, 2, 1], 2)
    # Per-sequence summed log-ratios: log 1.5 (kept), log 3 (> 2), log 0.4 (< 1/2), 1000 (overflow-safe reject).
    half = torch.tensor([math.log(1.5), math.log(3.0), math.log(0.4), 1000.0]) / torch.tensor([2.0, 2.0, 2.0, 1.0])
    old = half.unsqueeze(-1).expand(4, 2) * mask
    w = sequence_masked_importance_weights(old, torch.zeros(4, 2), mask, upper=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    # Geometric mean: rho = exp(mean) = sqrt of the product for two-token rows.
    geo = sequence_masked_importance_weights(old, torch.zeros(4, 2), mask, upper=1.3, geometric=True)
    torch.testing.assert_close(geo[:3, 0], torch.tensor([math.sqrt(1.5), 0.0, 0.0]))


def test_mismatch_metrics_are_zero_when_engines_agree() -> None:
    logp = torch.randn(3, 4, generator=torch.Generator().manual_seed(6))
    m = mismatch_metrics(logp, logp.clone(), torch.ones(3, 4))
    assert m["mismatch_kl_k1"].item() == 0 and m["mismatch_kl_k3"].item() == 0
    assert m["mismatch_ratio_mean"].item() == 1.0 and m["mismatch_abs_diff_max"].item() == 0
    shifted = mismatch_metrics(logp + 0.1, logp, torch.ones(3, 4))
    assert shifted["mismatch_kl_k1"].item() == pytest.approx(-0.1, abs=1e-6)
    assert shifted["mismatch_abs_diff_max"].item() == pytest.approx(0.1, abs=1e-6)
