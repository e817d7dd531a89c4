"""The embedded server as an SGLang 0.5.23 double: weight-update sessions with one
owner, the abort route for a dead sender's session, when `weight_version` moves, `/health` and `/flush_cache`.

Each behaviour is SGLang's as read in the pinned wheel (`srt/managers/scheduler_components/weight_updater.py`,
`srt/entrypoints/http_server.py`, `srt/managers/scheduler_components/flush_wrapper.py`); where ours differs on
purpose (staged updates, the abort route) the test says so. Run: `.venv/bin/pytest tests/test_server_sessions.py`
"""

from __future__ import annotations

import threading
import time

import pytest
import requests
import torch
from tiny_models import tiny_qwen3_moe

from mcore_rl.rollout.engine import HFRolloutEngine
from mcore_rl.rollout.server import ServerThread, build_server
from mcore_rl.rollout.weight_receiver import encode_payload

HF = tiny_qwen3_moe(initializer_range=0.5, max_position_embeddings=512)
ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"


@pytest.fixture(scope="module")
def server():
    thread = ServerThread(build_server(dict(HF), health_check_timeout_s=1.0))
    yield thread
    thread.stop()


def post(server, route: str, body=None) -> requests.Response:
    return requests.post(server.url + route, json=body if body is not None else {}, timeout=60)


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    return list(HFRolloutEngine(dict(HF), init_seed=seed).state_dict_hf().items())


def bucket(named, version: str | None = None, **extra) -> dict:
    body = {"serialized_named_tensors": [encode_payload(named, None)], "flush_cache": False, **extra}
    return body if version is None else {**body, "weight_version": version}


def version(server) -> str:
    return requests.get(server.url + "/get_weight_version", timeout=60).json()["weight_version"]


def greedy(server, tokens: int = 5) -> list[int]:
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    return post(server, "/generate", body).json()["output_ids"]


def expected_greedy(seed: int, tokens: int = 5) -> list[int]:
    engine = HFRolloutEngine(dict(HF), init_seed=seed)
    return engine.generate([[4, 5, 6]], temperature=0, max_new_tokens=tokens)[0].response_ids


def full_sync(server, seed: int, tag: str) -> None:
    assert post(server, "/begin_weight_update").status_code == 200
    assert post(server, "/update_weights_from_tensor", bucket(weights(seed), tag)).status_code == 200
    assert post(server, "/end_weight_update").json()["weight_version"] == tag


def test_a_second_begin_is_refused_and_the_first_session_commits_only_its_own(server) -> None:
    """Two senders: the second's begin is refused with SGLang's message (it once silently dropped the first session,
    whose end then committed the second sender's tensors and reported success for tensors it never sent)."""
    full_sync(server, 1, "1")
    new = weights(2)
    assert post(server, "/begin_weight_update").json() == {"success": True, "message": "Success"}
    assert post(server, "/update_weights_from_tensor", bucket(new, "2")).status_code == 200
    second = post(server, "/begin_weight_update")
    assert second.status_code == 400 and second.json() == {"success": False, "message": ALREADY_OPEN}
    end = post(server, "/end_weight_update")
    assert end.status_code == 200 and end.json()["weight_version"] == "2"
    assert greedy(server) == expected_greedy(2)
    end_again = post(server, "/end_weight_update")
    assert end_again.status_code == 400 and end_again.json()["message"] == NO_SESSION


def test_abort_drops_a_dead_senders_session(server) -> None:
    """Ours, not SGLang's (which has no abort; its end_weight_update closes the session over the half-loaded
    weights): the controller drops the session of a sender that died mid-push, nothing is committed."""
    full_sync(server, 3, "3")
    assert post(server, "/begin_weight_update").status_code == 200
    half = weights(4)[:5]
    assert post(server, "/update_weights_from_tensor", bucket(half, "4")).status_code == 200
    # the sender dies here: its session blocks every later push until someone closes it
    assert post(server, "/begin_weight_update").json()["message"] == ALREADY_OPEN
    aborted = post(server, "/abort_weight_update")
    assert aborted.status_code == 200 and "5 staged tensors discarded" in aborted.json()["message"]
    assert version(server) == "3" and greedy(server) == expected_greedy(3)
    nothing = post(server, "/abort_weight_update")
    assert nothing.status_code == 400 and nothing.json()["message"] == NO_SESSION
    full_sync(server, 4, "4")  # the next push goes through
    assert greedy(server) == expected_greedy(4)


def test_weight_version_moves_only_when_an_update_names_one(server) -> None:
    """SGLang's record_weight_version_change ignores an update without weight_version."""
    full_sync(server, 5, "5")
    assert post(server, "/begin_weight_update").status_code == 200
    assert post(server, "/update_weights_from_tensor", bucket(weights(6))).status_code == 200
    assert post(server, "/end_weight_update").json()["weight_version"] == "5"
    assert greedy(server) == expected_greedy(6), "the weights moved, the version did not"


def test_updates_are_refused_outside_a_session_with_sglangs_message(server) -> None:
    answer = post(server, "/update_weights_from_tensor", bucket(weights(1)[:1]))
    assert answer.status_code == 400
    assert answer.json()["message"] == (
        "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
    )


def _held_running(server) -> threading.Thread:
    """A request that stays in the running batch: started, seen running, then paused in place (SGLang keeps such
    requests in its running batch, so the engine is not idle). `continue_generation` lets it finish."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    thread = threading.Thread(target=post, args=(server, "/generate", body))
    thread.start()
    while requests.get(server.url + "/v1/loads", timeout=60).json()["loads"][0]["num_running_reqs"] == 0:
        assert thread.is_alive(), "the request finished before it was seen running"
        time.sleep(0.01)
    assert post(server, "/pause_generation", {"mode": "in_place"}).ok
    return thread


def test_flush_cache_on_an_update_while_requests_run_fails_the_call_as_sglang(server) -> None:
    """SGLang's update_weights_* flush the cache by default (flush_cache=true) and answer success=false when
    requests are running; the tensors stay loaded there (staged here) and the session stays open."""
    full_sync(server, 7, "7")
    new = weights(8)
    # begun while generating, so the session stages (one begun while paused writes in place, and generation may
    # not continue until it ends: test_server_in_place.py)
    assert post(server, "/begin_weight_update").status_code == 200
    held = _held_running(server)
    try:
        flushing = post(server, "/update_weights_from_tensor", bucket(new, "8", flush_cache=True))
        assert flushing.status_code == 400 and "the cache was not flushed" in flushing.json()["message"]
        assert post(server, "/update_weights_from_tensor", bucket(new, "8")).status_code == 200
    finally:
        assert post(server, "/continue_generation").ok
        held.join(timeout=120)
    assert post(server, "/end_weight_update").json()["weight_version"] == "8"


def test_flush_cache_is_an_idle_check_with_sglangs_timeout(server) -> None:
    held = _held_running(server)
    waited: dict = {}
    try:
        busy = requests.get(server.url + "/flush_cache", timeout=60)
        assert busy.status_code == 400 and busy.text == "Flush cache failed.\n"
        # ?timeout=S waits for idle (SGLang's deferred flush): the held request finishes meanwhile
        flush = threading.Thread(
            target=lambda: waited.update(r=requests.post(server.url + "/flush_cache?timeout=120", timeout=180))
        )
        flush.start()
        while not server.server._flushing:
            assert flush.is_alive(), f"the flush answered at once: {waited['r'].status_code} {waited['r'].text}"
            time.sleep(0.01)
    finally:
        assert post(server, "/continue_generation").ok
        held.join(timeout=120)
    flush.join(timeout=180)
    assert waited["r"].status_code == 200 and waited["r"].text.startswith("Cache flushed.")
    assert requests.get(server.url + "/flush_cache?timeout=-1", timeout=60).status_code == 400


def test_a_retracted_request_does_not_block_a_flush(server) -> None:
    """SGLang's flush ignores the waiting queue while paused: what a retract put back there does not count."""
    held = _held_running(server)
    try:
        assert requests.get(server.url + "/flush_cache", timeout=60).status_code == 400  # paused in place
        assert post(server, "/pause_generation", {"mode": "retract"}).ok
        assert requests.get(server.url + "/flush_cache", timeout=60).status_code == 200
    finally:
        assert post(server, "/continue_generation").ok
        held.join(timeout=120)


def test_health_generates_a_token_and_fails_while_paused_or_released(server) -> None:
    """SGLang's /health (= /health_generate by default) waits for scheduler output: 200 when a one-token probe (or
    any running request) produces some, 503 after the health-check timeout when nothing can run: paused, or
    memory released. Probing then is the client's mistake, which this double now shows."""
    prefills = server.server.batcher.stats["num_prefills"]
    for route in ("/health", "/health_generate"):
        assert requests.get(server.url + route, timeout=60).status_code == 200
    assert server.server.batcher.stats["num_prefills"] == prefills + 2, "each probe ran a forward"
    assert post(server, "/pause_generation", {"mode": "in_place"}).ok
    try:
        assert requests.get(server.url + "/health", timeout=60).status_code == 503
    finally:
        assert post(server, "/continue_generation").ok
    assert requests.get(server.url + "/health", timeout=60).status_code == 200
    assert post(server, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]}).ok
    try:
        assert requests.get(server.url + "/health", timeout=60).status_code == 503
    finally:
        assert post(server, "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]}).ok
    full_sync(server, 9, "9")  # released weights come back as zeros until the next update
    assert requests.get(server.url + "/health", timeout=60).status_code == 200
    assert server.server.batcher.num_waiting == 0, "no probe is left in the queue"
