"""Smoke test of tools/bench_rollout.py: a --quick run finishes and its last line carries positive figures.

Run: `.venv/bin/pytest tests/test_bench_rollout.py` (marked slow: it starts the HTTP server and builds two models)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAST_LINE = re.compile(
    r"rollout: requests=(?P<requests>\d+) tokens=(?P<tokens>\d+) server_tok_s=(?P<server>[\d.]+) "
    r"hf_tok_s=(?P<hf>[\d.]+) ratio=(?P<ratio>[\d.]+) prefill_saved=(?P<saved>[\d.]+)"
)


# The long tier, with the other benchmarks' own runs: the engine's generation, prefix reuse and sampling are the CI
# tier's tests/test_rollout_*.py and test_engine_*.py; this runs the benchmark tool's quick mode (about 12 s in CI).
@pytest.mark.long
@pytest.mark.slow
def test_quick_run_reports_positive_figures() -> None:
    """`--quick` exits 0; the last line has the documented format, every figure is positive, and the prefix reuse
    scenario saved a fraction in (0, 1) (no timing is asserted: the machine is shared)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_rollout.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    last = done.stdout.strip().splitlines()[-1]
    match = LAST_LINE.fullmatch(last)
    assert match is not None, f"unexpected last line: {last!r}"
    figures = {k: float(v) for k, v in match.groupdict().items()}
    assert all(v > 0 for v in figures.values()), figures
    assert 0 < figures["saved"] < 1
