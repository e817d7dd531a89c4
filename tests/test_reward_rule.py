"""Tests for the built-in rule rewards: hand examples, and that the synthetic task starts hard and ends solvable."""

import pytest
import torch

from mcore_rl.data.synthetic import TASKS, synthetic_rows
from mcore_rl.data.tokenizer import build_tiny_tokenizer
from mcore_rl.reward.loader import BUILTIN_REWARDS, RewardFunctionError, default_compute_score
from mcore_rl.reward.rule import synthetic_digits_score


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("7", "7", 1.0),  # exact
        ("7\n", "7", 1.0),  # trailing whitespace is not an extra answer
        ("77", "7", 0.8),  # right digit but did not stop
        ("3", "7", 0.1),  # a digit, wrong one
        ("x", "7", 0.0),
        ("", "7", 0.0),
        ("372", "372", 1.0),
        ("370", "372", 0.1 + 0.7 * 2 / 3),
        ("3a", "372", 0.1 / 3 + 0.7 / 3),
    ],
)
def test_synthetic_score_on_hand_examples(response, truth, score):
    result = synthetic_digits_score("synthetic/copy_digit", response, truth)
    assert result["score"] == pytest.approx(score)
    assert result["acc"] == float(response.rstrip() == truth)


def test_random_policy_scores_low_and_correct_answer_scores_one():
    """A uniformly random policy over the tiny vocabulary (1-8 tokens per response) must start far from solved."""
    tokenizer = build_tiny_tokenizer(None)
    generator = torch.Generator().manual_seed(0)
    for task in TASKS:
        rows = synthetic_rows(200, seed=1, task=task)
        scores = []
        for row in rows:
            length = int(torch.randint(1, 9, (1,), generator=generator))
            ids = torch.randint(0, len(tokenizer), (length,), generator=generator).tolist()
            response = tokenizer.decode(ids, skip_special_tokens=True)
            scores.append(default_compute_score(row["data_source"], response, row["reward_model"]["ground_truth"]))
        mean = sum(s["score"] for s in scores) / len(scores)
        assert mean < 0.2, f"{task}: random policy mean reward {mean:.3f} is too high for a learning signal"
        truth = rows[0]["reward_model"]["ground_truth"]
        assert default_compute_score(rows[0]["data_source"], truth, truth)["score"] == 1.0


def test_every_synthetic_task_has_a_registered_reward():
    for task in TASKS.values():
        assert BUILTIN_REWARDS[task.data_source] is synthetic_digits_score


def test_unknown_data_source_error_lists_known_sources():
    with pytest.raises(RewardFunctionError, match="openai/gsm8k"):
        default_compute_score("my/dataset", "1", "1")
