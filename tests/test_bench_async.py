"""tools/bench_async.py --quick: one k > 0 in both modes (the latency model and the CPU engine) gives a table with
every row it planned, each with positive steps/s, and the k=2 line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# The long tier (four training runs, about 2 minutes): the pieces it times are the CI tier's own tests, the latency
# model (tests/test_latency_model.py) and generation ahead of training (tests/test_async_rollout.py)
@pytest.mark.long
@pytest.mark.slow
def test_quick_bench_has_every_row_with_positive_steps_per_s() -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "tools/bench_async.py", "--quick", "--ks", "1", "--modes", "latency,cpu"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    header, body = [c.strip() for c in rows[0]], [[c.strip() for c in row] for row in rows[1:]]
    assert header[:4] == ["mode", "k", "partial", "steps/s"], header
    assert sorted((r[0], r[1], r[2]) for r in body) == [
        ("cpu", "1", "false"), ("cpu", "1", "true"), ("latency", "1", "false"), ("latency", "1", "true"),
    ]  # fmt: skip
    assert all(float(r[3]) > 0 for r in body), body
    assert done.stdout.splitlines()[-1].startswith("k2_latency_ratio=")
