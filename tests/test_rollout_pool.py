"""Two embedded engines (Ray actors) behind the real sglang-router, driven by the one client: routing, weight sync
through the HTTP API, and an engine SIGKILLed mid-step (its requests retried on the other engine, the engine
restarted and re-synced to the current weight version before it rejoins the router).

Run: `.venv/bin/pytest tests/test_rollout_pool.py`
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
from tiny_models import tiny_qwen3_moe

from mcore_rl.config import RolloutConfig
from mcore_rl.controller.engine_pool import EnginePool
from mcore_rl.rollout.engine import HFRolloutEngine

pytestmark = [pytest.mark.slow, pytest.mark.long]

HF = tiny_qwen3_moe(initializer_range=0.5, max_position_embeddings=256, eos_token_id=99)
PROMPTS = [[1 + i % 7, 2 + i % 5, 3 + i % 11, 4 + i] for i in range(24)]


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def make_pool(tmp_path, **overrides) -> EnginePool:
    cfg = RolloutConfig(num_engines=2, temperature=0.0, max_new_tokens=48, num_cpus=1.0, max_retries=5, **overrides)
    return EnginePool(cfg, model=dict(HF), tokenizer=None, dtype="float32", runtime="cpu", log_dir=str(tmp_path))


def push(pool: EnginePool, named: list, version: int, urls: list[str] | None = None) -> None:
    """Weights from the test process to engines through the HTTP API (the weight-sync pipeline's tensor transport,
    without actor ranks): begin -> flattened bucket -> end, then the pool's bookkeeping."""
    from mcore_rl.resharding.sync.transports import encode_payload

    payload = encode_payload(named, "flattened_bucket")
    body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket", "weight_version": str(version)}
    for url in urls or pool.urls:
        pool.client.post(url, "/begin_weight_update")
        pool.client.post(url, "/update_weights_from_tensor", body)
        pool.client.post(url, "/end_weight_update")
    pool.weight_version = version
    pool.admit_pending()


def stats(pool: EnginePool, url: str) -> dict:
    return pool.client.get(url, "/server_info")[1]["internal_states"][0]


def expected_greedy(weights_seed: int, prompts: list[list[int]], max_new_tokens: int = 48) -> list[list[int]]:
    engine = HFRolloutEngine(dict(HF), init_seed=weights_seed)
    samples = engine.generate(prompts, temperature=0.0, max_new_tokens=max_new_tokens, eos_token_ids=[99])
    return [s.response_ids for s in samples]


def test_two_engines_behind_the_router(ray_session, tmp_path) -> None:
    pool = make_pool(tmp_path, router_policy="round_robin")
    try:
        source = HFRolloutEngine(dict(HF), init_seed=1)
        push(pool, list(source.state_dict_hf().items()), version=1)
        assert [pool.client.get(u, "/get_weight_version")[1]["weight_version"] for u in pool.urls] == ["1", "1"]
        samples = pool.generate(PROMPTS[:8], n=2, seed=0, stop_token_ids=[])
        assert [s.response_ids for s in samples] == [r for r in expected_greedy(1, PROMPTS[:8]) for _ in range(2)]
        assert all(s.weight_version == 1 for s in samples)
        assert all(stats(pool, u)["generated_tokens"] > 0 for u in pool.urls), "round robin reaches both engines"
        # The n samples of a prompt are one request: one engine prefills the prompt once for all of them.
        totals = [stats(pool, u) for u in pool.urls]
        assert sum(t["cached_tokens"] for t in totals) == 8 * 4  # 8 prompts x 4 tokens, prefilled once instead of 2x

        # rollout.request_grouping=engine: one batched request per engine, through the router, draws the same
        # samples (sample j of prompt i seeded seed + i * n + j either way) with far fewer prefills.
        sampled = {"temperature": 1.0}
        per_prompt = pool.generate(PROMPTS[:9], n=3, seed=40, stop_token_ids=[], overrides=sampled)
        prefills = [stats(pool, u)["num_prefills"] for u in pool.urls]
        pool.cfg.request_grouping = "engine"
        grouped = pool.generate(PROMPTS[:9], n=3, seed=40, stop_token_ids=[], overrides=sampled)
        pool.cfg.request_grouping = "prompt"
        assert [s.response_ids for s in grouped] == [s.response_ids for s in per_prompt]
        assert [s.prompt_ids for s in grouped] == [s.prompt_ids for s in per_prompt]
        for a, b in zip(grouped, per_prompt):
            # another batch composition, another float summation order: logprobs agree to fp32 noise, not bitwise
            assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-4)
        assert len({tuple(s.response_ids) for s in grouped}) > 9, "the samples of a group differ"
        grew = [stats(pool, u)["num_prefills"] - p for u, p in zip(pool.urls, prefills)]
        assert sum(grew) <= 2, f"two batched requests, one prefill each at most: {grew}"
    finally:
        pool.shutdown()


def test_cache_aware_routing_keeps_a_prompt_on_one_engine(ray_session, tmp_path) -> None:
    pool = make_pool(tmp_path, router_policy="cache_aware")
    try:
        push(pool, list(HFRolloutEngine(dict(HF), init_seed=1).state_dict_hf().items()), version=1)
        prompt = list(range(1, 40))
        before = [stats(pool, u)["prefill_tokens"] for u in pool.urls]
        for _ in range(4):
            pool.generate([prompt], n=1, seed=0, stop_token_ids=[])
        grew = [stats(pool, u)["prefill_tokens"] - b for u, b in zip(pool.urls, before)]
        assert sorted(grew) == [0, 4 * len(prompt)], f"the same prompt went to both engines: {grew}"
    finally:
        pool.shutdown()


@pytest.mark.long
def test_engine_killed_mid_step_is_replaced_and_resynced(ray_session, tmp_path) -> None:
    pool = make_pool(tmp_path)
    try:
        source = HFRolloutEngine(dict(HF), init_seed=2)
        weights = list(source.state_dict_hf().items())
        # the weight sync's role: bring a replacement to the current version before it joins the router
        pool.on_engine_started = lambda url: push(pool, weights, pool.weight_version, [url]) or True
        push(pool, weights, version=1)
        dead_url, dead_pid = pool.urls[0], pool.engine_pids()[0]
        result: dict = {}
        step = threading.Thread(target=lambda: result.update(s=pool.generate(PROMPTS, n=4, seed=0, stop_token_ids=[])))
        step.start()
        deadline = time.monotonic() + 60
        while stats(pool, dead_url)["num_running_reqs"] == 0:  # engine 0 is generating its share of the step
            assert time.monotonic() < deadline, "engine 0 never received requests"
            time.sleep(0.01)
        os.kill(dead_pid, signal.SIGKILL)
        step.join(timeout=300)
        samples = result["s"]
        # The step completed with correct samples: every one equals greedy decoding with version 1's weights.
        assert [s.response_ids for s in samples] == [r for r in expected_greedy(2, PROMPTS) for _ in range(4)]
        assert all(s.weight_version == 1 and s.finish_reason in ("stop", "length") for s in samples)
        deadline = time.monotonic() + 120  # the pool's health probe finds the dead engine within a few seconds
        while pool.restarts == 0:
            assert time.monotonic() < deadline, "the dead engine was not replaced"
            time.sleep(0.2)
        pool.wait_for_restarts()
        assert pool.restarts == 1 and dead_url not in pool.urls
        new_url = pool.urls[0]
        # Synced to the current version before the router sends it traffic, then registered with the router.
        assert pool.client.get(new_url, "/get_weight_version")[1]["weight_version"] == "1"
        assert sorted(w["url"] for w in pool.router.workers()) == sorted(pool.urls)
        again = pool.client.generate_samples(
            PROMPTS[:4], 1, {"max_new_tokens": 48, "temperature": 0.0}, url=new_url
        )  # straight to the new engine
        assert [s.response_ids for s in again] == expected_greedy(2, PROMPTS[:4])
    finally:
        pool.shutdown()
