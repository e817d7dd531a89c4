"""A router that dies is started again at its address, with the engines that are live, and the run goes on; one
that keeps dying ends the run with one line naming it. Uses the real sglang-router process (rollout/router.py) and
the engine pool's own check (controller/engine_pool.py: check_router), which the pool runs from its health monitor
and before the client retries a failed request.

Run: `.venv/bin/pytest tests/test_router_restart.py`
"""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest

from mcore_rl.controller.engine_pool import MAX_ROUTER_RESTARTS, EnginePool
from mcore_rl.errors import ProcessDied
from mcore_rl.rollout.router import Router, _http


def _kill(router: Router) -> None:
    os.killpg(router._proc.pid, signal.SIGKILL)
    router._proc.wait(timeout=30)  # reaped: died() answers from here on, no waiting on timing


def _pool(router: Router) -> EnginePool:
    """The pool's router check with its own state and no engines (the check needs no more)."""
    pool = object.__new__(EnginePool)
    pool.router, pool.pending, pool.engines, pool._restarting = router, set(), [], {}
    pool._lock, pool._router_lock = threading.Lock(), threading.Lock()
    return pool


@pytest.fixture
def router():
    router = Router([], api_key="k")
    router.start()
    try:
        yield router
    finally:
        router.stop()


def test_a_killed_router_is_started_again_at_the_same_address(router) -> None:
    url = router.url
    _kill(router)
    assert "died (killed by SIGKILL)" in router.died()
    _pool(router).check_router()
    assert router.died() is None and router.url == url and router.restarts == 1
    status, _ = _http("GET", url + "/health", api_key="k")
    assert status == 200  # the client's URL answers again


def test_a_live_router_is_left_alone(router) -> None:
    pid = router._proc.pid
    _pool(router).check_router()
    assert router._proc.pid == pid and router.restarts == 0


def test_a_router_that_keeps_dying_ends_the_run_naming_it(router) -> None:
    pool = _pool(router)
    for _ in range(MAX_ROUTER_RESTARTS):
        _kill(router)
        pool.check_router()
    _kill(router)
    with pytest.raises(ProcessDied, match=r"the router \(sglang-router, pid \d+\) died .*started again 3 times"):
        pool.check_router()


def test_a_router_that_cannot_start_again_ends_the_run_naming_both(router) -> None:
    """Its port taken meanwhile (another process bound it): the new router exits, and the run ends naming both."""
    _kill(router)
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the old router's TIME_WAIT connections
        taken.bind((router.host, router.port))
        taken.listen()
        expected = r"died \(killed by SIGKILL\).*starting it again failed: sglang-router exited"
        with pytest.raises(ProcessDied, match=expected):
            _pool(router).check_router()
