"""The router's API key: never on its command line (/proc/<pid>/cmdline is readable by every local user), and
checked by the router itself (a request without it, or with a wrong one, is refused; with it, answered).

Run: `.venv/bin/pytest tests/test_router_key.py`
"""

from __future__ import annotations

import uuid

import pytest

from mcore_rl.rollout.router import Router, _http


@pytest.fixture(scope="module")
def router():
    key = f"key-{uuid.uuid4().hex}"
    router = Router([], api_key=key)
    router.start()
    try:
        yield router
    finally:
        router.stop()


def test_the_key_is_not_on_the_router_command_line(router) -> None:
    assert router.api_key not in " ".join(router.command())
    with open(f"/proc/{router._proc.pid}/cmdline", "rb") as f:
        cmdline = f.read()
    assert cmdline, "the router's command line could not be read"
    assert router.api_key.encode() not in cmdline


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_the_router_refuses_requests_without_its_key(router, key) -> None:
    for method, route, body in (("GET", "/workers", None), ("POST", "/generate", {"text": "hi"})):
        status, answer = _http(method, router.url + route, body, api_key=key)
        assert status == 401, f"{method} {route} with key {key!r}: {status} {answer}"


def test_the_router_answers_with_its_key(router) -> None:
    status, answer = _http("GET", router.url + "/workers", api_key=router.api_key)
    assert status == 200, answer
