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


# The long tier, beside the other jobs Slurm ends: the CI tier keeps launch/submit.py on a real Slurm through
# tests/test_submit_slurm2.py's two-node job (submission, the Ray head and worker on two nodes, training, the exit).
@pytest.mark.long
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


# ------------------------------------------------------------------------------------ SIGTERM as Slurm sends it
def _submit(run_dir, job_name: str, time_limit: str, *overrides: str) -> int:  # noqa: ANN001
    res = subprocess.run(
        [sys.executable, SUBMIT, "--nodes", "1", "--gpus-per-node", "0", "--ray-num-cpus", "4",
         "--partition", "debug", "--time", time_limit, "--job-name", job_name, "--run-dir", str(run_dir),
         "--", f"trainer.run_dir={run_dir}", *overrides],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return int(re.search(r"submitted job (\d+)", res.stdout).group(1))


def _wait_for_steps(run_dir, job_id: int, steps: int, deadline_s: float) -> None:  # noqa: ANN001
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + deadline_s
    while time.time() < deadline and _job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"):
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(2)
    log = run_dir / f"slurm-{job_id}.out"
    text = log.read_text()[-4000:] if log.exists() else ""
    raise AssertionError(f"job {job_id} never trained {steps} steps:\n{text}")


def _job_processes(run_dir, job_id: int) -> list[str]:  # noqa: ANN001
    """Processes of the job still alive: its driver and watchdog (their arguments name the run dir) and Ray's."""
    rows = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [r for r in rows if (str(run_dir) in r or f"/tmp/ray_j{job_id}" in r) and "ps -eo" not in r]


def _assert_ended_by_sigterm(run_dir, job_id: int) -> None:  # noqa: ANN001
    """The run's FAILED marker says SIGTERM, the driver printed its one line and no traceback, the job's script
    exited 143, and no process of the job is left."""
    failed, log = run_dir / "FAILED", run_dir / f"slurm-{job_id}.out"
    deadline = time.time() + 150  # Slurm's KillWait (30 s) and the run's clean-up, with room for a loaded machine
    while time.time() < deadline and (
        _job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") or _job_processes(run_dir, job_id)
    ):
        time.sleep(2)
    text = log.read_text()
    assert not _job_processes(run_dir, job_id), _job_processes(run_dir, job_id)
    assert failed.exists(), text[-4000:]
    assert failed.read_text().startswith("terminated (SIGTERM) after step "), failed.read_text()
    assert "Traceback" not in text, text[-4000:]
    assert "submit: stopping Ray (exit code 143)" in text, text[-4000:]
    assert not (run_dir / "summary.json").exists()


@pytest.mark.long  # a whole job ended by Slurm (2-3 minutes on 2 cores): the long tier
def test_scancel_after_the_first_step_ends_the_run_with_143_and_a_failed_marker(slurm: None, tmp_path) -> None:
    run_dir = tmp_path / "run"
    job_id = _submit(run_dir, "term", "10:00", "trainer.steps=100000")
    _wait_for_steps(run_dir, job_id, 1, 240)
    subprocess.run(["scancel", str(job_id)], check=True)
    _assert_ended_by_sigterm(run_dir, job_id)


@pytest.mark.long  # a whole job ended by Slurm (2-3 minutes on 2 cores): the long tier
def test_a_time_limit_that_expires_mid_run_ends_it_with_143_and_a_failed_marker(slurm: None, tmp_path) -> None:
    """--time 1 (Slurm's minimum, a minute): at the limit Slurm sends SIGTERM to every step of the job, then SIGKILL
    after KillWait. The job is in state TIMEOUT."""
    run_dir = tmp_path / "run"
    job_id = _submit(run_dir, "limit", "1", "trainer.steps=100000")
    _assert_ended_by_sigterm(run_dir, job_id)
    assert _job_state(job_id) in ("TIMEOUT", "UNKNOWN")  # UNKNOWN: slurmctld forgot the job (MinJobAge)
