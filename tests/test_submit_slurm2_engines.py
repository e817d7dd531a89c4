"""The default job on the two-node Slurm cluster of tools/slurm_local.sh (network namespaces n1 10.77.0.11 and n2
10.77.0.12) with its rollout engine on another node than the actor ranks: the actor's stream leaders (and, when the
engine is on n2, the driver's router on n1) reach the engine at its node's address (it binds the node's address on a
multi-node Ray cluster, with the run's API key), and the job reaches its summary line.

    sudo .venv/bin/pytest tests/test_submit_slurm2_engines.py

The engine asks for 4 CPUs (rollout.num_cpus=4) on nodes of 4 (--ray-num-cpus 4), and the actor's two ranks take 2
each (actor.num_cpus_per_rank=2), so each fills a node: Ray places the actor's pool on either node (which one is
Ray's choice) and the engine on the other. Skips as tests/test_submit_slurm2.py does (root, Slurm, network namespaces).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
from test_submit_slurm2 import SUBMIT, slurm2, wait_for_job  # noqa: F401 (slurm2 is the fixture)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


@pytest.mark.long
def test_default_job_with_its_engine_on_the_second_node(slurm2: None) -> None:  # noqa: F811
    run_dir = tempfile.mkdtemp(prefix="mcrl-slurm2e-", dir="/var/tmp")  # outside /tmp: each node has its own
    try:
        res = subprocess.run(
            [sys.executable, SUBMIT, "--nodes", "2", "--gpus-per-node", "0", "--ray-num-cpus", "4",
             "--partition", "debug", "--time", "10:00", "--job-name", "eng2", "--run-dir", run_dir,
             "--", "trainer.steps=2", "data.batch_size=4", "rollout.n=4", "rollout.num_cpus=4",
             "actor.num_cpus_per_rank=2", f"trainer.run_dir={run_dir}"],
            capture_output=True, text=True, cwd=REPO, timeout=120, env=dict(os.environ, RAY_WAIT_TIMEOUT="90"),
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        job_id = int(re.search(r"submitted job (\d+)", res.stdout).group(1))
        state, log = wait_for_job(job_id, run_dir, 240)
        assert state == "COMPLETED", f"job {job_id} ended {state} (cancelled if still running):\n{log[-4000:]}"
        engines = re.search(r"rollout engines at (\S+) behind sglang-router at (\S+)", log)
        assert engines, log[-4000:]
        # at a node's address, never loopback: the actor ranks on the other node push to it there
        assert re.match(r"http://10\.77\.0\.1[12]:", engines.group(1)), engines.group(0)
        assert engines.group(2).startswith("http://127.0.0.1:")  # the router beside the driver on n1
        assert re.search(r"^summary:", log, re.M) and "submit: stopping Ray (exit code 0)" in log, log[-2000:]
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            assert len(f.read().splitlines()) == 2
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
