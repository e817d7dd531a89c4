"""Runs that fail must not end as successes: every ending of `lifecycle.run_guarded` but a finished
run leaves <run_dir>/FAILED and a non-zero exit code, and nothing half-written.

The fast cases run the real `run_guarded` in a child process around a small job function (the endings under test are
the lifecycle's, not the RL loop's); the slow ones start the real CLI as a user would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def guarded(
    run_dir: Path,
    body: str,
    timeout: float = 120,
    wait_for: Path | None = None,
    sig: int | None = None,
    prefix: tuple[str, ...] = (),
):
    """`run_guarded` in a child process with `def job(cfg): <body>` as the run; optionally send `sig` once `wait_for`
    exists. Returns the finished process."""
    run_dir.mkdir(parents=True, exist_ok=True)  # as pre-flight makes it before the run starts
    code = (
        textwrap.dedent(
            """
        import json, os, sys, time
        from mcore_rl.config import RLConfig
        from mcore_rl.lifecycle import run_guarded
        from mcore_rl.metrics.logger import MetricsLogger

        cfg = RLConfig()
        cfg.trainer.run_dir = sys.argv[1]
        cfg.trainer.steps = 5

        def job(cfg):
        """
        )
        + textwrap.indent(textwrap.dedent(body), " " * 4)
        + "\nrun_guarded(cfg, job)\n"
    )
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    if sig is not None:
        deadline = time.time() + timeout
        while not wait_for.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        proc.send_signal(sig)
    proc.out, proc.err = proc.communicate(timeout=timeout)
    return proc


# ------------------------------------------------------------------------------------------------ SIGTERM
def test_sigterm_leaves_a_failed_marker_and_exit_143(tmp_path) -> None:
    """Slurm's scancel and time limit send SIGTERM: the run dir must say the run did not finish."""
    run_dir = tmp_path / "run"
    proc = guarded(run_dir, """
        log = MetricsLogger(os.path.join(cfg.trainer.run_dir, "metrics.jsonl"), loggers=["jsonl"])
        log.write(1, {"critic/score/mean": 0.5})
        open(os.path.join(cfg.trainer.run_dir, "ready"), "w").close()
        try:
            time.sleep(60)
        finally:  # the run's clean-up still runs (engines, ranks)
            open(os.path.join(cfg.trainer.run_dir, "cleaned"), "w").close()
    """, wait_for=run_dir / "ready", sig=signal.SIGTERM)  # fmt: skip
    assert proc.returncode == 143, proc.err[-3000:]
    assert "Traceback" not in proc.err and "terminated (SIGTERM) after step 1 of 5" in proc.err
    assert (run_dir / "FAILED").read_text().startswith("terminated (SIGTERM) after step 1 of 5")
    assert (run_dir / "cleaned").exists() and not (run_dir / "summary.json").exists()


# ------------------------------------------------------------------------------------------------ sys.exit inside
def test_sys_exit_0_inside_the_run_is_not_a_success(tmp_path) -> None:
    proc = guarded(tmp_path / "run", "sys.exit(0)")
    assert proc.returncode == 1, proc.err[-3000:]
    assert "the run stopped before finishing" in proc.err and "SystemExit" in proc.err
    assert (tmp_path / "run" / "FAILED").exists() and not (tmp_path / "run" / "summary.json").exists()


# ------------------------------------------------------------------------------------------------ NaN
def test_non_finite_loss_stops_the_run_with_exit_1_naming_step_and_metric(tmp_path) -> None:
    proc = guarded(tmp_path / "run", """
        log = MetricsLogger(os.path.join(cfg.trainer.run_dir, "metrics.jsonl"), loggers=["jsonl"])
        log.write(1, {"actor/pg_loss": 0.1, "actor/grad_norm": 2.0})
        log.write(2, {"actor/pg_loss": float("nan"), "actor/grad_norm": float("inf")})
        return {"steps": 2}
    """)  # fmt: skip
    assert proc.returncode == 1, proc.err[-3000:]
    assert "Traceback" not in proc.err
    assert "training diverged at step 2: actor/pg_loss=nan, actor/grad_norm=inf" in proc.err
    assert "trainer.max_nonfinite_steps=0" in proc.err
    assert (tmp_path / "run" / "FAILED").read_text().startswith("error: training diverged at step 2")
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # the bad step is on record


def test_max_nonfinite_steps_tolerates_that_many_in_a_row(tmp_path) -> None:
    from mcore_rl.lifecycle import TrainingDiverged
    from mcore_rl.metrics.logger import MetricsLogger

    nan = float("nan")
    log = MetricsLogger(str(tmp_path / "m.jsonl"), loggers=["jsonl"], max_nonfinite_steps=1)
    log.write(1, {"actor/pg_loss": nan})
    log.write(2, {"actor/pg_loss": 0.3})  # a finite step resets the count
    log.write(3, {"critic/vf_loss": float("-inf")})
    log.write(4, {"actor/grad_norm": nan, "actor/pg_loss": 0.1})  # NaN grad norm: none computed (clip_grad=0)
    log.write(5, {"actor/kl_loss": nan})
    with pytest.raises(TrainingDiverged, match="at step 6: actor/pg_loss=inf .*on 2 step"):
        log.write(6, {"actor/pg_loss": float("inf")})


# ------------------------------------------------------------------------------------------------ full disk
@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (root only): writes past it fail with ENOSPC as on a full disk."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:  # fmt: skip
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_full_disk_while_writing_metrics(small_disk) -> None:
    """No traceback, exit 2 naming the file, no FAILED.tmp.<pid>, no cut metrics line, the run dir marked FAILED."""
    run_dir = small_disk / "run"
    proc = guarded(run_dir, """
        log = MetricsLogger(os.path.join(cfg.trainer.run_dir, "metrics.jsonl"), loggers=["jsonl"])
        log.write(1, {"critic/score/mean": 0.5})
        with open(os.path.join(cfg.trainer.run_dir, "filler"), "wb", buffering=0) as f:  # fill to the last byte
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError:
                pass
        log.write(2, {"critic/score/mean": 0.5, "big": "y" * 20000})  # part of it fits in the file's last page
        return {"steps": 2}
    """)  # fmt: skip
    assert proc.returncode == 2, proc.err[-3000:]
    assert "Traceback" not in proc.err
    assert f"No space left on device writing {run_dir}/metrics.jsonl" in proc.err
    names = sorted(p.name for p in run_dir.iterdir())
    assert "FAILED" in names and not [n for n in names if ".tmp." in n], names
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]


def test_failed_marker_on_a_full_disk_is_an_empty_file_and_no_temporary(small_disk) -> None:
    from mcore_rl.lifecycle import _mark_failed

    with open(small_disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass
    _mark_failed(str(small_disk), "error: something")
    assert (small_disk / "FAILED").exists() and not list(small_disk.glob("*.tmp.*"))


# ------------------------------------------------------------------------------------------------ real runs
def train(*overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mcore_rl.train", "data.batch_size=2", "rollout.n=2",
                           "actor.mini_batches=1", *overrides], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)  # fmt: skip


@pytest.mark.long
@pytest.mark.slow
def test_lr_inf_stops_with_exit_1_naming_the_step(tmp_path) -> None:
    res = train("trainer.steps=4", "actor.optim.lr=inf", f"trainer.run_dir={tmp_path}")
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "training diverged at step" in res.stderr
    assert (tmp_path / "FAILED").exists() and not (tmp_path / "summary.json").exists()


@pytest.mark.long
@pytest.mark.slow
def test_reward_calling_sys_exit_is_the_rewards_failure(tmp_path) -> None:
    reward = tmp_path / "r.py"
    reward.write_text("import sys\ndef score(**kwargs):\n    sys.exit(0)\n")
    res = train("trainer.steps=2", f"reward.path={reward}", "reward.name=score", f"trainer.run_dir={tmp_path}/run")
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "called sys.exit(0)" in res.stderr and "score" in res.stderr
    assert (tmp_path / "run" / "FAILED").exists() and not (tmp_path / "run" / "summary.json").exists()


# ------------------------------------------------------------------------------------------------ rewards ending badly
_SCORE_WITH = """
from mcore_rl.reward.manager import RewardManager
def reward(**kwargs):
{reward}
manager = RewardManager(reward, num_threads={threads})
manager.score(["a", "b"], ["src/a", "src/a"], ["1", "1"])
return {{"steps": 1}}
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_reward_raising_a_base_exception_subclass_is_exit_2_with_one_line(tmp_path, threads) -> None:
    """A reward raising `class Stop(BaseException)` ended with exit 1 and a traceback; a failing reward is exit 2."""
    reward = "    class Stop(BaseException):\n        pass\n    raise Stop('no more')"
    proc = guarded(tmp_path / "run", _SCORE_WITH.format(reward=reward, threads=threads))
    assert proc.returncode == 2, proc.err[-3000:]
    assert "Traceback" not in proc.err
    (line,) = proc.err.strip().splitlines()
    assert "raised on row 0 (data_source='src/a'): Stop: no more" in line
    assert (tmp_path / "run" / "FAILED").exists() and not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("call", ["os._exit(0)", "posix._exit(0)"])
def test_reward_calling_os_exit_0_is_not_a_success(tmp_path, threads, call) -> None:
    """os._exit(0) in a reward ended the run with exit 0, no summary.json and no FAILED: it looked like success."""
    reward = f"    import os, posix\n    {call}"
    proc = guarded(tmp_path / "run", _SCORE_WITH.format(reward=reward, threads=threads))
    assert proc.returncode == 2, proc.err[-3000:]
    assert "Traceback" not in proc.err and f"called {call}" in proc.err and "on row 0" in proc.err
    assert (tmp_path / "run" / "FAILED").exists() and not (tmp_path / "run" / "summary.json").exists()


def test_a_driver_that_ends_without_summary_or_marker_is_marked_failed_by_the_watchdog(tmp_path) -> None:
    """An ending nothing in the driver sees (a C library's exit, kill -9) leaves no summary.json: the watchdog, which
    outlives the driver, writes FAILED so the run dir does not look like a run in progress or a finished one."""
    proc = guarded(tmp_path / "run", "import ctypes\nctypes.CDLL(None)._exit(0)")
    assert proc.returncode == 0  # nothing in a process can change the exit code of an _exit(0)
    failed = tmp_path / "run" / "FAILED"
    deadline = time.time() + 60  # the watchdog notices the driver's end within its poll interval (0.5 s)
    while not failed.exists() and time.time() < deadline:
        time.sleep(0.1)
    assert "exited without finishing" in failed.read_text() and not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.long
@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_is_exit_143_and_failed(tmp_path) -> None:
    """What `timeout`, scancel and a Slurm time limit do: SIGTERM to every process of the run's group, Ray's included.
    The driver aborted inside Ray's absl signal handler (exit 134, no FAILED); it must end as after a SIGTERM to it
    alone, and nothing of the group may outlive it."""
    import psutil

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.train", "data.batch_size=2", "rollout.n=2", "actor.mini_batches=1",
         "trainer.steps=50", f"trainer.run_dir={run_dir}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 480
    while proc.poll() is None and time.time() < deadline:  # the run has trained two steps: Ray and engines are up
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "terminated (SIGTERM) after step" in err
    assert (run_dir / "FAILED").read_text().startswith("terminated (SIGTERM) after step")
    deadline = time.time() + 60  # the watchdog ends what the signal left, within its grace period
    left = [p for p in psutil.process_iter() if _pgid(p.pid) == proc.pid]
    while left and time.time() < deadline:
        time.sleep(0.5)
        left = [p for p in left if _alive(p)]
    assert not left, [p.pid for p in left]


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize(
    "target, needle, message",
    [
        ("rank", "MegatronActor", r"error: actor rank [01] \(pid \d+\) died"),
        ("router", "sglang::router", None),
    ],
)  # fmt: skip
def test_a_killed_rank_ends_the_run_naming_it_and_a_killed_router_is_started_again(
    tmp_path, target, needle, message
) -> None:
    """kill -9 of an actor rank ended the run with a raw Ray traceback: now exit 1, FAILED, and one line saying what
    died. kill -9 of the router ended the run too: now the pool starts it again at its address with the live engines
    and the run completes every step."""
    import re

    import psutil

    run_dir = tmp_path / "run"
    steps = 50 if target == "rank" else 6
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.train", "data.batch_size=2", "rollout.n=2", "actor.mini_batches=1",
         f"trainer.steps={steps}", f"trainer.run_dir={run_dir}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
    )  # fmt: skip
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 480
        while proc.poll() is None and time.time() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        victims = [p for p in psutil.Process(proc.pid).children(recursive=True) if needle in " ".join(p.cmdline())]
        assert victims, f"no {needle} process under the driver"
        victims[0].kill()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in err, err[-3000:]
    if message is None:  # the router: started again, every step done
        assert proc.returncode == 0, err[-3000:]
        said = out + err  # the pool's warnings go where the run logs (stdout, as Hydra's job logging)
        assert re.search(r"the router \(sglang-router, pid \d+\) died \(killed by SIGKILL\)", said), said[-3000:]
        assert "the router is back at" in said, said[-3000:]
        assert len(metrics.read_text().splitlines()) == steps
        assert not (run_dir / "FAILED").exists()
        return
    assert proc.returncode == 1, err[-3000:]
    assert re.search(message, err), err[-3000:]
    assert re.match(message, (run_dir / "FAILED").read_text())


@pytest.mark.long
@pytest.mark.slow
def test_a_rank_killed_inside_a_weight_push_ends_the_run_naming_it(tmp_path) -> None:
    """Actor rank 1 stops inside the push of weight version 2 (sync_sender's test hook: after the fence paused the
    engines, while rank 0 pushes or waits for it in the push's collectives) and is killed there. The run must end
    promptly, not hang in a collective with the dead rank: exit 1, one line naming the rank, FAILED, no traceback,
    and no process of the run left."""
    import psutil

    run_dir, marker = tmp_path / "run", tmp_path / "pushing"
    env = {**os.environ, "MCORE_RL_TEST_PAUSE_PUSH": f"2:1:{marker}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.train", "data.batch_size=2", "rollout.n=2", "actor.mini_batches=1",
         "trainer.steps=4", f"trainer.run_dir={run_dir}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.time() + 480
        while proc.poll() is None and not (marker.exists() and marker.read_text()) and time.time() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None and marker.exists(), proc.stderr.read()[-3000:]
        rank = int(marker.read_text())
        run = [p for p in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(rank, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)  # a hang in the push's collectives would wait out the gloo timeout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    message = rf"error: actor rank 1 \(pid {rank}\) died"
    assert re.search(message, err), err[-3000:]
    assert re.match(message, (run_dir / "FAILED").read_text())
    deadline = time.time() + 60  # Ray's own processes end within their grace period after the driver
    left = [p for p in run if _alive(p)]
    while left and time.time() < deadline:
        time.sleep(0.5)
        left = [p for p in left if _alive(p)]
    assert not left, f"left running: {[p.pid for p in left]}"


# ------------------------------------------------------------------------------------------------ read-only run dir
def test_a_run_dir_made_read_only_mid_run_is_exit_2_naming_the_file(tmp_path) -> None:
    """A run dir that became read-only mid-run ended with exit 1 and a traceback; a full disk already got a named exit
    2. The run runs in its own mount namespace (`unshare -m`, root), where it bind-mounts its run dir read-only after
    step 1, as an administrator's remount or a file system's errors=remount-ro would."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("a private mount namespace needs root (CAP_SYS_ADMIN)")
    run_dir = tmp_path / "run"
    proc = guarded(run_dir, """
        import subprocess
        log = MetricsLogger(os.path.join(cfg.trainer.run_dir, "metrics.jsonl"), loggers=["jsonl"])
        log.write(1, {"critic/score/mean": 0.5})
        d = cfg.trainer.run_dir
        subprocess.run(["mount", "--bind", d, d], check=True)
        subprocess.run(["mount", "-o", "remount,ro,bind", d], check=True)
        log.write(2, {"critic/score/mean": 0.5})
        return {"steps": 2}
    """, prefix=("unshare", "-m", "--propagation", "private"))  # fmt: skip
    assert proc.returncode == 2, proc.err[-3000:]
    assert "Traceback" not in proc.err
    assert f"Read-only file system writing {run_dir}/metrics.jsonl" in proc.err
    assert "make it writable, or point trainer.run_dir at a writable directory" in proc.err
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]


# ------------------------------------------------------------------------------------------------ Ray's OOM kills
RAYLET_OOM = REPO / "tests/fixtures/ray_logs/raylet_oom_kill.out"  # ray 2.60's raylet.out around a memory-monitor kill


def test_a_memory_monitor_kill_is_read_from_the_raylet_log() -> None:
    from mcore_rl.controller.ray_oom import oom_kills

    text = RAYLET_OOM.read_text()
    (line,) = oom_kills(text)
    assert line == (
        "Ray's memory monitor killed engine-0 (Engine), pid 13492, using 0.18 GB, when the node's memory was at "
        "5.50 GB of 23.54 GB (above Ray's kill threshold, RAY_memory_usage_threshold)"
    )
    assert oom_kills(text, since=time.mktime((2026, 11, 28, 11, 18, 8, 0, 0, -1))) == []  # an earlier run's kill


def test_an_engine_killed_by_rays_memory_monitor_is_named_in_one_line(tmp_path) -> None:
    """The run said only that the engine failed its /health probes, then a thread traceback, then HTTP 503: the cause
    was in raylet.out alone. A real local Ray with its kill threshold at 1% of the node's memory (Ray alone uses
    more) kills the actor."""
    proc = guarded(tmp_path / "run", """
        import ray
        os.environ["RAY_memory_usage_threshold"] = "0.01"  # read by the raylet this ray.init starts
        ray.init(address="local", num_cpus=1, include_dashboard=False)

        @ray.remote(max_restarts=0)
        class Engine:
            def hold(self):
                self.memory = bytearray(200 * 2**20)
                time.sleep(300)

        engine = Engine.options(name="engine-0").remote()
        ray.get(engine.hold.remote(), timeout=240)
    """, timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.err[-3000:]
    assert "Traceback" not in proc.err, proc.err[-3000:]
    assert re.search(
        r"error: Ray's memory monitor killed engine-0 \(Engine\), pid \d+, using [\d.]+ GB, when the node's memory "
        r"was at [\d.]+ GB of [\d.]+ GB .*Give the run more memory",
        proc.err,
    ), proc.err[-3000:]
    assert (tmp_path / "run" / "FAILED").read_text().startswith("error: Ray's memory monitor killed engine-0")
