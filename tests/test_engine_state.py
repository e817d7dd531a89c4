"""The engine pool's health probes and memory bookkeeping (controller/engine_state.py) against an HTTP double of
SGLang 0.5.23's semantics: /health generates a token (answers after a delay) and does not answer while generation is
paused; /resume_memory_occupation of a tag never released raises KeyError in the scheduler (`offload_tags.remove`),
after which the engine is dead; /release_memory_occupation while a request (a /health probe's one-token generate)
runs fails SGLang's `is_fully_idle` assertion in a scheduler handler (weight_updater.py `release_memory_occupation`),
which kills the server.

Run: `.venv/bin/pytest tests/test_engine_state.py`
"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from _http_double import serve
from aiohttp import web

from mcore_rl.controller.engine_state import MEMORY_TAGS, EngineHealth, ReleasedMemory
from mcore_rl.rollout.client import RolloutClient


class SGLangLifecycle:
    """/health, /pause_generation, /continue_generation and the memory routes, as SGLang answers them."""

    def __init__(self, health_delay_s: float = 0.05) -> None:
        self.health_delay_s = health_delay_s
        self.paused = asyncio.Event()
        self.probes = 0
        self.offload_tags: set[str] = set()
        self.dead = False
        self.probing = 0  #: /health generates running now
        self.probe_started = threading.Event()
        #: a probe waits (at most this long) for a release to arrive while it runs: forces the order the test needs
        self.probe_waits_for_release_s = 0.0
        self.released = asyncio.Event()

    async def health(self, request: web.Request) -> web.Response:
        self.probes += 1
        if self.dead:
            return web.Response(status=503)
        self.probing += 1
        self.probe_started.set()
        try:
            while self.paused.is_set():  # the health request waits in the scheduler's queue like any other
                await asyncio.sleep(0.01)
            await asyncio.sleep(self.health_delay_s)  # SGLang: at least 1 s (HEALTH_CHECK_TIMEOUT loop)
            if self.probe_waits_for_release_s:
                try:
                    await asyncio.wait_for(self.released.wait(), self.probe_waits_for_release_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.probing -= 1
        return web.Response(status=503 if self.dead else 200)

    async def pause(self, request: web.Request) -> web.Response:
        self.paused.set()
        return web.json_response({"status": "ok"})

    async def release(self, request: web.Request) -> web.Response:
        self.released.set()
        if self.probing:  # `assert self.is_fully_idle(...)` in a scheduler handler: the server dies
            self.dead = True
            return web.Response(status=500, text="AssertionError: release_memory_occupation should be called only "
                                "when server is idle.")  # fmt: skip
        self.offload_tags.update((await request.json())["tags"])
        return web.json_response({})

    async def resume(self, request: web.Request) -> web.Response:
        for tag in (await request.json())["tags"]:
            try:
                self.offload_tags.remove(tag)
            except KeyError:
                self.dead = True  # the scheduler raised; SGLang's process dies
                return web.Response(status=500, text=f"KeyError: {tag!r}")
        return web.json_response({})


@pytest.fixture
def engine():
    double = SGLangLifecycle()
    app = web.Application()
    app.router.add_get("/health", double.health)
    app.router.add_post("/pause_generation", double.pause)
    app.router.add_post("/release_memory_occupation", double.release)
    app.router.add_post("/resume_memory_occupation", double.resume)
    with serve(app) as (url, loop):
        client = RolloutClient(url, engine="sglang")
        yield double, client, url
        client.close()
        loop.call_soon_threadsafe(double.paused.clear)


def test_no_probe_while_a_push_holds_generation_paused(engine) -> None:
    double, client, url = engine
    health = EngineHealth(client, timeout_s=0.3, failures=1)
    with health.quiet("weight push"):
        client.post(url, "/pause_generation", {"mode": "abort"})
        for _ in range(3):  # the monitor's ticks during a long push
            assert client.run(health.dead([url])) == []
    assert double.probes == 0, "a probe during the push would wait in the paused scheduler and time out"


def test_one_failed_probe_does_not_kill_an_engine(engine) -> None:
    double, client, url = engine
    health = EngineHealth(client, timeout_s=0.3, failures=3)
    double.health_delay_s = 1.0  # slower than the probe's limit (a busy engine)
    assert client.run(health.dead([url])) == []
    assert client.run(health.dead([url])) == []
    double.health_delay_s = 0.0
    assert client.run(health.dead([url])) == [], "a good probe resets the count"
    double.health_delay_s = 1.0
    verdicts = [client.run(health.dead([url])) for _ in range(3)]
    assert verdicts == [[], [], [url]], "dead after three failed probes in a row"


def test_an_engine_whose_port_refuses_is_dead_at_once(engine) -> None:
    _, client, _ = engine
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{s.getsockname()[1]}"
    health = EngineHealth(client, timeout_s=1.0, failures=3)
    assert client.run(health.dead([gone])) == [gone]


def test_colocated_start_resumes_only_what_was_released(engine) -> None:
    """The colocated hand-over at start (resume weights -> push -> resume KV cache) on an engine that never released
    anything: no call reaches it; after a release of every tag (CUDA graphs too) each resume takes back its own."""
    double, client, url = engine
    memory = ReleasedMemory(client, EngineHealth(client, timeout_s=1.0, failures=1))
    memory.resume([url], ["weights"])
    memory.resume([url], ["kv_cache", "cuda_graph"])
    assert not double.dead, "resuming tags never released kills SGLang's scheduler"
    memory.release([url])
    assert double.offload_tags == set(MEMORY_TAGS) == {"weights", "kv_cache", "cuda_graph"}
    memory.resume([url], ["weights"])
    assert double.offload_tags == {"kv_cache", "cuda_graph"}
    memory.resume([url], ["kv_cache", "cuda_graph"])
    assert double.offload_tags == set() and not double.dead


def test_released_memory_holds_probes_off(engine) -> None:
    """A probe after a release would run a forward on released weights."""
    double, client, url = engine
    health = EngineHealth(client, timeout_s=1.0, failures=1)
    memory = ReleasedMemory(client, health)
    memory.release([url])
    assert client.run(health.dead([url])) == [] and double.probes == 0
    memory.resume([url], ["weights", "kv_cache", "cuda_graph"])
    assert client.run(health.dead([url])) == [] and double.probes == 1


def test_a_probe_on_a_closed_session_is_a_shutdown_not_an_error(engine) -> None:
    """On Ctrl-C the pool closes its aiohttp session while the monitor probes; aiohttp raises
    RuntimeError('Session is closed'), which escaped the probes' gather. It is a shutdown: no error, no verdict."""
    double, client, url = engine
    health = EngineHealth(client, timeout_s=1.0, failures=1)
    assert client.run(health.dead([url])) == []  # opens the session
    session = client._session
    client.run(session.close())
    try:
        assert client.run(health.dead([url])) == [], "a closed session says nothing about the engine"
    finally:
        client._session = None  # the fixture's close() must not close it twice


def test_memory_is_released_only_once_no_probe_runs(engine) -> None:
    """A probe started by the monitor just before the colocated hand-over to training is still generating its token
    when the release would go out. Before, the release only stopped new probes, reached SGLang while the probe ran,
    and the scheduler's idle assertion killed the engine (here: the double's release answered 500, dead). Now the
    release waits for the running probe to end. The double's probe waits up to 3 s for a release to arrive, so the
    unfixed order fails every time; fixed, the release waits out those 3 s."""
    double, client, url = engine
    double.probe_waits_for_release_s = 3.0
    health = EngineHealth(client, timeout_s=30.0, failures=1)
    memory = ReleasedMemory(client, health)
    probe = asyncio.run_coroutine_threadsafe(health.dead([url]), client._loop)
    assert double.probe_started.wait(30)
    memory.release([url])
    assert probe.result(60) == []
    assert not double.dead and double.offload_tags == set(MEMORY_TAGS)
