"""A failed weight push does not end the run: the engines keep their old
version, the push is retried once before anything generates, and only a second failure ends the run with a SyncError
naming the step, the version and the engine (exit 1). Real actor ranks (Ray) and a real embedded engine; the fault is
one engine refusing to commit the update (its /end_weight_update answering 500), injected at the fence's client.

Run: `.venv/bin/pytest tests/test_weight_sync_retry.py`
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_weight_sync_fence import GREEDY, PROMPTS, _greedy, _perturb, _setup, ray_session  # noqa: E402,F401

from mcore_rl.controller.weight_sync import SyncError  # noqa: E402
from mcore_rl.rollout.client import RolloutRequestError  # noqa: E402

pytestmark = pytest.mark.slow


class RefusingCommits:
    """The pool's client, except that the next `failures` /end_weight_update calls are refused as an engine that
    could not load the update answers (HTTP 500)."""

    def __init__(self, client: Any, failures: int) -> None:
        self.client, self.failures, self.refused = client, failures, []

    def post(self, url: str, route: str, body: Any = None, timeout_s: float | None = None) -> Any:
        if route == "/end_weight_update" and self.failures:
            self.failures -= 1
            self.refused.append(url)
            raise RolloutRequestError(f"{url}{route} answered 500: injected fault: a bucket failed to load")
        return self.client.post(url, route, body, timeout_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def _version(pool: Any) -> str:
    return pool.client.get(pool.urls[0], "/get_weight_version")[1]["weight_version"]


@pytest.mark.usefixtures("ray_session")
def test_a_failed_push_is_retried_once_and_a_second_failure_names_the_step_and_engine(tmp_path) -> None:
    actor, pool, sync = _setup(tmp_path)
    try:
        sync.push(1)
        before = _greedy(pool)
        _perturb(actor)
        sync.weights_changing(2)
        sync.fence.client = RefusingCommits(pool.client, failures=1)
        sync.push(2)  # before the fix: SyncError, and the run ended at this step
        assert sync.fence.client.refused == [pool.urls[0]], "the fault hit the first try"
        assert _version(pool) == "2" and sync.version == 2 and not sync.dirty
        samples = pool.client.generate_samples(PROMPTS, 1, GREEDY)
        assert all(s.weight_version == 2 for s in samples), "the next generation uses the new version"
        after = _greedy(pool)
        assert after != before

        _perturb(actor)
        sync.weights_changing(3)
        sync.fence.client = RefusingCommits(pool.client, failures=2)
        with pytest.raises(SyncError) as err:
            sync.push(3)
        message = str(err.value)
        assert f"step 3: weight push of version 3 failed twice, on engines ['{pool.urls[0]}']" in message, message
        assert _version(pool) == "2" and _greedy(pool) == after, "the engine kept the weights of version 2"
    finally:
        pool.shutdown()
        actor.shutdown()
