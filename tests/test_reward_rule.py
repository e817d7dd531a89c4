"""Tests for the built-in rule rewards: hand examples, and that the synthetic task starts hard and ends solvable."""

import pytest
import torch

from mcore_rl.data.synthetic import TASKS, synthetic_rows
from mcore_rl.data.tokenizer import build_tiny_tokenizer
from mcore_rl.reward.loader import BUILTIN_REWARDS, RewardFunctionError, default_compute_score
from mcore_rl.reward.rule import (
    extract_boxed,
    extract_gsm8k_answer,
    gsm8k_score,
    math_boxed_score,
    normalize_math_answer,
    synthetic_digits_score,
)


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


@pytest.mark.parametrize(
    "response, method, expected",
    [
        ("so 3 + 4 = 7\n#### 7", "strict", "7"),
        ("#### 1,234", "strict", "1234"),
        ("#### 5 then #### -6", "strict", "-6"),
        ("the answer is 7", "strict", None),
        ("the answer is 7.", "flexible", "7"),
        ("3 apples and 12 pears", "flexible", "12"),
        ("no numbers here.", "flexible", None),
    ],
)
def test_gsm8k_extraction(response, method, expected):
    assert extract_gsm8k_answer(response, method) == expected


def test_gsm8k_score_strict_and_flexible():
    assert gsm8k_score("openai/gsm8k", "work...\n#### 72", "72") == 1.0
    assert gsm8k_score("openai/gsm8k", "#### 72.0", "72") == 1.0
    assert gsm8k_score("openai/gsm8k", "#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_score("openai/gsm8k", "the answer is 72", "72") == 0.0
    assert gsm8k_score("openai/gsm8k", "the answer is 72", "72", method="flexible") == 1.0
    assert default_compute_score("openai/gsm8k", "#### 72", "72") == 1.0


@pytest.mark.parametrize(
    "response, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}} and later \\boxed{x^{2}}", "x^{2}"),
        ("\\fbox{3}", "3"),
        ("\\boxed 5$", "5"),
        ("\\boxed{unclosed", None),
        ("no box", None),
    ],
)
def test_extract_boxed(response, expected):
    assert extract_boxed(response) == expected


def test_math_boxed_score_normalises_simple_spellings():
    for answer in ["\\frac{1}{2}", "\\dfrac12", "1/2", "0.5", "0.50", "1 / 2", "$1/2$"]:
        assert math_boxed_score("lighteval/MATH", f"... \\boxed{{{answer}}}", "\\frac12") == 1.0, answer
    assert math_boxed_score("lighteval/MATH", "\\boxed{10^\\circ}", "10") == 1.0
    assert math_boxed_score("lighteval/MATH", "\\boxed{\\text{(B)}}", "(B)") == 1.0
    assert math_boxed_score("lighteval/MATH", "\\boxed{3}", "\\boxed{3}") == 1.0
    assert math_boxed_score("lighteval/MATH", "\\boxed{3}", "4") == 0.0
    assert math_boxed_score("lighteval/MATH", "the answer is 3", "3") == 0.0
    assert normalize_math_answer("inf") == "inf"
