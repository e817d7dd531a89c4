"""Kill what a training driver started once it is gone, even after `kill -9`.

The driver (train.py, through mcore_rl/lifecycle.py) starts this as a child in its own session, holding the write end
of its stdin pipe:

    driver ──pipe──> watchdog: every 0.5 s, remember the driver's descendants (pid + start time)
    EOF on the pipe (the driver exited, however it died) -> SIGTERM, then after 2 s SIGKILL, to the remembered
    processes that still run (same pid and start time, so a reused pid is never hit); and, when the driver left
    neither <run_dir>/summary.json nor <run_dir>/FAILED (kill -9, the OOM killer, a C library's _exit), FAILED
    saying so: a run dir never looks like a finished run, or one still running, when its driver is gone

Why: Ray's local processes fate-share with the driver, but its agents wait for their raylet to be gone five times in a
row and then try to report to the dead GCS, which keeps two of them alive for about a minute after `kill -9` of the
driver; Megatron ranks and embedded engines are Ray workers and go with them. Only the driver's own descendants are
touched: never a process of another run, another user or an external Ray cluster.

    python -m mcore_rl.watchdog <driver_pid> [run_dir]   (started by lifecycle.py; not for direct use)

It also keeps the driver's own SIGTERM handler (lifecycle.py's) in place across ray.init: keep_sigterm_handler and
reclaim_sigterm live here, in the bottom layer, because the controller (which starts Ray) may not import lifecycle.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.5
GRACE_S = 2.0
_SIGTERM_HANDLER: Callable[[int, Any], None] | None = None


def keep_sigterm_handler(handler: Callable[[int, Any], None]) -> None:
    """Remember the driver's SIGTERM handler, for reclaim_sigterm."""
    global _SIGTERM_HANDLER
    _SIGTERM_HANDLER = handler


def reclaim_sigterm() -> None:
    """Put the driver's SIGTERM handler back after ray.init (controller/placement.py calls this); no-op without one.

    ray.init (2.x) sets a Python handler that calls sys.exit(15), and its core worker installs absl's failure signal
    handler for SIGTERM in C. When the whole process group was signalled (`timeout`, scancel, a Slurm time limit), the
    driver then aborted inside absl's handler while Ray's own processes died of the same signal (exit 134, no FAILED
    marker; ray 2.x). signal.signal replaces both at the C level, and the driver ends as after a SIGTERM to it alone.
    """
    if _SIGTERM_HANDLER is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _SIGTERM_HANDLER)


def start(driver_pid: int | None = None, run_dir: str | None = None) -> subprocess.Popen:
    """Start the watchdog for this process (the driver); keep the returned object alive as long as the driver.
    With `run_dir`, it marks the run FAILED if the driver ends without a summary.json or a FAILED of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.watchdog", str(driver_pid or os.getpid()), *([run_dir] if run_dir else [])],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the driver's process group must not end the watchdog first
    )


def _descendants(pid: int) -> dict[int, float]:
    """The driver's descendants but this watchdog (its child too): it must outlive the others' ending."""
    import psutil

    try:
        me = os.getpid()
        return {p.pid: p.create_time() for p in psutil.Process(pid).children(recursive=True) if p.pid != me}
    except psutil.Error:
        return {}


def _end(known: dict[int, float]) -> None:
    import psutil

    alive = []
    for pid, created in known.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created:
                proc.terminate()
                alive.append(proc)
        except psutil.Error:
            continue
    _, still = psutil.wait_procs(alive, timeout=GRACE_S)
    for proc in still:
        try:
            proc.kill()
        except psutil.Error:
            pass


def mark_unfinished(run_dir: str, driver_pid: int) -> bool:
    """Write <run_dir>/FAILED when the driver left neither summary.json nor FAILED; whether it wrote one."""
    if not os.path.isdir(run_dir) or any(os.path.exists(os.path.join(run_dir, f)) for f in ("summary.json", "FAILED")):
        return False
    message = (
        f"error: the driver (pid {driver_pid}) exited without finishing and without reporting why: no summary.json "
        f"and no error of its own (killed with SIGKILL, by the kernel's OOM killer, or ended by code calling a C "
        f"library's exit); its output holds the last thing it did\n"
    )
    tmp = os.path.join(run_dir, f"FAILED.tmp.{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(message)
        os.replace(tmp, os.path.join(run_dir, "FAILED"))
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        return False
    return True


def main(driver_pid: int, run_dir: str | None = None) -> None:
    known: dict[int, float] = {}
    gone = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.buffer.read()  # returns when every write end is closed: the driver has exited
        gone.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not gone.wait(POLL_S):
        known.update(_descendants(driver_pid))
    time.sleep(0.2)  # a normal exit's own shutdown has usually finished by now
    if run_dir is not None:
        mark_unfinished(run_dir, driver_pid)
    _end(known)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
