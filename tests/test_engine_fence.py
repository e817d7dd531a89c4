"""The control calls around a weight push (controller/engine_fence.py) against an HTTP double of SGLang 0.5.23's
session rules (`scheduler_components/weight_updater.py`, `entrypoints/http_server.py`): begin on an open session is
refused with 400 "already open"; end closes the session whatever was loaded; there is no abort route (404);
/update_weights_from_disk without a load_format uses the server's (dummy), which the disk loader refuses; /flush_cache
is refused while a request runs unless generation is paused. Also an engine that accepts connections and never
answers (SIGSTOPped).

Run: `.venv/bin/pytest tests/test_engine_fence.py`
"""

from __future__ import annotations

import socket

import pytest
from _http_double import serve
from aiohttp import web

from mcore_rl.controller.engine_fence import EngineFence
from mcore_rl.rollout.client import RolloutClient


class SGLangSession:
    def __init__(self) -> None:
        self.session_open = False
        self.paused = False
        self.running = 1  # a request in flight: /flush_cache is refused unless paused (SGLang's is_fully_idle)
        self.calls: list[str] = []

    @staticmethod
    def _answer(success: bool, message: str) -> web.Response:
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    async def route(self, request: web.Request) -> web.Response:
        route = request.path
        self.calls.append(route)
        body = await request.json() if request.can_read_body else {}
        if route == "/pause_generation":
            self.paused = body.get("mode") in ("abort", "retract")  # in_place keeps the running batch
            return web.json_response({"status": "ok"})
        if route == "/continue_generation":
            self.paused = False
            return web.json_response({"status": "ok"})
        if route == "/begin_weight_update":
            if self.session_open:
                return self._answer(False, "a weight-update session is already open; call end_weight_update() first")
            self.session_open = True
            return self._answer(True, "Success")
        if route == "/end_weight_update":
            if not self.session_open:
                return self._answer(False, "no weight-update session is open; call begin_weight_update() first")
            self.session_open = False
            return self._answer(True, "Success")
        if route == "/update_weights_from_disk":
            if body.get("load_format") in (None, "dummy"):  # the server's own load_format: dummy
                return self._answer(False, "Failed to get model loader: DummyModelLoader.")
            return self._answer(True, "Succeeded to update model weights.")
        if route == "/flush_cache":
            if self.running and not self.paused:
                return web.Response(status=400, text="Flush cache failed.\n")
            return web.Response(status=200, text="Cache flushed.\n")
        raise web.HTTPNotFound()


@pytest.fixture
def engine():
    double = SGLangSession()
    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", double.route)
    with serve(app) as (url, _):
        client = RolloutClient(url, engine="sglang")
        yield double, client, url
        client.close()


def _fence(client: RolloutClient, replaced: list | None = None) -> EngineFence:
    return EngineFence(client, "abort", lambda url, why: (replaced if replaced is not None else []).append(url),
                       control_timeout_s=1.0, update_timeout_s=5.0)  # fmt: skip


def test_a_failed_push_does_not_wedge_the_next(engine) -> None:
    """A sender died mid-push: the session is closed, so the next push can begin (SGLang refuses a second begin)."""
    double, client, url = engine
    fence = _fence(client)
    live, paused = fence.open([url])
    assert live == [url] and double.session_open
    fence.close(live)  # the push failed
    fence.resume(paused)
    assert not double.session_open
    live, paused = fence.open([url])
    fence.commit(live)
    fence.resume(paused)
    assert double.calls[-3:] == ["/end_weight_update", "/flush_cache", "/continue_generation"]


def test_a_session_left_open_is_closed_and_begun_again(engine) -> None:
    """A controller that died mid-push left the engine's session open."""
    double, client, url = engine
    double.session_open = True
    live, _ = _fence(client).open([url])
    assert live == [url] and double.session_open
    assert double.calls.count("/begin_weight_update") == 2


def test_a_hung_engine_is_replaced_and_the_push_goes_on(engine) -> None:
    """An engine that accepts connections and never answers (SIGSTOPped) is handed to the pool for replacement
    instead of failing the push with a raw connection error."""
    double, client, url = engine
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)  # the kernel completes connections; nobody reads them
        hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        replaced: list[str] = []
        live, paused = _fence(client, replaced).open([hung_url, url])
    assert replaced == [hung_url] and live == [url] and paused == [url]


def test_disk_update_names_its_load_format(engine) -> None:
    """Engines start with load_format=dummy; SGLang's disk loader refuses a request that does not name one."""
    double, client, url = engine
    fence = _fence(client)
    live, paused = fence.open([url])
    fence.update_from_disk(live, "/run/weights/v1", 1)
    fence.commit(live)
    fence.resume(paused)


def test_commit_flushes_the_cache_while_generation_is_paused(engine) -> None:
    """The radix cache holds KV computed by the old weights: flushed after every commit, before generation
    continues (SGLang refuses the flush while a request runs and generation is not paused)."""
    double, client, url = engine
    fence = _fence(client)
    live, paused = fence.open([url])
    fence.commit(live)
    assert double.calls.index("/flush_cache") > double.calls.index("/end_weight_update")
    assert "/continue_generation" not in double.calls
    fence.resume(paused)


def test_pause_mode_with_sglang_is_never_none() -> None:
    """With none (or in_place) SGLang's queued requests run between buckets on half-updated weights, and its radix
    cache cannot be flushed after the commit (SGLang flushes only with no request running)."""
    from mcore_rl.config import SyncConfig
    from mcore_rl.config.checks import ConfigError

    assert SyncConfig().pause_mode_for("sglang") == "abort" and SyncConfig().pause_mode_for("hf") == "none"
    assert SyncConfig(pause_mode="retract").pause_mode_for("sglang") == "retract"
    for mode in ("none", "in_place"):
        with pytest.raises(ConfigError, match="sync.pause_mode='.*' is invalid: expected abort, retract or auto"):
            SyncConfig(pause_mode=mode).pause_mode_for("sglang")


def test_run_config_with_sglang_and_pause_none_is_refused_before_start() -> None:
    from tiny_models import tiny_qwen3_moe

    from mcore_rl.config import RLConfig
    from mcore_rl.config.checks import ConfigError

    cfg = RLConfig()
    cfg.model.hf_config = tiny_qwen3_moe()
    cfg.rollout.engine, cfg.sync.pause_mode = "sglang", "none"
    with pytest.raises(ConfigError, match="sync.pause_mode='none' is invalid"):
        cfg.validate()
