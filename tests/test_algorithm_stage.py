"""The controller's algorithm stage without Ray: advantages for every registered estimator, GAE against a hand
computation, KL in the reward with its checkpointed controller, rollout-correction weights, and the config's refusals.

Run: `.venv/bin/pytest tests/test_algorithm_stage.py`
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_qwen3_moe

from mcore_rl.actor.batch import TrainBatch
from mcore_rl.algorithms import ADVANTAGE_ESTIMATORS
from mcore_rl.config import AlgorithmConfig, ConfigError, ModelConfig, RLConfig
from mcore_rl.controller.advantage_stage import KL_STATE, AdvantageStage
from mcore_rl.controller.producer import Rollouts

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
SCORES = torch.tensor([1.0, 0.0, 0.5, 0.25])


def _rollouts(old=None, ref=None, rollout=None, values=None, baseline=None) -> Rollouts:
    zeros = torch.zeros_like(MASK)
    tensors = {
        "old_logprobs": zeros if old is None else old,
        "rollout_logprobs": zeros if rollout is None else rollout,
        "ref_logprobs": zeros if ref is None else ref,
    }
    if values is not None:
        tensors["values"] = values
    batch = TrainBatch([[1, 2]] * 4, torch.ones(4, 3, dtype=torch.long), MASK.clone(), tensors)
    return Rollouts([{}] * 4, [], SCORES.clone(), batch, torch.tensor([0, 0, 1, 1]), baseline_scores=baseline)


def _hand_gae(scores: list[float], values: list[list[float]], lengths: list[int], gamma: float, lam: float):
    """GAE written out per sequence: reward on the last token, V = 0 after it."""
    advantages, returns = [], []
    for score, v, length in zip(scores, values, lengths):
        rewards = [0.0] * (length - 1) + [score]
        adv = [0.0] * length
        for t in range(length):
            adv[t] = sum(
                (gamma * lam) ** k * (rewards[t + k] + gamma * (v[t + k + 1] if t + k + 1 < length else 0.0) - v[t + k])
                for k in range(length - t)
            )
        advantages.append(adv)
        returns.append([a + v[t] for t, a in enumerate(adv)])
    return advantages, returns


def test_gae_matches_the_hand_computation():
    values = torch.tensor([[0.3, -0.2, 0.7], [0.1, 9.0, 9.0], [0.5, 0.4, 9.0], [-0.3, 0.2, 0.6]])  # 9 = padding
    rollouts = _rollouts(values=values * MASK)
    stage = AdvantageStage(AlgorithmConfig(adv_estimator="gae", gamma=0.9, lam=0.8), {})
    stage.compute(rollouts)
    lengths = [3, 1, 2, 3]
    adv, ret = _hand_gae(SCORES.tolist(), values.tolist(), lengths, 0.9, 0.8)
    got_ret = rollouts.batch.tensors["returns"]
    flat_adv = [a for row in adv for a in row]
    mean = sum(flat_adv) / len(flat_adv)
    std = math.sqrt(sum((a - mean) ** 2 for a in flat_adv) / (len(flat_adv) - 1))
    got_adv = rollouts.batch.tensors["advantages"]
    for i, length in enumerate(lengths):
        assert got_ret[i, :length].tolist() == pytest.approx(ret[i], abs=1e-6)
        assert got_adv[i, :length].tolist() == pytest.approx([(a - mean) / std for a in adv[i]], abs=1e-5)
        assert got_adv[i, length:].abs().sum() == 0 and got_ret[i, length:].abs().sum() == 0


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_registered_estimator_runs_through_the_stage(name: str):
    rollouts = _rollouts(values=torch.full_like(MASK, 0.1) * MASK, baseline=torch.tensor([0.5, 0.5, 0.0, 0.0]))
    AdvantageStage(AlgorithmConfig(adv_estimator=name), {}).compute(rollouts)
    advantages = rollouts.batch.tensors["advantages"]
    assert advantages.shape == MASK.shape and torch.isfinite(advantages).all()
    assert (advantages * (1 - MASK)).abs().sum() == 0
    if name == "remax":  # r - r_greedy on every token
        expected = (SCORES - torch.tensor([0.5, 0.5, 0.0, 0.0])).unsqueeze(-1) * MASK
        torch.testing.assert_close(advantages, expected)


def test_missing_critic_values_are_refused_by_name():
    with pytest.raises(ValueError, match=r"adv_estimator='gae' needs \['values'\]"):
        AdvantageStage(AlgorithmConfig(adv_estimator="gae"), {}).compute(_rollouts())


def test_kl_in_reward_uses_and_checkpoints_the_adaptive_coefficient():
    cfg = AlgorithmConfig(adv_estimator="rloo", use_kl_in_reward=True, kl_penalty="kl")
    cfg.kl_ctrl.type, cfg.kl_ctrl.kl_coef, cfg.kl_ctrl.target_kl, cfg.kl_ctrl.horizon = "adaptive", 0.5, 0.01, 8
    old = torch.full_like(MASK, -1.0)
    ref = torch.full_like(MASK, -1.5)  # KL_t = old - ref = 0.5 on every valid token, far above the target
    controllers: dict = {}
    rollouts = _rollouts(old=old, ref=ref)
    metrics = AdvantageStage(cfg, controllers).compute(rollouts)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    # Sequence rewards are score - 0.5 * 0.5 per token: 1 - 0.75 and 0 - 0.25 in group 0 -> RLOO +-0.5 (not +-1).
    advantages = rollouts.batch.tensors["advantages"]
    assert float(advantages[0, 0]) == pytest.approx(0.5) and float(advantages[1, 0]) == pytest.approx(-0.5)
    grown = 0.5 * (1 + 0.2 * 4 / 8)  # error clipped at +0.2, n_steps = 4 samples, horizon 8
    assert controllers[KL_STATE]["kl_coef"] == pytest.approx(grown)
    resumed = AdvantageStage(cfg, controllers)  # a resumed run: the coefficient comes from the loop state
    assert resumed.kl_ctrl.value == pytest.approx(grown)


def test_rollout_correction_weights_reach_the_batch():
    rollout = torch.zeros_like(MASK)
    old = torch.tensor([[0.0, 2.0, 0.0], [0.1, 0.0, 0.0], [0.0, 0.0, 0.0], [-3.0, 0.0, 0.0]]) * MASK
    cfg = AlgorithmConfig()
    cfg.rollout_correction.rollout_is, cfg.rollout_correction.rollout_is_threshold = "token", 2.0
    cfg.rollout_correction.rollout_rs, cfg.rollout_correction.rollout_rs_threshold = "sequence", 10.0
    rollouts = _rollouts(old=old, rollout=rollout)
    metrics = AdvantageStage(cfg, {}).compute(rollouts)
    weights = rollouts.batch.tensors["importance_weights"]
    assert weights[0].tolist() == pytest.approx([1.0, 2.0, 1.0])  # exp(2) truncated at 2
    assert weights[1, 0] == pytest.approx(math.exp(0.1))
    assert weights[3].abs().sum() == 0  # exp(-3) < 1/10: the sequence is rejected (exp(2) <= 10 is kept)
    assert metrics["rollout_corr/is_truncated_frac"] == pytest.approx(1 / 9)
    assert metrics["rollout_corr/rs_masked_frac"] == pytest.approx(1 / 4)
    assert metrics["rollout_corr/mismatch_log_ratio_max"] == pytest.approx(2.0)


def _config(**groups) -> RLConfig:
    cfg = RLConfig(model=ModelConfig(hf_config=tiny_qwen3_moe()))
    cfg.data.batch_size, cfg.rollout.n = 4, 4
    for path, value in groups.items():
        target = cfg
        *parents, leaf = path.split("__")
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)
    return cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"algorithm__adv_estimator": "gae"}, "algorithm.adv_estimator='gae' needs a critic: expected critic.enable"),
        ({"critic__enable": True}, "critic.enable=True is invalid: expected false with algorithm.adv_estimator='grpo'"),
        ({"algorithm__adv_estimator": "ppo"}, "expected one of ('gae', 'grpo', 'rloo', 'opo', 'remax'"),
        ({"actor__policy_loss": "dpo"}, "actor.policy_loss='dpo' is invalid: expected one of ('ppo', 'gspo')"),
        ({"actor__loss_agg_mode": "sum"}, "actor.loss_agg_mode='sum' is invalid: expected one of ('token-mean'"),
        ({"algorithm__kl_penalty": "k9"}, "algorithm.kl_penalty='k9' is invalid: expected one of ('k1'"),
        ({"algorithm__kl_ctrl__type": "pid"}, "algorithm.kl_ctrl.type='pid' is invalid: expected one of ('fixed'"),
        (
            {"algorithm__rollout_correction__rollout_is": "seq"},
            "algorithm.rollout_correction.rollout_is='seq' is invalid: expected null or one of ('token', 'sequence')",
        ),
        (
            {"algorithm__filter_groups__on_unfilled": "retry"},
            "algorithm.filter_groups.on_unfilled='retry' is invalid: expected error or shrink",
        ),
        (
            {"reward__overlong_buffer__enable": True, "reward__overlong_buffer__len": 9, "rollout__max_new_tokens": 8},
            "reward.overlong_buffer.len=9 is invalid: expected in [1, rollout.max_new_tokens=8]",
        ),
        (
            {"algorithm__adv_estimator": "gae", "critic__enable": True, "critic__mini_batches": 3},
            "critic.mini_batches=3 is invalid: expected a divisor of data.batch_size*rollout.n/dp = 16/1",
        ),
        (
            {"algorithm__use_kl_in_reward": True, "actor__use_ref": False},
            "actor.use_ref=false is invalid with algorithm.use_kl_in_reward=true: it needs the reference model",
        ),
    ],
)
def test_config_refuses_algorithm_options_by_name(overrides: dict, message: str):
    with pytest.raises(ConfigError) as err:
        _config(**overrides).validate()
    assert message in str(err.value)


def test_config_accepts_every_registered_estimator():
    for name in ADVANTAGE_ESTIMATORS:
        _config(algorithm__adv_estimator=name, critic__enable=name == "gae").validate()


def _entropy_rank(rank: int, world_size: int, logits: torch.Tensor, vocab_size: int) -> tuple:
    import torch.distributed as dist

    from mcore_rl.actor.logprobs import vocab_parallel_entropy_grad

    local = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
    entropy = vocab_parallel_entropy_grad(local, vocab_size, dist.group.WORLD)
    (entropy * torch.arange(1.0, entropy.numel() + 1).view_as(entropy)).sum().backward()
    return entropy.detach(), local.grad


@pytest.mark.slow
def test_entropy_bonus_gradient_is_exact_under_tensor_parallelism():
    from mcore_rl.algorithms import entropy_from_logits
    from mcore_rl.parallel.harness import run_on_ranks

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 10)
    results = run_on_ranks(_entropy_rank, world_size=2, args=(logits, 9))  # column 9 is Megatron's vocab padding
    full = logits[..., :9].clone().requires_grad_(True)
    reference = entropy_from_logits(full)
    (reference * torch.arange(1.0, reference.numel() + 1).view_as(reference)).sum().backward()
    for entropy, _ in results:
        torch.testing.assert_close(entropy, reference.detach(), rtol=1e-5, atol=1e-6)
    grad = torch.cat([g for _, g in results], dim=-1)
    torch.testing.assert_close(grad[..., :9], full.grad, rtol=1e-5, atol=1e-6)
    assert grad[..., 9].abs().max() == 0
