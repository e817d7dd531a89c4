"""A push through the disk transport leaves the engine's weights post-processed once, as SGLang 0.5.23 counts it.

SGLang's `/begin_weight_update` restores in-place-processed weights to their loaded form
(`model_runner_components/weight_updater.py:312`, `restore_weights_before_loading`); its `/end_weight_update` runs
`post_load_weights` and `postprocess_weights` unless a distributed or tensor update loaded weights in the session
(`scheduler_components/weight_updater.py:330`: `run_post_load = not self._session.loaded_weights`; only those two
routes set it, :221 and :253); `/update_weights_from_disk` loads through the model loader, which post-processes what
it loads, and does not set `loaded_weights`. A disk update inside a session is therefore post-processed twice: at
the load and again at `/end_weight_update` (for FP8 or other packed weights, a second transform of weights already
transformed). The double below keeps exactly that bookkeeping (`processed`: how many times the served weights have
been post-processed since they were loaded); the project's WeightSync drives a disk push into it.

Run: `.venv/bin/pytest tests/test_disk_push.py`
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from _http_double import serve
from aiohttp import web

from mcore_rl.config import RolloutConfig, SyncConfig
from mcore_rl.controller.engine_fence import EngineFence
from mcore_rl.controller.engine_state import EngineHealth
from mcore_rl.controller.weight_sync import WeightSync
from mcore_rl.rollout.client import RolloutClient


class SGLangWeights:
    """SGLang 0.5.23's session and post-processing bookkeeping (see the module docstring), per engine."""

    def __init__(self) -> None:
        self.session: dict | None = None
        self.version = "0"
        self.processed = 1  #: post-processings of the served weights since they were loaded (1: ready to serve)
        self.calls: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        for route, handler in {
            "/pause_generation": self.ok,
            "/continue_generation": self.ok,
            "/flush_cache": self.ok,
            "/begin_weight_update": self.begin,
            "/end_weight_update": self.end,
            "/update_weights_from_disk": self.disk,
        }.items():
            app.router.add_post(route, handler)
        return app

    @staticmethod
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": "Success"})

    async def begin(self, request: web.Request) -> web.Response:
        if self.session is not None:
            return web.json_response({"success": False, "message": "already open"}, status=400)
        self.session = {"loaded_weights": False}
        self.processed -= 1  # restore_weights_before_loading
        self.calls.append("begin")
        return await self.ok(request)

    async def end(self, request: web.Request) -> web.Response:
        if self.session is None:
            return web.json_response({"success": False, "message": "no session"}, status=400)
        if not self.session["loaded_weights"]:  # run_post_load
            self.processed += 1
        self.session = None
        self.calls.append("end")
        return await self.ok(request)

    async def disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.processed = 1  # new weights, which the loader post-processes once
        self.calls.append("disk")
        self.version = str(body.get("weight_version", self.version))  # the session's loaded_weights stays as is
        return await self.ok(request)


class DiskWriter:
    """Stands in for the actor ranks' `sync_send` with the disk transport (the files are not what this checks)."""

    handles: list = []

    def call(self, method: Any, request: Any) -> list[dict]:  # ActorGroup.call(MegatronActor.sync_send, request)
        assert (method.__name__, request.transport) == ("sync_send", "disk")
        return [{"bytes": 0}]


def test_a_disk_push_post_processes_the_weights_once() -> None:
    engines = [SGLangWeights(), SGLangWeights()]
    client = RolloutClient("http://127.0.0.1:9", engine="sglang")
    try:
        with serve(engines[0].app()) as (url0, _), serve(engines[1].app()) as (url1, _):
            urls = [url0, url1]
            pool = SimpleNamespace(
                client=client, health=EngineHealth(client, 5.0, 3), replace=lambda url, why: False,
                live_urls=list(urls), pending=set(), urls=list(urls), api_key=None, weight_version=None,
                wait_for_restarts=lambda: None, admit_pending=lambda: None, engines=[],
            )  # fmt: skip
            sync = WeightSync.__new__(WeightSync)
            sync.actor, sync.pool = DiskWriter(), pool
            sync.cfg, sync.rollout = SyncConfig(transport="disk", timeout_s=10.0), RolloutConfig(engine="sglang")
            sync.fence = EngineFence(client, "abort", pool.replace, control_timeout_s=5.0, update_timeout_s=10.0)
            sync.backend, sync.ranks_per_engine, sync.run_dir, sync.colocation = "gloo", 1, "/nonexistent", None
            sync._lock, sync._connected, sync.dirty, sync.version, sync.actor_version = (
                threading.RLock(),
                [],
                set(),
                None,
                None,
            )
            sync.step, sync.last_stats = None, []
            sync.push(3)
            for engine in engines:
                assert engine.processed == 1, f"post-processed {engine.processed} times after {engine.calls}"
                assert engine.version == "3" and engine.session is None
    finally:
        client.close()
