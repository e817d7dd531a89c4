"""Metrics under verl's names (verl/trainer/ppo/metric_utils.py and rollout_corr_helper.py): the ones a verl user looks
for are there with verl's definitions, beside ours; validation logs val-core/<data_source>/acc/mean@N when the reward
returns acc."""

from __future__ import annotations

import math

import torch

from mcore_rl.actor.batch import TrainBatch
from mcore_rl.metrics.compute import offpolicy_metrics, step_metrics


def _batch() -> TrainBatch:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)  # the third: aborted
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 4, generator=gen)
    tensors = {
        "old_logprobs": old,
        "rollout_logprobs": old + 0.1 * torch.randn(3, 4, generator=gen),
        "ref_logprobs": old - 0.2,
        "advantages": torch.randn(3, 4, generator=gen),
        "values": torch.randn(3, 4, generator=gen),
        "returns": torch.randn(3, 4, generator=gen),
    }
    return TrainBatch([[1, 2, 3], [1, 2], [5, 6, 7, 8]], torch.ones(3, 4, dtype=torch.long), mask, tensors)


def test_verls_names_are_there_with_verls_definitions() -> None:
    batch = _batch()
    scores = torch.tensor([1.0, 0.0, 0.5])
    out = step_metrics(batch, scores, {}, {"gen": 1.0}, max_response_length=3, actor_ranks=1, max_prompt_length=4,
                       reward_kl=(0.1, "kl"), kl_loss_coef=0.01)  # fmt: skip
    for name in ("critic/rewards/mean", "critic/returns/max", "critic/values/min", "critic/vf_explained_var",
                 "response_length_non_aborted/mean", "response/aborted_ratio", "prompt_length/clip_ratio",
                 "actor/kl_coef", "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/training_ppl",
                 "rollout_corr/chi2_seq", "critic/score/mean", "rollout/logprob_abs_diff"):  # fmt: skip
        assert name in out, name
    assert math.isclose(out["response/aborted_ratio"], 1 / 3, rel_tol=1e-6)
    assert out["response_length_non_aborted/mean"] == 2.5 and out["response_length_non_aborted/clip_ratio"] == 0.5
    assert math.isclose(out["prompt_length/clip_ratio"], 1 / 3, rel_tol=1e-6) and out["actor/kl_coef"] == 0.01
    # critic/rewards: the score minus kl_coef x the summed in-reward KL ("kl": old - ref = 0.2 per valid token)
    expected = scores - 0.1 * 0.2 * batch.response_mask.sum(1)
    assert math.isclose(out["critic/rewards/mean"], float(expected.mean()), rel_tol=1e-5)


def test_offpolicy_metrics_follow_verls_formulas() -> None:
    batch = _batch()
    old, rollout, mask = (batch.tensors["old_logprobs"][:2], batch.tensors["rollout_logprobs"][:2],
                          batch.response_mask[:2])  # fmt: skip
    out = offpolicy_metrics(old, rollout, mask)
    tokens = [(i, t) for i in range(2) for t in range(4) if mask[i, t]]
    kl = sum(float(rollout[i, t] - old[i, t]) for i, t in tokens) / len(tokens)
    assert math.isclose(out["rollout_corr/kl"], kl, rel_tol=1e-5)
    ppl = [math.exp(-sum(float(old[i, t]) for j, t in tokens if j == i) / int(mask[i].sum())) for i in range(2)]
    assert math.isclose(out["rollout_corr/training_ppl"], sum(ppl) / 2, rel_tol=1e-5)
    seq = [sum(float(old[i, t] - rollout[i, t]) for j, t in tokens if j == i) for i in range(2)]
    assert math.isclose(out["rollout_corr/chi2_seq"], sum(math.exp(2 * s) for s in seq) / 2 - 1, rel_tol=1e-5)


class _Engines:
    def generate(self, ids, n, seed, eos, overrides=None):
        return [object()] * (len(ids) * n)


class _Reward:
    """A RewardManager's last_output(): the acc extras of the last scored samples."""

    def __init__(self) -> None:
        self.accs: list[float] = []

    def last_output(self):
        from types import SimpleNamespace

        return SimpleNamespace(extras={"acc": self.accs})


def test_validation_logs_acc_when_the_reward_returns_it() -> None:
    from mcore_rl.controller.validation import Validator

    reward = _Reward()

    def score(prompts, samples, n):
        reward.accs = [True, False] * (len(samples) // 2)
        return torch.tensor([1.0, -1.0] * (len(samples) // 2))

    prompts = [
        {"prompt_token_ids": [1], "data_source": "math_dapo"},
        {"prompt_token_ids": [2], "data_source": "math_dapo"},
    ]
    out = Validator(prompts, _Engines(), score, [0], val_n=4, batch_size=None, val_every=1, reward=reward).run(0)
    assert out["val-core/math_dapo/acc/mean@1"] == 0.5 and out["val-core/math_dapo/reward/mean@1"] == 0.0
    assert out["val-core/math_dapo/acc/mean@4"] == 0.5
