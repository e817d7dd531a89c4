"""The run's only engine dies between a step's generation and its weight push (the vLLM train test's kill
landed there in 2 of 3 fresh-clone CI runs, and the run ended): the fence finds it dead and hands it to the pool,
no engine is left for the push, and the retry waits for the replacement, which then takes the push. Real actor
ranks (Ray) and a real embedded engine; the fault is a SIGKILL of the engine's process.

Run: `.venv/bin/pytest tests/test_weight_sync_lone_engine.py`
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_weight_sync_fence import GREEDY, PROMPTS, _perturb, _setup, ray_session  # noqa: E402,F401

pytestmark = [pytest.mark.slow, pytest.mark.long]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.usefixtures("ray_session")
def test_the_only_engine_killed_before_a_push_is_replaced_and_takes_it(tmp_path) -> None:
    actor, pool, sync = _setup(tmp_path, num_engines=1)
    try:
        sync.push(1)
        dead_url, dead_pid = pool.urls[0], pool.engine_pids()[0]
        _perturb(actor)
        sync.weights_changing(2)  # the step's update: a replacement must now wait for this push
        os.kill(dead_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not _gone(dead_pid):
            assert time.monotonic() < deadline, "the engine's process outlived SIGKILL"
            time.sleep(0.05)
        sync.push(2)  # before the fix: SyncError "failed twice" (no engine left for the retry), the run ended
        assert pool.restarts == 1 and dead_url not in pool.urls and not pool.pending
        assert sync.version == 2 and not sync.dirty
        (url,) = pool.urls
        assert pool.client.get(url, "/get_weight_version")[1]["weight_version"] == "2"
        samples = pool.client.generate_samples(PROMPTS, 1, GREEDY)
        assert all(s.weight_version == 2 for s in samples), "the replacement serves the pushed version"
    finally:
        pool.shutdown()
        actor.shutdown()
