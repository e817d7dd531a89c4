"""One Ray cluster for the end-to-end runs of a test session, which connect to it with `trainer.ray_address`.

A local Ray start and stop costs each run about 6 s (GCS, raylet, agents, then the shutdown), more than the steps of
most runs. Connecting to a running cluster is also the production path: on Slurm every driver joins the cluster that
`launch/submit.py` started. The runs that check a local start itself (the default job's console, Ctrl-C, kill -9,
the local submit) still start their own.

The cluster runs `ray start --head --block` in its own session, on loopback with a token of its own (as submit.py's
jobs do); the pytest process kills that session when it exits. Runs get the address and the token through
`ray_address_override` / `train_env`.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from mcore_rl.parallel.groups import free_port

_CLUSTER: dict[str, object] = {}
CPUS = 16  #: logical CPUs: more than the largest run reserves (placement waits are not part of any test)


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _start() -> None:
    token = secrets.token_hex(16)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    port = free_port()
    ray = str(Path(sys.executable).with_name("ray"))
    proc = subprocess.Popen(
        [ray, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1", f"--num-cpus={CPUS}",
         "--include-dashboard=false", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    atexit.register(_stop, proc)
    deadline = time.time() + 60
    while True:  # the GCS port answers; a driver's ray.init waits for the raylet itself
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the shared test Ray cluster did not start (exit {proc.poll()})") from None
            time.sleep(0.2)
    _CLUSTER.update(address=f"127.0.0.1:{port}", env=env)


def _cluster() -> dict[str, object]:
    if not _CLUSTER:  # started on first use
        _start()
    return _CLUSTER


def train_env() -> dict[str, str]:
    """The environment of a run that joins the shared cluster (its auth token)."""
    return dict(_cluster()["env"])  # type: ignore[arg-type]


def ray_address_override() -> str:
    """`trainer.ray_address=<the shared cluster>`."""
    return f"trainer.ray_address={_cluster()['address']}"
