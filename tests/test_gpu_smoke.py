"""The GPU check kit's CPU parts (`python -m tools.gpu_smoke --dry-cpu`): every step runs or says why it skipped, and
the results are written as JSON and a markdown table, step by step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ALL_STEPS = ["env", "gpu_tests", "kernels", "actor_qwen3_moe", "actor_dsv3", "sglang_ipc", "sglang_nccl"]


def _dry(out: Path, *only: str) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, "-m", "tools.gpu_smoke", "--dry-cpu", "--out", str(out)]
    res = subprocess.run(cmd + (["--only", *only] if only else []), cwd=REPO, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    return res, json.loads((out / "results.json").read_text())


def test_dry_run_kernels_are_bit_exact_and_reported(tmp_path) -> None:
    res, results = _dry(tmp_path, "env", "kernels")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    kernels = results["steps"]["kernels"]
    assert kernels["status"] == "ok"
    assert all(kernels[k]["bit_exact"] for k in ("block_copy", "block_copy_fp8", "fp8_quantize", "fp8_dequantize"))
    assert "| kernels | ok |" in (tmp_path / "results.md").read_text()


@pytest.mark.long
@pytest.mark.slow  # the nccl step starts two gloo ranks (ours and SGLang's)
def test_dry_run_of_every_step(tmp_path) -> None:
    res, results = _dry(tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert list(results["steps"]) == ALL_STEPS
    for name, step in results["steps"].items():
        assert step["status"] in ("ok", "skipped"), (name, step)
    for family in ("actor_qwen3_moe", "actor_dsv3"):
        step = results["steps"][family]
        assert step["logprobs_on_host"] and step["offload"]["logprobs_equal_after_onload"]
        assert step["updates"]["update_ok"] == 1.0
        # the memory step: the estimate's static terms against the rank's exact storages (tools/gpu_smoke/memory_check)
        terms = step["memory"]["terms"]
        assert all(0.8 <= terms[t]["ratio"] <= 1.25 for t in ("weights", "grads", "optimizer", "reference")), terms


def test_a_step_cut_off_by_its_timeout_keeps_what_it_wrote(tmp_path, monkeypatch) -> None:
    """Each step writes as it goes: a step killed at its timeout is reported as such, with its figures so far."""
    sys.path.insert(0, str(REPO))
    from tools.gpu_smoke import run

    monkeypatch.setattr(run, "STEPS", (("env", 0.001, 0.001),))
    (tmp_path / "env.json").write_text(json.dumps({"status": "running", "python": "3.x"}))
    assert run.main(["--dry-cpu", "--out", str(tmp_path), "--wheels", str(tmp_path / "none")]) == 1
    step = json.loads((tmp_path / "results.json").read_text())["steps"]["env"]
    assert step["status"] == "timeout" and step["python"] == "3.x" and "cut off" in step["reason"]
