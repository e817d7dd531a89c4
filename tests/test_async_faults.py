"""Faults while requests are in flight across a push (generation ahead of training, partial rollouts): each ends as
a completed generation with every token labelled by the version that sampled it, never a hang.

- an engine SIGKILLed while its partial requests (tokens of version 1, a push to version 2 committed) wait: they are
  retried on the other engine and the step completes;
- a push that fails while the engine's requests are retracted (SGLang's pause mode retract, on our server): the
  engine is held paused, the retry commits, the requests resume on the new version and complete.

The requests are made to be in flight at the push without relying on timing: the test waits until every row has
decoded tokens, then pauses the engine itself (retract: the rows keep their tokens and wait in the queue) before the
push, and continues it after. Real embedded engines (Ray actors) behind the real sglang-router; the second test has
real Megatron ranks pushing through WeightSync.

Run: `.venv/bin/pytest tests/test_async_faults.py`
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_rollout_pool import HF as POOL_HF  # noqa: E402
from test_rollout_pool import make_pool, push, ray_session, stats  # noqa: E402,F401
from test_weight_sync_retry import RefusingCommits  # noqa: E402
from tiny_models import tiny_qwen3_moe  # noqa: E402

from mcore_rl.controller.async_producer import token_versions  # noqa: E402
from mcore_rl.rollout.engine import HFRolloutEngine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.long]

LONG = 40  # tokens per response: enough that every row is still running when the test pauses the engine


def wait_until(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def assert_labelled(samples, versions: set[int]) -> None:
    """Every token carries one version, the spans tile the response in order, old before new."""
    for s in samples:
        labels = token_versions(s)
        assert len(labels) == len(s.response_ids) and set(labels) <= versions, s.weight_versions
        assert labels == sorted(labels), f"a token of an older version after a newer one: {s.weight_versions}"


@pytest.mark.usefixtures("ray_session")
def test_an_engine_killed_with_partial_requests_in_flight_is_retried_and_the_step_completes(tmp_path):
    pool = make_pool(tmp_path, router_policy="round_robin")  # two engines, both get rows; 48 tokens at most
    try:
        weights = list(HFRolloutEngine(dict(POOL_HF), init_seed=2).state_dict_hf().items())
        pool.on_engine_started = lambda url: push(pool, weights, pool.weight_version, [url]) or True
        push(pool, weights, version=1)
        prompts = [[1 + i % 7, 2 + i % 5, 3 + i] for i in range(8)]
        params = {"max_new_tokens": LONG, "temperature": 0.0, "ignore_eos": True}
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(s=pool.client.generate_samples(prompts, 2, params)))
        worker.start()
        dead_pid = pool.engine_pids()[0]
        wait_until(lambda: all(stats(pool, u)["num_running_reqs"] > 0 for u in pool.urls), "both engines to decode")
        decoded = {u: stats(pool, u)["decode_steps"] for u in pool.urls}
        wait_until(lambda: all(stats(pool, u)["decode_steps"] >= decoded[u] + 2 for u in pool.urls), "two steps")
        for url in pool.urls:  # the rows keep their version-1 tokens and wait
            pool.client.post(url, "/pause_generation", {"mode": "retract"})
        assert all(stats(pool, u)["num_waiting_reqs"] > 0 for u in pool.urls), "no request was in flight"
        push(pool, weights, version=2)
        os.kill(dead_pid, signal.SIGKILL)  # its partial requests die with it
        pool.client.post(pool.urls[1], "/continue_generation")
        worker.join(timeout=300)
        assert not worker.is_alive(), "the generation hung"
        samples = result["s"]
        assert all(len(s.response_ids) == LONG and s.finish_reason == "length" for s in samples)
        assert_labelled(samples, {1, 2})
        assert any(len({v for v, _, _ in s.weight_versions}) == 2 for s in samples), "no sample spans the push"
        assert pool.client.stats["retries"] > 0, "nothing was retried: the killed engine held no request"
    finally:
        pool.shutdown()


@pytest.mark.usefixtures("ray_session")
def test_a_push_that_fails_while_requests_are_retracted_is_retried_and_they_finish_on_the_new_version(tmp_path):
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig, RolloutConfig, SyncConfig
    from mcore_rl.controller.actor_group import ActorGroup
    from mcore_rl.controller.engine_pool import EnginePool
    from mcore_rl.controller.weight_sync import WeightSync

    hf = tiny_qwen3_moe(initializer_range=0.5, max_position_embeddings=128)
    actor = ActorGroup(
        ModelConfig(hf_config=dict(hf)),
        ActorConfig(world_size=2, layout=LayoutConfig(ep=2), use_ref=False, num_cpus_per_rank=1),
        "cpu",
    )
    rollout = RolloutConfig(num_engines=1, num_cpus=1, max_new_tokens=LONG)
    pool = EnginePool(rollout, model=dict(hf), tokenizer=None, dtype="float32", runtime="cpu", log_dir=str(tmp_path))
    try:
        sync = WeightSync(
            actor, pool, SyncConfig(bucket_bytes=1 << 14, timeout_s=20, pause_mode="retract"), rollout, "cpu",
            str(tmp_path), dict(hf),
        )  # fmt: skip
        sync.push(1)
        url = pool.urls[0]
        params = {"max_new_tokens": LONG, "temperature": 1.0, "ignore_eos": True}
        result: dict = {}
        prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
        worker = threading.Thread(target=lambda: result.update(s=pool.client.generate_samples(prompts, 2, params, 0)))
        worker.start()
        wait_until(lambda: stats(pool, url)["num_running_reqs"] == len(prompts) * 2, "every row to run")
        first = stats(pool, url)["decode_steps"]
        wait_until(lambda: stats(pool, url)["decode_steps"] >= first + 2, "two decode steps")
        pool.client.post(url, "/pause_generation", {"mode": "retract"})  # in flight, retracted, tokens of version 1
        sync.weights_changing(2)
        sync.fence.client = RefusingCommits(pool.client, failures=1)
        sync.push(2)  # the first try's commit is refused: the engine is held paused, the retry commits
        assert sync.fence.client.refused == [url] and sync.version == 2 and not sync.dirty
        worker.join(timeout=300)
        assert not worker.is_alive(), "the retracted requests never resumed"
        samples = result["s"]
        assert all(len(s.response_ids) == LONG for s in samples)
        assert_labelled(samples, {1, 2})
        assert all([v for v, _, _ in s.weight_versions] == [1, 2] for s in samples), "each spans the push once"
        assert pool.client.get(url, "/get_weight_version")[1]["weight_version"] == "2"
    finally:
        pool.shutdown()
        actor.shutdown()
