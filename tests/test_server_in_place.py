"""The embedded server's in-place weight updates: a session begun while generation is paused (a pause, or weights
released and resumed in colocated placement) writes each bucket straight into the live weights, as SGLang loads,
instead of staging a copy of the model (rollout/weight_receiver.py). No decode step runs until the session ends;
what a failed in-place session wrote keeps generation paused until an update that rewrites it commits, and the
controller's fence holds such an engine like an SGLang one. Run: `.venv/bin/pytest tests/test_server_in_place.py`
"""

from __future__ import annotations

import pytest
import requests
import torch
from test_server_sessions import HF, bucket, expected_greedy, full_sync, greedy, post, version, weights

from mcore_rl.controller.engine_fence import EngineFence
from mcore_rl.rollout.client import RolloutClient
from mcore_rl.rollout.server import ServerThread, build_server


@pytest.fixture
def server():
    thread = ServerThread(build_server(dict(HF), health_check_timeout_s=1.0))
    yield thread
    thread.stop()


def _state(server) -> dict:
    return requests.get(server.url + "/server_info", timeout=60).json()["internal_states"][0]


def _model_bytes(server) -> int:
    return sum(p.numel() * p.element_size() for p in server.server.engine.model.parameters())


def test_a_session_begun_while_paused_writes_in_place_without_a_staging_copy(server) -> None:
    """Paused: the buckets land in the live weights (no shadow: the engine holds one copy of the model), the
    version moves at the end, and generation continues on the new weights."""
    receiver = server.server.receiver
    new = weights(12)
    assert post(server, "/pause_generation", {"mode": "abort"}).ok
    assert post(server, "/begin_weight_update").ok
    assert post(server, "/update_weights_from_tensor", bucket(new, "12")).ok
    assert receiver.resident_bytes == 0, "an in-place session allocated a staging copy"
    live = server.server.engine.state_dict_hf()
    assert all(torch.equal(live[name], tensor) for name, tensor in new), "the bucket is not in the live weights"
    assert version(server) != "12", "the version moves at the commit, not before"
    assert post(server, "/end_weight_update").json()["weight_version"] == "12"
    assert post(server, "/continue_generation").ok
    assert greedy(server) == expected_greedy(12)
    # generating, the next session stages: the old weights serve until its commit
    assert post(server, "/begin_weight_update").ok
    assert post(server, "/update_weights_from_tensor", bucket(weights(13), "13")).ok
    assert receiver.resident_bytes == _model_bytes(server), "a session begun while generating must stage"
    assert greedy(server) == expected_greedy(12)
    assert post(server, "/end_weight_update").ok
    assert greedy(server) == expected_greedy(13)


def test_generation_cannot_continue_during_an_in_place_session(server) -> None:
    assert post(server, "/pause_generation", {"mode": "in_place"}).ok
    assert post(server, "/begin_weight_update").ok
    refused = post(server, "/continue_generation")
    assert refused.status_code == 400 and "writing into the live weights" in refused.json()["message"]
    assert _state(server)["paused"]
    assert post(server, "/update_weights_from_tensor", bucket(weights(14), "14")).ok
    assert post(server, "/end_weight_update").ok
    assert post(server, "/continue_generation").ok
    assert greedy(server) == expected_greedy(14)


@pytest.mark.parametrize("failure", ["abort", "refused bucket"])
def test_a_failed_in_place_session_keeps_generation_paused_until_a_complete_update(server, failure: str) -> None:
    """Half a model written in place, then the sender dies (abort) or a bucket is refused (a NaN): the engine's
    weights are a mix, so it says so, refuses to continue, and continues once a whole update commits."""
    full_sync(server, 15, "15")
    assert post(server, "/pause_generation", {"mode": "abort"}).ok
    assert post(server, "/begin_weight_update").ok
    new = weights(16)
    assert post(server, "/update_weights_from_tensor", bucket(new[:4], "16")).ok
    if failure == "abort":
        aborted = post(server, "/abort_weight_update").json()
        assert aborted["weights_intact"] is False and "written in place" in aborted["message"]
    else:
        name, tensor = new[4]
        poisoned = tensor.clone()
        poisoned.view(-1)[0] = float("nan")
        assert post(server, "/update_weights_from_tensor", bucket([(name, poisoned)], "16")).status_code == 400
        ended = post(server, "/end_weight_update")
        assert ended.status_code == 400 and "written in place" in ended.json()["message"]
    assert version(server) == "15"
    assert _state(server)["weights_incomplete"] == (5 if failure != "abort" else 4)
    refused = post(server, "/continue_generation")
    assert refused.status_code == 400 and "hold values of no committed weight update" in refused.json()["message"]
    # an update that rewrites only some of them is not enough
    assert post(server, "/begin_weight_update").ok
    assert post(server, "/update_weights_from_tensor", bucket(new[:2], "16")).ok
    assert post(server, "/end_weight_update").ok
    assert post(server, "/continue_generation").status_code == 400
    full_sync(server, 16, "16")
    assert _state(server)["weights_incomplete"] == 0
    assert post(server, "/continue_generation").ok
    assert greedy(server) == expected_greedy(16)


def test_weights_resumed_after_a_release_wait_for_an_update(server) -> None:
    """Colocated placement: released weights come back as zeros. Generation waits for the update that refills them
    (it once continued at the resume and sampled from zero weights), then continues by itself."""
    full_sync(server, 17, "17")
    tags = {"tags": ["weights", "kv_cache"]}
    assert post(server, "/release_memory_occupation", tags).ok
    assert post(server, "/resume_memory_occupation", tags).ok
    state = _state(server)
    assert state["paused"] and state["weights_incomplete"] == len(list(server.server.engine.model.parameters()))
    assert post(server, "/continue_generation").status_code == 400
    assert requests.get(server.url + "/health", timeout=60).status_code == 503
    full_sync(server, 18, "18")  # paused: in place
    assert not _state(server)["paused"]
    assert greedy(server) == expected_greedy(18)


def test_the_fence_holds_an_engine_whose_in_place_session_it_closed(server) -> None:
    """The controller's close of a failed push: an engine that answers weights_intact false is held (not
    continued), as an SGLang engine closed over half-loaded weights is."""
    client = RolloutClient(server.url, engine="hf")
    try:
        fence = EngineFence(client, "abort", lambda url, why: None, control_timeout_s=30.0, update_timeout_s=30.0)
        live, paused = fence.open([server.url])
        assert live == paused == [server.url]
        assert post(server, "/update_weights_from_tensor", bucket(weights(19)[:3], "19")).ok
        assert fence.close(live) == [server.url]
        fence.resume(paused)
        assert _state(server)["paused"], "the fence continued an engine holding half a push"
        assert fence.held == {server.url}
    finally:
        client.close()
