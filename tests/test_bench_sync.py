"""Smoke test of tools/bench_sync.py: a --quick run syncs a tiny DeepSeek-V3 from 4 gloo ranks (TP2 x EP2 and
PP2 x EP2) into the embedded engine through every transport, verifies the engine's weights, and ends with the
documented summary line carrying positive figures. With vLLM (`make vllm-setup`; marked vllm): `--vllm` pushes into a
real vLLM engine and reports it beside the raw broadcast.

Run: `.venv/bin/pytest tests/test_bench_sync.py` (marked slow: it spawns Megatron ranks and an HTTP server)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_vllm_engine import vllm_venv  # noqa: F401 (the session fixture: make vllm-setup once, or skip)

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"[0-9][0-9.e+-]*"
LAST_LINE = re.compile(
    rf"sync: mode=(?P<mode>full|shard_aware) transport=(?P<transport>distributed|tensor|disk) gb=(?P<gb>{NUMBER}) "
    rf"seconds=(?P<seconds>{NUMBER}) vs_raw=(?P<vs_raw>{NUMBER}) vs_v1=(?P<vs_v1>{NUMBER}) "
    rf"peak_extra_mb=(?P<peak>{NUMBER}) bucket_mb=(?P<bucket>{NUMBER}) largest_mb=(?P<largest>{NUMBER})"
)


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


VLLM_LINE = re.compile(
    rf"vllm: gb=(?P<gb>{NUMBER}) seconds=(?P<seconds>{NUMBER}) raw_seconds=(?P<raw>{NUMBER}) "
    rf"vs_raw=(?P<vs_raw>{NUMBER}) bucket_mb=(?P<bucket>{NUMBER})"
)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_push_is_measured_beside_the_raw_broadcast(vllm_venv) -> None:  # noqa: F811
    """`--vllm --layouts '' --quick`: a real vLLM engine takes every push (each commits its version; its logprobs
    then match the pushed weights) and the figures line carries the push and the raw broadcast of the same bytes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_sync.py"), "--vllm", "--layouts", "", "--quick", "--repeats", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    match = VLLM_LINE.fullmatch(lines[-1])
    assert match is not None, f"unexpected last line: {lines[-1]!r}"
    assert all(float(v) > 0 for v in match.groupdict().values()), match.groupdict()
    assert any(line.startswith("vllm push ") and line.endswith(": OK") for line in lines), lines[-4:]
