"""The run's API key for its engines and router: MCORE_RL_API_KEY sets it (to call them while a run is live), else a
fresh one per run; a key of the wrong form is refused before anything starts. That the key reaches no file of the run
is checked end to end in tests/test_train_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_the_run_api_key_comes_from_mcore_rl_api_key_or_is_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_rl.rollout.client import api_key_problem, run_api_key

    monkeypatch.delenv("MCORE_RL_API_KEY", raising=False)
    first, second = run_api_key(), run_api_key()
    assert first != second and api_key_problem(first) is None
    monkeypatch.setenv("MCORE_RL_API_KEY", "a-key-of-my-own-0123")
    assert run_api_key() == "a-key-of-my-own-0123"
    assert "expected 16 to 256" in api_key_problem("short")
    assert "visible ASCII" in api_key_problem("a key with spaces in it")


def test_a_bad_mcore_rl_api_key_is_refused_before_anything_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", f"trainer.run_dir={tmp_path}/run"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, RAY_ADDRESS="", MCORE_RL_API_KEY="short"),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "MCORE_RL_API_KEY" in done.stderr and "expected 16 to 256" in done.stderr and "Traceback" not in done.stderr
