"""Tests for loading user reward functions and for RewardManager's validation, threads and timeouts."""

import math
import mmap
import re
import textwrap
import threading

import pytest
import torch

from mcore_rl.reward.loader import RewardFunctionError, build_reward_fn, load_reward_function, register_reward
from mcore_rl.reward.manager import RewardManager, RewardTimeoutError

USER_REWARDS = """
import math

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)

def with_kwargs(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": float(solution_str == ground_truth) + bonus, "length": len(solution_str)}

def old_style(data_source, solution_str, ground_truth):
    return 1.0

def wrong_signature(text, answer):
    return 1.0

def returns_nan(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan

def returns_none(data_source, solution_str, ground_truth, extra_info=None):
    return None

def returns_str(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"

def returns_dict_without_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}

def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyError("answer")

NOT_CALLABLE = 3
"""


@pytest.fixture()
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(USER_REWARDS))
    return str(path)


# --- loading -----------------------------------------------------------------------------------------------------


def test_load_from_file_spec_and_verl_path_name(user_file):
    fn = load_reward_function(f"{user_file}:compute_score")
    assert fn(data_source="d", solution_str="4", ground_truth="4", extra_info=None) == 1.0
    assert load_reward_function(user_file) is fn  # verl's default name is compute_score; the module is cached
    assert load_reward_function(user_file, name="compute_score") is fn


def test_load_from_module_spec_and_reward_kwargs(user_file):
    fn = load_reward_function("mcore_rl.compat.verl.scores:gsm8k_score", reward_kwargs={"method": "flexible"})
    assert fn(data_source="openai/gsm8k", solution_str="it is 12", ground_truth="12") == 1.0
    bonus = build_reward_fn(user_file, "with_kwargs", {"bonus": 0.5})
    assert bonus(data_source="d", solution_str="4", ground_truth="4")["score"] == 1.5


def test_function_without_extra_info_is_accepted_and_called_without_it(user_file):
    fn = load_reward_function(f"{user_file}:old_style")
    assert fn(data_source="d", solution_str="x", ground_truth="y", extra_info={"index": 0}) == 1.0
    assert fn.__name__ == "old_style"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{dir}/missing.py:compute_score", "not found: {dir}/missing.py"),
        ("{file}:nope", "has no function 'nope'"),
        ("{file}:NOT_CALLABLE", "NOT_CALLABLE is not callable"),
        ("{file}:wrong_signature", "wrong_signature has signature (text, answer)"),
        ("no_such_module_xyz:fn", "cannot import reward function module 'no_such_module_xyz'"),
        ("{file}", "compute_score"),  # sanity: a good spec in the same table loads (checked below)
    ],
)
def test_bad_reward_specs_raise_errors_naming_the_problem(tmp_path, user_file, spec, message):
    spec = spec.format(dir=tmp_path, file=user_file)
    message = message.format(dir=tmp_path)
    if spec == user_file:
        assert callable(load_reward_function(spec))
        return
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function(spec)
    assert message in str(info.value)


def test_file_that_fails_to_import_is_named(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import not_a_real_package_abc\n")
    with pytest.raises(RewardFunctionError, match=r"broken\.py failed: ModuleNotFoundError"):
        load_reward_function(f"{path}:compute_score")


def test_register_reward_refuses_duplicates_and_bad_signatures():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("openai/gsm8k", lambda data_source, solution_str, ground_truth, extra_info=None: 0.0)
    with pytest.raises(RewardFunctionError, match="cannot be called as compute_score"):
        register_reward("new/source", lambda x: 0.0)


# --- RewardManager -----------------------------------------------------------------------------------------------


def test_manager_scores_builtin_batch_with_extras_and_metrics():
    manager = RewardManager(build_reward_fn())
    out = manager.score(
        ["7", "3", "#### 12"], ["synthetic/copy_digit", "synthetic/copy_digit", "openai/gsm8k"], ["7", "7", "12"]
    )
    assert torch.equal(out.scores, torch.tensor([1.0, 0.1, 1.0]))
    assert out.scores.dtype == torch.float32
    assert out.extras["acc"] == [1.0, 0.0, None]  # the gsm8k row returned a float: no extras
    assert out.metrics["reward/synthetic/copy_digit/score_mean"] == pytest.approx(0.55)
    assert out.metrics["reward/acc_mean"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    "function, message",
    [
        ("returns_nan", "returned nan; expected a finite score"),
        ("returns_none", "returned None of type NoneType"),
        ("returns_str", "returned '1.0' of type str"),
        ("returns_dict_without_score", "returned a dict without 'score' (keys: ['acc'])"),
        ("raises", "raised on row 0 (data_source='src/a'): KeyError"),
    ],
)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_bad_return_values_raise_errors_naming_data_source_and_value(user_file, function, message, num_threads):
    manager = RewardManager(load_reward_function(f"{user_file}:{function}"), num_threads=num_threads)
    with pytest.raises(RewardFunctionError) as info:
        manager.score(["a", "b"], ["src/a", "src/b"], ["a", "b"])
    assert message in str(info.value) and function in str(info.value)
    assert "data_source='src/" in str(info.value)


def test_threaded_scoring_keeps_row_order():
    def score(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str)

    out = RewardManager(score, num_threads=4, timeout_s=10).score([str(i) for i in range(20)], ["s"] * 20, ["0"] * 20)
    assert out.scores.tolist() == [float(i) for i in range(20)]


def test_timeout_raises_or_gives_timeout_score_without_waiting_for_the_hung_call():
    """The good rows must finish inside the timeout however loaded the machine is: 2 s, not 0.2 s (a call that
    returns at once could be starved of the CPU for 0.2 s in a busy CI and be counted as hung)."""
    release = threading.Event()

    def slow_on_row_one(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            release.wait()  # a hung verifier; released at the end so the daemon thread exits
        return 1.0

    args = (["ok", "hang", "ok"], ["src/a", "src/hang", "src/a"], ["x"] * 3)
    try:
        with pytest.raises(RewardTimeoutError, match=r"timeout_s=2.0 on row 1 \(data_source='src/hang'\)"):
            RewardManager(slow_on_row_one, num_threads=2, timeout_s=2.0).score(*args)
        out = RewardManager(slow_on_row_one, num_threads=1, timeout_s=2.0, timeout_score=0.0).score(*args)
        # num_threads=1: the row after the hung one still ran, because the hung thread was abandoned.
        assert out.scores.tolist() == [1.0, 0.0, 1.0]
        assert out.metrics["reward/timeouts"] == 1.0
    finally:
        release.set()


def test_batch_reward_fn_seam_is_called_once_and_validated():
    class FakeRewardModel:
        calls = 0

        def score_batch(self, data_sources, solution_strs, ground_truths, extra_infos):
            self.calls += 1
            return [0.5 if s else math.inf for s in solution_strs]

    model = FakeRewardModel()
    out = RewardManager(model).score(["a", "b"], ["rm", "rm"], ["", ""])
    assert model.calls == 1 and out.scores.tolist() == [0.5, 0.5]
    with pytest.raises(RewardFunctionError, match="returned inf"):
        RewardManager(model).score(["a", ""], ["rm", "rm"], ["", ""])


def test_mismatched_input_lengths_are_refused():
    with pytest.raises(ValueError, match="differ in length"):
        RewardManager(build_reward_fn()).score(["a", "b"], ["s"], ["a", "b"])


# ------------------------------------------------------------------------ rewards that end the process
def _exits(**_):
    import sys

    sys.exit(0)


def _interrupts(**_):
    raise KeyboardInterrupt


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize(
    "fn,message",
    [(_exits, r"called sys.exit\(0\)"), (_interrupts, r"raised KeyboardInterrupt \(no Ctrl-C was pressed\)")],
)
def test_sys_exit_or_keyboard_interrupt_in_a_reward_is_the_rewards_error(fn, message, num_threads):
    """A reward's sys.exit(0) ended the run with exit 0 and no marker; its KeyboardInterrupt read as Ctrl-C."""
    manager = RewardManager(fn, num_threads=num_threads)
    with pytest.raises(RewardFunctionError, match=f"_.*on row 0 \\(data_source='s'\\) {message}"):
        manager.score(["a", "b"], ["s", "s"], ["1", "1"])


def test_a_real_ctrl_c_inside_a_reward_still_interrupts(monkeypatch):
    import mcore_rl.errors as errors

    monkeypatch.setattr(errors, "sigint_received", lambda: True)
    with pytest.raises(KeyboardInterrupt):
        RewardManager(_interrupts).score(["a"], ["s"], ["1"])


def test_a_score_beyond_float_range_is_the_rewards_error():
    manager = RewardManager(lambda **_: 10**400)
    with pytest.raises(
        RewardFunctionError, match=r"returned 1000000000\d*\.\.\. \(401 characters\); expected a finite"
    ):
        manager.score(["a"], ["s"], ["1"])


def test_each_call_gets_its_own_extra_info():
    """Rewards shared one extra_info dict across the n samples of a prompt (and across epochs)."""
    seen = []

    def mutating(extra_info=None, **_):
        extra_info["calls"] = extra_info.get("calls", 0) + 1
        seen.append(extra_info["calls"])
        return 0.0

    info = {"index": 3}
    RewardManager(mutating).score(["a"] * 4, ["s"] * 4, ["1"] * 4, [info] * 4)
    assert seen == [1, 1, 1, 1] and info == {"index": 3}


# ------------------------------------------------------------------------ which error is reported (threads)
def test_threaded_errors_are_reported_for_the_first_failing_row_not_the_first_to_finish():
    """With 2 threads, row 1 raised before row 0 did and its error was reported: which row a user was told about
    depended on the threads' timing. Row 0 here fails only after row 1 has (or after 2 s)."""
    gate = threading.Event()  # set only after score() has returned: row 0 cannot finish first by accident

    def fails(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "late":
            gate.wait(2.0)
        raise ValueError(f"bad {solution_str}")

    try:
        with pytest.raises(RewardFunctionError) as info:
            RewardManager(fails, num_threads=2).score(["late", "early"], ["src/a", "src/b"], ["1", "1"])
    finally:
        gate.set()
    assert "on row 0 (data_source='src/a'): ValueError: bad late" in str(info.value)


def test_a_timeout_on_an_earlier_row_is_reported_before_a_later_rows_error():
    release = threading.Event()

    def hangs_then_fails(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            release.wait()
            return 1.0
        raise ValueError("bad")

    try:
        with pytest.raises(RewardTimeoutError, match=r"on row 0 \(data_source='src/hang'\)"):
            RewardManager(hangs_then_fails, num_threads=2, timeout_s=0.5).score(
                ["hang", "x"], ["src/hang", "src/x"], ["1", "1"]
            )
    finally:
        release.set()


# ------------------------------------------------------------------------ long reward phases
@pytest.mark.parametrize("timeout_s", [None, 30.0])  # inline calls, and threaded calls under a timeout
def test_a_long_reward_phase_reports_progress(caplog, timeout_s):
    """A slow reward (2 GB per call, swapping) stalled the run with no message. The manager logs how many rows are
    scored every `progress_every_s` of a phase; here the slow row waits until that line has been logged."""
    import logging

    progressed = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if "rows scored" in record.getMessage():
                progressed.set()

    def slow_first_row(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "slow":
            assert progressed.wait(30), "no progress line while the reward phase ran"
        return 1.0

    handler = Seen()
    logging.getLogger("mcore_rl.reward.manager").addHandler(handler)
    try:
        with caplog.at_level("INFO", logger="mcore_rl.reward.manager"):
            manager = RewardManager(slow_first_row, timeout_s=timeout_s, progress_every_s=0.05)
            out = manager.score(["ok", "slow", "ok"], ["s"] * 3, ["1"] * 3)
    finally:
        logging.getLogger("mcore_rl.reward.manager").removeHandler(handler)
    assert out.scores.tolist() == [1.0, 1.0, 1.0]
    assert re.search(r"reward: \d/3 rows scored in \d+ s \(reward function .*slow_first_row", caplog.text)


def test_reward_timeout_has_a_default_that_bounds_a_hung_reward():
    from mcore_rl.config import RLConfig

    assert RLConfig().reward.timeout_s == 60.0


# ------------------------------------------------------------------------ a reward that keeps memory
def test_reward_memory_growth_is_in_the_metrics_and_warned_about(caplog):
    """A reward keeping 4 MiB per call grew the driver by 0.5 GB a step with no warning. The manager reports the
    driver's RSS growth over each reward phase and warns once it has grown past memory_warn_mb since the first."""
    kept = []

    def hoards(data_source, solution_str, ground_truth, extra_info=None):
        # Fresh pages from the kernel, written so they are resident. A `bytes` of 4 MiB could come out of memory the
        # allocator already holds (freed by an earlier test in this worker, after glibc raised its mmap threshold),
        # and then the process would not grow at all: the CI worker measured [0.0, 0.0, 0.0] that way.
        block = mmap.mmap(-1, 4 * 2**20)
        block.write(b"\x01" * len(block))
        kept.append(block)
        return 0.0

    manager = RewardManager(hoards, memory_warn_mb=100)
    with caplog.at_level("WARNING", logger="mcore_rl.reward.manager"):
        deltas = []
        for _ in range(3):
            manager.score(["a"] * 16, ["s"] * 16, ["1"] * 16)
            deltas.append(manager.memory_metrics()["perf/reward_rss_delta_mb"])
    assert all(d >= 48 for d in deltas), deltas  # 64 MiB kept per phase
    assert manager.memory_metrics()["perf/reward_driver_rss_gb"] > 0
    assert caplog.text.count("the driver's memory grew by") == 1
    assert "while reward function" in caplog.text and "hoards" in caplog.text
    for block in kept:
        block.close()


def test_a_reward_that_keeps_nothing_is_not_warned_about(caplog):
    manager = RewardManager(lambda **_: 0.0, memory_warn_mb=100)
    with caplog.at_level("WARNING", logger="mcore_rl.reward.manager"):
        for _ in range(3):
            manager.score(["a"] * 16, ["s"] * 16, ["1"] * 16)
    assert "grew by" not in caplog.text
    assert abs(manager.memory_metrics()["perf/reward_rss_delta_mb"]) < 48
