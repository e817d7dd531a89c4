"""tools/diff_metrics.py on small hand-written metrics.jsonl files (no training): its exit codes and what it names.

Run: `.venv/bin/pytest tests/test_diff_metrics.py` (fast tier: the tool runs as a subprocess, as its users run it)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ROWS = [
    {
        "step": 1,
        "critic/score/mean": 0.25,
        "actor/pg_loss": -0.01,
        "timing_s/step": 0.31,
        "perf/total_num_tokens": 90.0,
    },
    {"step": 2, "critic/score/mean": 0.5, "actor/pg_loss": -0.02, "timing_s/step": 0.29, "perf/total_num_tokens": 92.0},
]


def write_run(run_dir: Path, rows: list[dict]) -> Path:
    """A run dir holding metrics.jsonl with these rows, one JSON object a line, as the jsonl logger writes it."""
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run_dir


def diff(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "diff_metrics.py"), str(a), str(b)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_identical_runs_exit_0(tmp_path: Path) -> None:
    """The same rows (one run given as its dir, the other as its file) -> exit 0, both steps and 3 keys compared."""
    a = write_run(tmp_path / "a", ROWS)
    b = write_run(tmp_path / "b", ROWS)
    done = diff(a, b / "metrics.jsonl")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "steps compared: 2; keys compared: 3;" in done.stdout
    assert done.stdout.rstrip().endswith("identical (ignored keys aside)")


def test_changed_value_exits_1_naming_step_key_and_values(tmp_path: Path) -> None:
    """One value changed at step 2 -> exit 1 and a row with that step, key, both values and their abs diff."""
    changed = [dict(ROWS[0]), dict(ROWS[1], **{"actor/pg_loss": -0.0205})]
    done = diff(write_run(tmp_path / "a", ROWS), write_run(tmp_path / "b", changed))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2\tactor/pg_loss\t-0.02\t-0.0205\t0.0005" in done.stdout.splitlines()
    assert "critic/score/mean\t" not in done.stdout  # unchanged keys are not listed


def test_differing_timing_key_is_ignored(tmp_path: Path) -> None:
    """Only timing_s/step differs (and a perf/ memory key exists in one run only) -> exit 0, both listed as ignored."""
    slower = [dict(row, **{"timing_s/step": row["timing_s/step"] * 3, "perf/cpu_memory_used_gb": 2.1}) for row in ROWS]
    done = diff(write_run(tmp_path / "a", ROWS), write_run(tmp_path / "b", slower))
    assert done.returncode == 0, done.stdout + done.stderr
    ignored = next(line for line in done.stdout.splitlines() if line.startswith("steps compared:"))
    assert "perf/cpu_memory_used_gb" in ignored and "timing_s/step" in ignored
    assert "ignored keys only in b (1): perf/cpu_memory_used_gb" in done.stdout.splitlines()


def test_key_in_one_run_only_exits_1(tmp_path: Path) -> None:
    """A compared key written by one run only -> exit 1, the key named under 'keys only in b'."""
    more = [dict(row, **{"actor/entropy": 4.1}) for row in ROWS]
    done = diff(write_run(tmp_path / "a", ROWS), write_run(tmp_path / "b", more))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "keys only in b (1): actor/entropy" in done.stdout


def test_missing_file_exits_2(tmp_path: Path) -> None:
    """A run dir without metrics.jsonl -> exit 2, the path named on stderr, nothing on stdout."""
    (tmp_path / "empty").mkdir()
    done = diff(write_run(tmp_path / "a", ROWS), tmp_path / "empty")
    assert done.returncode == 2, done.stdout + done.stderr
    assert str(tmp_path / "empty" / "metrics.jsonl") in done.stderr and done.stdout == ""


def test_not_jsonl_exits_2(tmp_path: Path) -> None:
    """A line that is not JSON -> exit 2 naming the file and line."""
    a = write_run(tmp_path / "a", ROWS)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\nstep=2 critic/score/mean=0.5\n")
    done = diff(a, bad)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{bad}:2: not JSON" in done.stderr
