"""Rewards as verl scores them: verl's data sources score the same strings to the same values (the expected values
below are what verl's own scorers return on these strings, verl b178a3c), a reward file importing
verl.utils.reward_score runs without verl, `async def` rewards are awaited, reward_kwargs reach the function, and the
data sources of the run's files are checked against the registry before anything starts."""

from __future__ import annotations

import os
import textwrap

import pytest

from mcore_rl.reward.loader import default_compute_score, load_reward_function

LONG = "x" * 400  # pushes an earlier answer out of verl's 300-character window (GSM8K and DAPO; MATH has none)

#: (data_source, response, ground truth, verl's score)
CASES = [
    ("openai/gsm8k", "so the answer is\n#### 72", "72", 1.0),
    ("openai/gsm8k", "#### 72.0", "72", 0.0),  # compared as text: 72.0 is not 72
    ("openai/gsm8k", "#### 1,000", "1000", 1.0),  # thousands separators dropped
    ("openai/gsm8k", "#### $72", "72", 0.0),  # "#### $" is not the pattern
    ("openai/gsm8k", "#### 71", "72", 0.0),  # wrong: format_score 0
    ("openai/gsm8k", "the answer is 72", "72", 0.0),  # strict: needs "#### "
    ("openai/gsm8k", "#### 72\n" + LONG, "72", 0.0),  # beyond the tail window
    ("openai/gsm8k", "#### 72 " + "y" * 280, "72", 1.0),  # inside it
    ("openai/gsm8k", "#### -3", "-3", 1.0),
    ("lighteval/MATH", "so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("lighteval/MATH", "so \\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
    ("lighteval/MATH", "so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("lighteval/MATH", "so \\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("lighteval/MATH", "so \\boxed{.5}", "0.5", 1.0),  # ".5" -> "0.5" -> \frac{1}{2}, as "0.5" does
    ("lighteval/MATH", "so \\boxed{x = 3}", "3", 1.0),
    ("lighteval/MATH", "so \\boxed{10\\%}", "10", 1.0),
    ("lighteval/MATH", "so \\boxed{5 \\text{ cm}}", "5", 1.0),
    ("lighteval/MATH", "so \\boxed{72.0}", "72", 0.0),
    ("lighteval/MATH", "\\boxed{7}" + LONG, "7", 1.0),  # MATH reads the whole response
    ("lighteval/MATH", "so \\fbox{7}", "7", 0.0),  # verl's remove_boxed fails on \fbox: 0
    ("lighteval/MATH", "so \\boxed 7$ done", "7", 1.0),
    ("lighteval/MATH", "so \\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{\\left( 3, 4 \\right)}", "(3,4)", 1.0),
    ("DigitalLearningGmbH/MATH-lighteval", "no box", "3", 0.0),
    ("math_dapo", "... Answer: 72", "72", 1.0),
    ("math_dapo", "... Answer: 72.0", "72", -1.0),
    ("math_dapo", "... answer : \\boxed{34}", "34", 1.0),
    ("math_dapo", "... Answer: $\\frac{1}{2}$", "\\frac12", 1.0),
    ("math_dapo", "... Answer: 1,000", "1000", 1.0),
    ("math_dapo", "... Answer: 5 degrees", "5", 1.0),
    ("math_dapo", "Answer: 72\n" + LONG, "72", -1.0),  # beyond the tail window
    ("math_dapo", "no answer line", "72", -1.0),
    ("aime-2024", "Answer: 204", "204", 1.0),
    ("aime25", "Answer: 17", "18", -1.0),
]


@pytest.mark.parametrize("source, response, truth, expected", CASES)
def test_builtin_scores_equal_verls(source: str, response: str, truth: str, expected: float) -> None:
    result = default_compute_score(source, response, truth)
    score = result["score"] if isinstance(result, dict) else result
    assert score == expected
    if isinstance(result, dict):  # math_dapo: verl's dict, acc = correct
        assert result["acc"] == (expected > 0)


def test_a_reward_file_importing_verl_runs_without_verl(tmp_path) -> None:
    path = tmp_path / "my_reward.py"
    path.write_text(
        textwrap.dedent(
            """
            from verl.utils.reward_score import default_compute_score, gsm8k, math_dapo

            def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                if data_source == "mine":
                    return gsm8k.compute_score(solution_str, ground_truth, method="flexible")
                if data_source == "dapo":
                    return math_dapo.compute_score(solution_str, ground_truth)["score"]
                return default_compute_score(data_source, solution_str, ground_truth, extra_info)
            """
        )
    )
    fn = load_reward_function(str(path))
    assert fn(data_source="mine", solution_str="it is 12", ground_truth="12") == 1.0
    assert fn(data_source="dapo", solution_str="Answer: 3", ground_truth="4") == -1.0
    assert fn(data_source="openai/gsm8k", solution_str="#### 72.0", ground_truth="72") == 0.0


def test_a_verl_module_without_an_equivalent_is_named(tmp_path) -> None:
    from mcore_rl.reward.loader import RewardFunctionError

    path = tmp_path / "search.py"
    path.write_text("from verl.utils.reward_score import search_r1_like_qa_em as m\ncompute_score = m.compute_score\n")
    with pytest.raises(RewardFunctionError, match="search_r1_like_qa_em is not available here.*search"):
        load_reward_function(str(path))


def test_async_reward_is_awaited_and_reward_kwargs_reach_it(tmp_path) -> None:
    path = tmp_path / "async_reward.py"
    path.write_text(
        textwrap.dedent(
            """
            import asyncio

            async def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
                await asyncio.sleep(0)
                return float(solution_str == ground_truth) + bonus
            """
        )
    )
    fn = load_reward_function(str(path), reward_kwargs={"bonus": 0.5})
    assert fn(data_source="s", solution_str="7", ground_truth="7", extra_info=None) == 1.5
    assert fn(data_source="s", solution_str="6", ground_truth="7", extra_info=None) == 0.5

    async def inside_a_loop() -> float:  # a caller that is itself a coroutine (the agent loop's thread)
        return fn(data_source="s", solution_str="7", ground_truth="7", extra_info=None)

    import asyncio

    assert asyncio.run(inside_a_loop()) == 1.5


def test_reward_kwargs_reach_the_function_through_the_config(tmp_path) -> None:
    from mcore_rl.config import RewardConfig
    from mcore_rl.reward.reward_model import build_reward

    path = tmp_path / "r.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
                    "    return scale\n")  # fmt: skip
    fn = build_reward(RewardConfig(path=str(path), kwargs={"scale": 3.0}), None)
    assert fn(data_source="s", solution_str="", ground_truth="", extra_info=None) == 3.0


def _config_with_files(tmp_path, sources: dict[str, list[str]]):
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from _verl_scripts import write_parquet

    from mcore_rl.config import RLConfig

    cfg = RLConfig()
    for group, names in sources.items():
        paths = []
        for i, source in enumerate(names):
            path = str(tmp_path / f"{group}{i}.parquet")
            write_parquet(path, source, rows=4)
            paths.append(path)
        setattr(cfg.data, group, paths)
    return cfg


def test_data_sources_without_a_scorer_are_all_named_before_the_run(tmp_path) -> None:
    from mcore_rl.compat.verl.shim import WITHOUT_SCORER
    from mcore_rl.config import ConfigError
    from mcore_rl.reward.sources import check_data_sources

    cfg = _config_with_files(
        tmp_path,
        {"train_files": ["openai/gsm8k", "numina_other"], "val_files": ["aime-2024", "my/own", "numina_cn_k12"]},
    )
    with pytest.raises(ConfigError) as err:
        check_data_sources(cfg, WITHOUT_SCORER)
    message = str(err.value)
    assert "numina_other" in message and "prime_math" in message and "'my/own'" in message
    for scored in ("gsm8k", "aime-2024", "numina_cn_k12"):  # verl's six numina_* sources score (prime_math.py)
        assert f"data_source={scored!r}" not in message
    cfg.reward.path = "my_reward.py"  # a user function decides what it scores
    check_data_sources(cfg, WITHOUT_SCORER)
