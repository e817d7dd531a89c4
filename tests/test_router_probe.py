"""The router's periodic probe must not take a paused engine out of rotation. A colocated engine is paused (its
weights released) for every training phase, longer than SGLang's health-check timeout; a probe of /health, which
generates a token, failed there, and after three failures the real sglang-router answered every /generate with 503
no_available_workers until two probes in a row passed again. The probe asks /model_info instead (rollout/router.py).

Real sglang-router, embedded server on loopback. Run: `.venv/bin/pytest tests/test_router_probe.py`
"""

from __future__ import annotations

import time

import requests
from tiny_models import tiny_qwen3_moe

from mcore_rl.rollout.router import Router, _http
from mcore_rl.rollout.server import ServerThread, build_server


def test_a_worker_paused_past_many_probes_stays_in_rotation() -> None:
    engine = ServerThread(build_server(dict(tiny_qwen3_moe()), health_check_timeout_s=0.5))
    router = Router([engine.url], health_check_interval_s=1)
    try:
        router.start()
        tags = {"tags": ["weights", "kv_cache"]}
        assert requests.post(engine.url + "/release_memory_occupation", json=tags, timeout=60).ok
        assert requests.get(engine.url + "/health", timeout=60).status_code == 503  # what a /health probe gets
        # ten probe intervals paused: a probe of /health fails every one (the router gives up after three)
        time.sleep(10)
        status, workers = _http("GET", router.url + "/workers")
        assert status == 200
        listed = workers.get("workers", workers) if isinstance(workers, dict) else workers
        assert [w.get("is_healthy") for w in listed] == [True], listed
    finally:
        router.stop()
        engine.stop()
