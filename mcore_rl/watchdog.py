"""Kill what a training driver started once it is gone, even after `kill -9`.

The driver (train.py, through mcore_rl/lifecycle.py) starts this as a child in its own session, holding the write end
of its stdin pipe:

    driver ──pipe──> watchdog: every 0.5 s, remember the driver's descendants (pid + start time)
    EOF on the pipe (the driver exited, however it died) -> SIGTERM, then after 2 s SIGKILL, to the remembered
    processes that still run (same pid and start time, so a reused pid is never hit)

Why: Ray's local processes fate-share with the driver, but its agents wait for their raylet to be gone five times in a
row and then try to report to the dead GCS, which keeps two of them alive for about a minute after `kill -9` of the
driver; Megatron ranks and embedded engines are Ray workers and go with them. Only the driver's own descendants are
touched: never a process of another run, another user or an external Ray cluster.

    python -m mcore_rl.watchdog <driver_pid>      (started by lifecycle.start_watchdog; not for direct use)
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

POLL_S = 0.5
GRACE_S = 2.0


def start(driver_pid: int | None = None) -> subprocess.Popen:
    """Start the watchdog for this process (the driver); keep the returned object alive as long as the driver."""
    return subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.watchdog", str(driver_pid or os.getpid())],
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


def main(driver_pid: int) -> None:
    known: dict[int, float] = {}
    gone = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.buffer.read()  # returns when every write end is closed: the driver has exited
        gone.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not gone.wait(POLL_S):
        known.update(_descendants(driver_pid))
    time.sleep(0.2)  # a normal exit's own shutdown has usually finished by now
    _end(known)


if __name__ == "__main__":
    main(int(sys.argv[1]))
