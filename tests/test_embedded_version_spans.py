"""The embedded server labels each token of a request that lived across a weight update as SGLang 0.5.23 does, with
generation paused in place or retracted (sync.pause_mode=in_place | retract), and the SGLang dialect reads the labels.

SGLang's format (utils/weight_versions.py:90-107, `add_weight_versions_to_meta_info`): `meta_info.weight_versions` is
a list of {"version": str, "start": int, "end": int} spans that tile the output tokens in order, and
`meta_info.weight_version` is the last span's version. Its scheduler records the change for running, retracted and
waiting requests alike (managers/scheduler.py:5636-5655), so the tokens before the pause keep the old version.

The pause is ordered deterministically: the test's hook on the batcher asks for it on the scheduler thread right
after the request's first token is sampled, so it lands at the next step boundary (a few tokens in, long before the
request's last token).

Run: `.venv/bin/pytest tests/test_embedded_version_spans.py`
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from tiny_models import tiny_qwen3_moe

from mcore_rl.rollout.client import DIALECTS, RolloutClient, sample_from_response
from mcore_rl.rollout.server import ServerThread, build_server

TOKENS = 64


@pytest.fixture(scope="module")
def server():
    model = tiny_qwen3_moe(vocab_size=63, max_position_embeddings=512)
    thread = ServerThread(build_server(model, max_running_requests=8, weight_version="1"))
    client = RolloutClient(thread.url, engine="sglang")
    yield thread, client
    client.close()
    thread.stop()


def _pause_after_first_token(thread: ServerThread, mode: str) -> threading.Event:
    """Pause the batcher (as /pause_generation does) right after the next token is sampled; the event is set once
    the pause has landed."""
    batcher = thread.server.batcher
    sample_and_append = batcher._sample_and_append
    paused = threading.Event()

    def then_pause(*args: Any) -> None:
        sample_and_append(*args)
        batcher._sample_and_append = sample_and_append  # once
        batcher.pause(mode).add_done_callback(lambda _: paused.set())

    batcher._sample_and_append = then_pause
    return paused


@pytest.mark.parametrize("pause_mode", ["in_place", "retract"])
def test_a_request_across_a_push_is_labelled_per_token_as_sglang_does(server, pause_mode: str) -> None:
    thread, client = server
    url = thread.url
    client.post(url, "/update_weight_version", {"new_version": "1", "abort_all_requests": False})
    paused = _pause_after_first_token(thread, pause_mode)
    prompt = [1, 5, 6]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True},
            "return_logprob": True}  # fmt: skip
    answers: list[Any] = []
    request = threading.Thread(target=lambda: answers.append(client.run(client.arequest("POST", url, "/generate",
                                                                                         body))))  # fmt: skip
    request.start()
    assert paused.wait(60), "the request sampled no token"
    client.post(url, "/update_weight_version", {"new_version": "2", "abort_all_requests": False})
    client.post(url, "/continue_generation")
    request.join(120)
    ((status, answer),) = answers
    assert status == 200, answer
    meta = answer["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["1", "2"] and meta["weight_version"] == "2", meta
    assert all(sorted(s) == ["end", "start", "version"] for s in spans)
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0 and spans[1]["end"] == TOKENS
    sample = sample_from_response(prompt, answer, dialect=DIALECTS["sglang"])
    k = spans[0]["end"]
    assert sample.weight_versions == [(1, 0, k), (2, k, TOKENS)] and sample.weight_version == 2
