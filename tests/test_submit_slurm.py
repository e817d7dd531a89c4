"""launch/submit.py on a real Slurm: a one-node cluster on this machine (tools/slurm_local.sh), the tiny CPU job,
trained for a few steps and then cancelled.

    sudo tools/slurm_local.sh && .venv/bin/pytest tests/test_submit_slurm.py

Skips, saying why, when slurmctld is not installed or the local cluster cannot be started (not root, no munge).
One node here; tests/test_submit_slurm2.py runs the same job on two nodes in network namespaces.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBMIT = os.path.join(REPO, "launch", "submit.py")
SLURM_LOCAL = os.path.join(REPO, "tools", "slurm_local.sh")

pytestmark = pytest.mark.slow


def _cluster_up() -> bool:
    # Checked only after the fixture has installed Slurm, but a machine without sinfo is simply "not up".
    if not shutil.which("sinfo"):
        return False
    res = subprocess.run(["sinfo", "-h", "-o", "%P %t"], capture_output=True, text=True)
    return res.returncode == 0 and bool(re.search(r"^debug\*? (idle|mix|alloc)", res.stdout, re.M))


@pytest.fixture(scope="module")
def slurm():
    """A running one-node Slurm with partition `debug`: the machine's own, or one started with tools/slurm_local.sh
    and stopped again afterwards (`slurm_local.sh stop`), so the test session leaves no daemon behind."""
    # tools/slurm_local.sh installs Debian's slurm-wlm and munge when they are missing, then starts the daemons. No
    # Slurm command runs before it: on a fresh machine sinfo/scontrol do not exist until the script has installed them.
    installed = all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sinfo", "munged"))
    if not installed and (os.geteuid() != 0 or not shutil.which("apt-get")):
        pytest.skip("Slurm (slurm-wlm, munge) is not installed and installing it needs root and apt-get")
    if not _cluster_up():
        if os.geteuid() != 0:
            pytest.skip("no local Slurm is running and starting one (tools/slurm_local.sh) needs root")
        res = subprocess.run(["bash", SLURM_LOCAL], capture_output=True, text=True, timeout=900)
        try:
            if res.returncode != 0 or not _cluster_up():
                pytest.skip(f"tools/slurm_local.sh could not start a local Slurm: {res.stderr[-500:]}")
            yield
        finally:
            subprocess.run(["bash", SLURM_LOCAL, "stop"], capture_output=True, timeout=120)
    else:
        yield


def _job_state(job_id: int) -> str:
    out = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True).stdout
    match = re.search(r"JobState=(\w+)", out)
    return match.group(1) if match else "UNKNOWN"


def test_scancel_stops_ray(slurm: None, tmp_path) -> None:
    run_dir = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, SUBMIT, "--nodes", "1", "--gpus-per-node", "0", "--ray-num-cpus", "4",
         "--partition", "debug", "--time", "10:00", "--job-name", "cancel", "--run-dir", str(run_dir),
         "--", "trainer.steps=100000", f"trainer.run_dir={run_dir}"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    job_id = int(re.search(r"submitted job (\d+)", res.stdout).group(1))
    # The job trains through Slurm and Ray (two steps in its metrics) before it is cancelled; a run that completes
    # is tests/test_submit_slurm2.py's two-node job.
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and _job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"):
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(2)
    log_path = run_dir / f"slurm-{job_id}.out"
    log = log_path.read_text() if log_path.exists() else "(no log)"
    assert metrics.exists() and len(metrics.read_text().splitlines()) >= 2, (
        f"job {job_id} never trained:\n{log[-4000:]}"
    )
    assert "critic/score/mean" in json.loads(metrics.read_text().splitlines()[0])
    nodes = json.loads((run_dir / "ray_nodes.json").read_text())
    assert len(nodes) == 1 and nodes[0]["resources"]["CPU"] == 4.0  # Ray saw the node
    assert "submit: Ray has 1 nodes" in log and f"ports {10000 + 220 * (job_id % 100)}.." in log  # per-job ports
    subprocess.run(["scancel", str(job_id)], check=True)
    deadline = time.time() + 120
    while _job_state(job_id) not in ("CANCELLED", "COMPLETED", "FAILED", "UNKNOWN") and time.time() < deadline:
        time.sleep(2)
    # The job shows COMPLETING until its processes are gone, then CANCELLED; the TERM trap's line is in the log by then.
    trap_line = "submit: stopping Ray (exit code 143)"
    deadline = time.time() + 60
    while trap_line not in log_path.read_text() and time.time() < deadline:
        time.sleep(1)
    assert trap_line in log_path.read_text()  # the TERM trap ran the cleanup
    # The script sets RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0: without it `ray start --block` would drain for up to
    # 30 s after SIGTERM (a job cancelled early in its run took 34 s to end, against 6 s with it)
    deadline = time.time() + 60
    while f"/tmp/ray_j{job_id}" in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout:
        assert time.time() < deadline, f"Ray processes of job {job_id} still running after scancel"
        time.sleep(2)
