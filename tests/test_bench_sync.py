"""Smoke test of tools/bench_sync.py: a --quick run syncs a tiny DeepSeek-V3 from 4 gloo ranks (TP2 x EP2 and
PP2 x EP2) into the embedded engine through every transport, verifies the engine's weights, and ends with the
documented summary line carrying positive figures. Its `--vllm` section (the push into a real vLLM engine) is tested
in tests/test_vllm_engine.py, on that module's engine.

Run: `.venv/bin/pytest tests/test_bench_sync.py` (marked slow: it spawns Megatron ranks and an HTTP server)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"[0-9][0-9.e+-]*"
LAST_LINE = re.compile(
    rf"sync: mode=(?P<mode>full|shard_aware) transport=(?P<transport>distributed|tensor|disk) gb=(?P<gb>{NUMBER}) "
    rf"seconds=(?P<seconds>{NUMBER}) vs_raw=(?P<vs_raw>{NUMBER}) vs_v1=(?P<vs_v1>{NUMBER}) "
    rf"peak_extra_mb=(?P<peak>{NUMBER}) bucket_mb=(?P<bucket>{NUMBER}) largest_mb=(?P<largest>{NUMBER})"
)


# The long tier: the CI tier's tests/test_sync_pipeline.py shows every tensor of the tiny DeepSeek and Qwen3-MoE
# arriving bit-exact under each layout and the engine's logits equal Megatron's after a sync through each transport;
# this runs the benchmark tool's own quick mode over the same ground (four ranks, about a minute alone).
@pytest.mark.long
@pytest.mark.slow
def test_quick_run_verifies_every_sync_and_reports_positive_figures() -> None:
    """`--quick` exits 0 (every sync verified); every sync row and v1 say OK; the last line has the documented format
    and positive figures; the peak stays within the executor's bound (counted, not timed: no timing is asserted,
    the machine is shared)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_sync.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    match = LAST_LINE.fullmatch(lines[-1])
    assert match is not None, f"unexpected last line: {lines[-1]!r}"
    figures = {k: float(v) for k, v in match.groupdict().items() if k not in ("mode", "transport")}
    assert all(v > 0 for v in figures.values()), figures
    assert figures["peak"] <= 2 * figures["bucket"] + figures["largest"], figures
    rows = [line for line in lines if re.match(r"(distributed|tensor|disk) +(full|shard_aware) ", line)]
    assert len(rows) == 2 * 4, rows  # two layouts x (distributed full, shard_aware, tensor, disk)
    assert all(" OK (" in row for row in rows), rows
    v1 = [line for line in lines if line.startswith("v1 ")]
    assert len(v1) == 2 and all(line.endswith("== export: OK") for line in v1), v1
    assert "verification OK" in lines[-2], lines[-2]


# The long tier: the connect order itself is the CI tier's tests/test_connect_order.py (SGLang's own request queue);
# this checks the benchmark's timing mode of it, which the quick run above does not exercise.
@pytest.mark.long
@pytest.mark.slow
def test_connect_mode_times_weight_sync_connect() -> None:
    """`--connect 2x2 --layouts ''` times the project's WeightSync.connect into two SGLang-code engines and ends with
    the documented line (a positive time; no timing is asserted)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_sync.py"), "--connect", "2x2", "--layouts", "", "--repeats", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    match = re.fullmatch(rf"connect: streams=2 engines=2 seconds=({NUMBER})", done.stdout.strip().splitlines()[-1])
    assert match is not None and float(match.group(1)) > 0, done.stdout[-2000:]
