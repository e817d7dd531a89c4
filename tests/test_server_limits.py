"""The embedded rollout server under hostile or careless requests: every bound is a 400
that names the limit and the flag that raises it, bad values are 400s naming the key (never a 500), nothing a client
sends is parsed or tokenized on the event loop, and a failing forward finishes every sequence it held.

Run: `.venv/bin/pytest tests/test_server_limits.py`
"""

from __future__ import annotations

import math
import threading

import pytest
import requests
from tiny_models import tiny_qwen3_moe

from mcore_rl.rollout.server import ServerThread, build_server

HF = tiny_qwen3_moe(max_position_embeddings=64)


@pytest.fixture(scope="module")
def server():
    thread = ServerThread(build_server(dict(HF), max_running_requests=8, max_queued_requests=32))
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    """A server with the tiny ChatML tokenizer (every character is at most one token: the longest entry is 12)."""
    from mcore_rl.data.tokenizer import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(str(path))
    thread = ServerThread(build_server(dict(HF), tokenizer=str(path)))
    yield thread
    thread.stop()


def post(server, route: str, body=None, **kwargs) -> requests.Response:
    return requests.post(server.url + route, json=body if body is not None else {}, timeout=60, **kwargs)


def message(answer: requests.Response) -> str:
    payload = answer.json()
    return payload["error"]["message"] if "error" in payload else payload["message"]


def test_a_body_over_the_limit_is_refused_naming_the_flag() -> None:
    thread = ServerThread(build_server(dict(HF), max_request_bytes=1 << 20))
    try:
        big = {"input_ids": [1] * 400_000}  # about 1.2 MB of JSON
        answer = post(thread, "/generate", big)
        assert answer.status_code == 400 and "--max-request-bytes" in message(answer), answer.text

        def chunks():  # no Content-Length: refused once the body passes the limit
            yield b'{"input_ids": [1'
            for _ in range(100):
                yield b", 1" * 5000
            yield b"]}"

        chunked = requests.post(thread.url + "/generate", data=chunks(), timeout=60)
        assert chunked.status_code == 400 and "--max-request-bytes" in message(chunked)
        assert post(thread, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}).ok
    finally:
        thread.stop()


def test_health_answers_while_a_50_mb_text_is_refused(text_server) -> None:
    done: dict = {}
    body = {"text": "a" * 50_000_000, "sampling_params": {"max_new_tokens": 1}}
    sender = threading.Thread(target=lambda: done.update(answer=post(text_server, "/generate", body)))
    sender.start()
    try:
        # the event loop never tokenizes: /health answers while the request is read, parsed and refused
        assert requests.get(text_server.url + "/health", timeout=30).status_code == 200
    finally:
        sender.join(timeout=120)
    answer = done["answer"]
    assert answer.status_code == 400
    assert "50000000 characters" in message(answer) and "--context-length" in message(answer)
    ok = post(text_server, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["prompt_tokens"] > 0


@pytest.mark.parametrize(
    "body, expected",
    [
        # n samples of a prompt run together: no more than --max-running-requests (8 here)
        ({"input_ids": [1], "sampling_params": {"n": 9, "max_new_tokens": 1}}, "--max-running-requests"),
        ({"input_ids": [1], "sampling_params": {"n": 200_000, "max_new_tokens": 1}}, "--max-running-requests"),
        # SGLang's own check: prompt + max_new_tokens within the context (64 here)
        ({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 55}}, "--context-length"),
        # a batch holds no more sequences than the server queues (--max-queued-requests 32 here)
        ({"input_ids": [[1]] * 33, "sampling_params": {"max_new_tokens": 1}}, "--max-queued-requests"),
        ({"input_ids": [[1]] * 5, "sampling_params": {"n": 7, "max_new_tokens": 1}}, "--max-queued-requests"),
    ],
)
def test_request_bounds_are_400s_naming_the_flag(server, body, expected) -> None:
    answer = post(server, "/generate", body)
    assert answer.status_code == 400 and expected in message(answer), answer.text


def test_requests_at_the_bounds_are_served(server) -> None:
    at_n = post(server, "/generate", {"input_ids": [1], "sampling_params": {"n": 8, "max_new_tokens": 1}})
    assert at_n.status_code == 200 and len(at_n.json()) == 8
    at_context = post(server, "/generate", {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 54}})
    assert at_context.status_code == 200
    at_queue = post(server, "/generate", {"input_ids": [[1]] * 32, "sampling_params": {"max_new_tokens": 1}})
    assert at_queue.status_code == 200 and len(at_queue.json()) == 32


GOOD = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
        (b'{"input_ids": [1], "rid": "\xff\xfe"}', "not valid UTF-8"),
        (b'{"input_ids": [1], "sampling_params": {"temperature": Infinity}}', "sampling_params.temperature=inf"),
        (b'{"input_ids": [1], "sampling_params": {"top_p": NaN}}', "sampling_params.top_p=nan"),
    ],
)
def test_raw_bodies_that_used_to_be_500s_are_400s(server, raw, expected) -> None:
    answer = requests.post(server.url + "/generate", data=raw, timeout=60)
    assert answer.status_code == 400 and expected in message(answer), answer.text


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"sampling_params": {"stop": 5}}, "sampling_params.stop=5"),
        ({"sampling_params": {"stop_token_ids": 5}}, "sampling_params.stop_token_ids=5"),
        ({"sampling_params": {"stop_token_ids": [True]}}, "sampling_params.stop_token_ids"),
        ({"sampling_params": {"stop": ["x"] * 33}}, "at most 32"),
        ({"sampling_params": {"sampling_seed": 2**64}}, "sampling_params.sampling_seed"),
        ({"sampling_params": {"sampling_seed": -(2**63) - 1}}, "sampling_params.sampling_seed"),
        ({"sampling_params": {"temperature": 10**400}}, "sampling_params.temperature"),
        ({"stream": "yes"}, "stream='yes'"),
        ({"return_logprob": "yes"}, "return_logprob='yes'"),
        ({"return_routed_experts": 1}, "return_routed_experts=1"),
        ({"rid": 5}, "rid=5"),
        ({"rid": ["a", 7], "input_ids": [[1], [2]]}, "rid=['a', 7]"),
        ({"text": None, "input_ids": None}, "give exactly one of input_ids"),
    ],
)
def test_bad_values_are_400s_naming_the_key(server, change, expected) -> None:
    body = {**GOOD, **change}
    if "sampling_params" in change:
        body["sampling_params"] = {**GOOD["sampling_params"], **change["sampling_params"]}
    answer = post(server, "/generate", body)
    assert answer.status_code == 400 and expected in message(answer), answer.text


def test_other_routes_refuse_bad_values_with_400(server) -> None:
    name = "model.norm.weight"
    for body in ({"name": name, "truncate_size": "abc"}, {"name": name, "truncate_size": -1}):
        answer = post(server, "/get_weights_by_name", body)
        assert answer.status_code == 400 and "truncate_size" in message(answer), answer.text
    query = requests.get(server.url + "/get_weights_by_name", params={"name": name, "truncate_size": "2"}, timeout=60)
    assert query.status_code == 200 and len(query.json()) == 2
    for route, body, key in (
        ("/abort_request", {"abort_all": "yes"}, "abort_all"),
        ("/abort_request", {"rid": 5}, "rid"),
        ("/release_memory_occupation", {"tags": [[1]]}, "memory tags"),
        ("/begin_weight_update", [], "JSON object"),
    ):
        answer = post(server, route, body)
        assert answer.status_code == 400 and key in message(answer), answer.text
    assert requests.get(server.url + "/flush_cache?timeout=abc", timeout=60).status_code == 400


def test_abort_request_works_for_everyone_after_a_bad_rid(server) -> None:
    """A non-string rid once entered the queue and broke /abort_request for every client (rid.startswith)."""
    assert post(server, "/generate", {**GOOD, "rid": {"x": 1}}).status_code == 400
    assert post(server, "/pause_generation", {"mode": "in_place"}).ok
    try:
        waiting = threading.Thread(target=post, args=(server, "/generate", {**GOOD, "rid": 5}))
        waiting.start()
        waiting.join(timeout=10)  # refused at once; before the fix it waited in the paused queue
        assert post(server, "/abort_request", {"rid": "someone-else"}).status_code == 200
        assert post(server, "/abort_request", {"abort_all": True}).status_code == 200
    finally:
        assert post(server, "/continue_generation").ok


def test_a_tiny_temperature_samples_greedily_with_finite_logprobs(server) -> None:
    """SGLang treats temperature < 1e-6 as greedy; 1e-40 once gave NaN logprobs (and a body that is not JSON)."""
    body = {
        "input_ids": [3, 4, 5],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
    }
    tiny = post(server, "/generate", {**body, "sampling_params": {**body["sampling_params"], "temperature": 1e-40}})
    greedy = post(server, "/generate", {**body, "sampling_params": {**body["sampling_params"], "temperature": 0}})
    assert tiny.status_code == 200 and "NaN" not in tiny.text
    assert tiny.json()["output_ids"] == greedy.json()["output_ids"]
    logprobs = [entry[0] for entry in tiny.json()["meta_info"]["output_token_logprobs"]]
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)


def test_a_failing_prefill_answers_every_request_with_a_500() -> None:
    """num_experts_per_tok > num_experts: every forward raises. The sequences the failed prefill had taken off the
    queue are finished with the error (they once waited forever), and the server keeps answering."""
    thread = ServerThread(build_server(tiny_qwen3_moe(num_experts_per_tok=8), max_running_requests=4))
    try:
        results: list = []
        bodies = [{"input_ids": [1, 2, k], "sampling_params": {"max_new_tokens": 2, "n": 3}} for k in range(3)]
        senders = [threading.Thread(target=lambda b=b: results.append(post(thread, "/generate", b))) for b in bodies]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(timeout=120)
        assert len(results) == 3, "a request of the failed prefill got no answer"
        for answer in results:
            assert answer.status_code == 500 and "selected index k out of range" in message(answer), answer.text
        streamed = requests.post(thread.url + "/generate", json={**bodies[0], "stream": True}, timeout=60)
        chunks = [line for line in streamed.iter_lines() if line]
        assert chunks[-1] == b"data: [DONE]" and b'"status_code": 500' in chunks[-2]
    finally:
        thread.stop()
