"""`python -m mcore_rl.train`: one setting named twice, values of the wrong type, and verl's plain-string lists.

- A verl key and our key for one setting (rollout.n and actor_rollout_ref.rollout.n) used to let one silently win:
  refused (exit 2, naming both keys) unless the values agree.
- A verl value of the wrong type was reported as an unrelated missing key (total_epochs); a negative
  data.train_batch_size as a divisor problem of ppo_mini_batch_size. Each is named with its value and what was expected.
- data.train_files=/path.parquet, as verl users write it, was refused by Hydra for our own keys.

Every case runs the real CLI, refused before Ray starts.

    .venv/bin/python -m pytest -q tests/test_config_conflicts.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
AR = "actor_rollout_ref"


def train(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", *overrides],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env,
    )  # fmt: skip


def errors(res: subprocess.CompletedProcess) -> list[str]:
    """The config errors of a refused command, in order (exit 2, no traceback, nothing started)."""
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr and "Started a local Ray instance" not in res.stdout + res.stderr
    return [line for line in res.stderr.splitlines() if line.startswith("config error:")]


def _verl(model_dir: str, *extra: str) -> list[str]:
    """A verl command that composes (as tests/test_verl_config.py's), then `extra`."""
    return [f"{AR}.model.path={model_dir}", "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2",
            f"{AR}.rollout.tensor_model_parallel_size=1", "data.train_batch_size=8",
            f"{AR}.actor.ppo_mini_batch_size=4", *extra]  # fmt: skip


@pytest.mark.parametrize(
    "ours, verl, setting",
    [
        ("rollout.n=4", f"{AR}.rollout.n=8", "rollout.n"),
        ("data.batch_size=16", "data.train_batch_size=8", "data.batch_size"),
        ("rollout.temperature=0.7", f"{AR}.rollout.temperature=1.0", "rollout.temperature"),
    ],
)
def test_a_verl_key_and_our_key_with_two_values_are_refused(model_dir: str, ours: str, verl: str, setting: str) -> None:
    for order in ((ours, verl), (verl, ours)):
        found = errors(train(*_verl(model_dir, *order), "--print-config"))
        conflict = [line for line in found if ours in line and verl.split("=")[0] in line]
        assert len(conflict) == 1, found
        assert f"({setting})" in conflict[0] and f"{verl.split('=')[0]}={verl.split('=')[1]}" in conflict[0]
        assert "expected one of the two keys, or the same value in both" in conflict[0]


def test_a_verl_key_and_our_key_that_agree_are_one_setting(model_dir: str) -> None:
    res = train(*_verl(model_dir, "rollout.n=4", f"{AR}.rollout.n=4", "data.batch_size=8"), "--print-config")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "  'n': 4\n" in res.stdout and "  batch_size: 8\n" in res.stdout


def test_a_verl_value_of_the_wrong_type_is_named_first(tmp_path) -> None:
    found = errors(train(f"{AR}.rollout.n=abc", f"trainer.run_dir={tmp_path}"))
    assert f"{AR}.rollout.n='abc' (our rollout.n) is invalid: expected an integer" in found[0], found


def test_a_negative_train_batch_size_is_named_as_such(tmp_path) -> None:
    found = errors(train("data.train_batch_size=-1", "trainer.total_training_steps=2", f"trainer.run_dir={tmp_path}"))
    assert any("data.train_batch_size=-1 (our data.batch_size) is invalid: expected a positive integer" in line
               for line in found), found  # fmt: skip
    assert not any("divisor" in line for line in found), found


def _parquet(path: Path) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from _verl_scripts import write_parquet

    write_parquet(str(path), "openai/gsm8k", rows=20)


@pytest.mark.parametrize("key", ["data.train_files", "data.val_files"])
def test_a_plain_string_is_a_one_file_list_for_our_keys(key: str, tmp_path) -> None:
    data = tmp_path / "train.parquet"
    _parquet(data)
    res = train(f"{key}={data}", "--print-config")
    assert res.returncode == 0, res.stderr[-3000:]
    field = key.split(".")[1]
    assert f"  {field}:\n  - {data}\n" in res.stdout, res.stdout


def test_our_list_of_strings_key_takes_a_plain_string_in_a_verl_command(model_dir: str) -> None:
    res = train(*_verl(model_dir, "trainer.loggers=console"), "--print-config")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "  loggers:\n  - console\n" in res.stdout, res.stdout


def test_the_embedded_server_names_a_fractional_top_k() -> None:
    from mcore_rl.rollout.protocol import BadRequest, parse_sampling_params

    with pytest.raises(BadRequest) as err:
        parse_sampling_params({"top_k": 2.5}, vocab_size=64)
    assert str(err.value) == "sampling_params.top_k=2.5 is invalid: expected -1 (off) or an integer >= 1"


@pytest.mark.parametrize("key", ["rollout.n", "rollout.val_n"])
def test_more_samples_than_the_embedded_engine_runs_at_once_are_refused_before_ray(key: str, tmp_path) -> None:
    """The embedded server refuses a request whose n exceeds its --max-running-requests (rollout.max_running_requests):
    such a run used to start Ray and the engines, then fail at its first /generate with a traceback."""
    found = errors(train(f"{key}=300", f"trainer.run_dir={tmp_path}", "--print-config"))
    assert any(f"{key}=300 is invalid" in line and "rollout.max_running_requests=256" in line for line in found), found
    res = train(f"{key}=300", "rollout.max_running_requests=300", "--print-config")  # the key that raises the limit
    assert res.returncode == 0, res.stderr[-3000:]
