"""The control calls around a weight push (controller/engine_fence.py) against an HTTP double of SGLang 0.5.23's
session rules (`scheduler_components/weight_updater.py`, `entrypoints/http_server.py`): begin on an open session is
refused with 400 "already open"; end closes the session whatever was loaded; there is no abort route (404);
/update_weights_from_disk without a load_format uses the server's (dummy), which the disk loader refuses; /flush_cache
is refused while a request runs unless generation is paused; each /update_weights_from_tensor bucket is loaded into
the live weights and labels the engine with its weight_version at once (weight_updater.py:250-258, as :219-226 for
the distributed route); /generate waits while generation is paused (tokenizer_manager.py:938-939) and answers with the
engine's label. Also an engine that accepts connections and never answers (SIGSTOPped), and the project's WeightSync
driving a push that fails at bucket k of n.

Run: `.venv/bin/pytest tests/test_engine_fence.py`
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from _http_double import serve
from aiohttp import web

from mcore_rl.config import RolloutConfig, SyncConfig
from mcore_rl.controller.engine_fence import EngineFence, FenceError
from mcore_rl.controller.engine_state import EngineHealth
from mcore_rl.controller.weight_sync import WeightSync
from mcore_rl.rollout.client import RolloutClient, RolloutRequestError

BUCKETS = 4  #: buckets of a push in the WeightSync tests


class SGLangSession:
    def __init__(self, pause_barrier: threading.Barrier | None = None) -> None:
        self.session_open = False
        self.paused = False
        self.holding = False  #: new requests wait (SGLang's tokenizer manager is paused)
        self.running = 1  # a request in flight: /flush_cache is refused unless paused (SGLang's is_fully_idle)
        self.calls: list[str] = []
        #: the engine's weights, bucket by bucket: the version each bucket was last loaded from
        self.weights = ["1"] * BUCKETS
        self.label = "1"  #: the weight_version it answers with
        self.fail_bucket: tuple[str, int] | None = None  #: (version, bucket): refused once
        self.served: list[tuple[str, tuple[str, ...], list[str]]] = []  #: (label, weights, calls so far) per answer
        self.waiting = threading.Event()  #: a /generate is waiting for generation to continue
        self.refuse: dict[str, int] = {}  #: route -> HTTP status it answers once
        #: every engine's /pause_generation waits here for the others' (the pauses must be concurrent)
        self.pause_barrier = pause_barrier
        self.pauses_alone = 0
        self._unpaused: asyncio.Event | None = None
        self.released: set[str] = set()  #: memory tags released (/release_memory_occupation)
        self.continued_without: list[set[str]] = []  #: per /continue_generation: the tags still released then

    @staticmethod
    def _answer(success: bool, message: str) -> web.Response:
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    async def route(self, request: web.Request) -> web.Response:
        route = request.path
        self.calls.append(route)
        body = await request.json() if request.can_read_body else {}
        if self._unpaused is None:
            self._unpaused = asyncio.Event()
        if route in self.refuse:
            return web.Response(status=self.refuse.pop(route), text="injected refusal")
        if route == "/pause_generation":
            if self.pause_barrier is not None:
                try:
                    await asyncio.to_thread(self.pause_barrier.wait)
                except threading.BrokenBarrierError:
                    self.pauses_alone += 1
            self.paused = body.get("mode") in ("abort", "retract")  # in_place keeps the running batch
            self.holding = True  # SGLang's tokenizer holds new requests in every mode (is_pause)
            self._unpaused.clear()
            return web.json_response({"status": "ok"})
        if route in ("/release_memory_occupation", "/resume_memory_occupation"):
            tags = set(body["tags"])
            self.released = self.released | tags if "release" in route else self.released - tags
            return web.json_response({})
        if route == "/continue_generation":
            self.continued_without.append(set(self.released))
            self.paused = self.holding = False
            self._unpaused.set()
            return web.json_response({"status": "ok"})
        if route == "/generate":
            if self.holding:
                self.waiting.set()
                await self._unpaused.wait()
            self.served.append((self.label, tuple(self.weights), list(self.calls)))
            meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 7, None]],
                    "weight_version": self.label}  # fmt: skip
            return web.json_response({"output_ids": [7], "meta_info": meta})
        if route == "/update_weights_from_tensor":
            if not self.session_open:
                msg = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
                return self._answer(False, msg)
            version, bucket = str(body["weight_version"]), body["bucket"]
            if self.fail_bucket == (version, bucket):
                self.fail_bucket = None
                return self._answer(False, "Failed to update weights: injected fault")
            self.weights[bucket] = version
            self.label = version  # record_weight_version_after_update, after every successful bucket
            return self._answer(True, "Success")
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


@contextlib.contextmanager
def _engines(count: int, barrier: threading.Barrier | None = None):
    """`count` doubles on their own ports and one client for all (the fence posts to each engine's URL)."""
    with contextlib.ExitStack() as stack:
        doubles, urls = [], []
        for _ in range(count):
            double = SGLangSession(barrier)
            app = web.Application()
            app.router.add_route("POST", "/{tail:.*}", double.route)
            url, _ = stack.enter_context(serve(app))
            doubles.append(double)
            urls.append(url)
        client = RolloutClient(urls[0], engine="sglang")
        stack.callback(client.close)
        yield doubles, client, urls


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


def test_a_refused_begin_leaves_no_engine_paused() -> None:
    """An engine answering /begin_weight_update with 500: before, the RolloutRequestError escaped `open` and every
    engine paused so far stayed paused (and the one begun kept its session open). Now each is continued, the
    session begun is closed, and the push fails with FenceError (which WeightSync.push retries)."""
    with _engines(2) as (doubles, client, urls):
        doubles[1].refuse["/begin_weight_update"] = 500
        with pytest.raises(FenceError, match=f"engine {urls[1]} refused the weight push's control calls"):
            _fence(client).open(urls)
        for double in doubles:
            assert not double.holding and not double.session_open, double.calls
            assert double.calls[-1] == "/continue_generation", double.calls


def test_a_refused_pause_leaves_no_engine_paused() -> None:
    with _engines(2) as (doubles, client, urls):
        doubles[0].refuse["/pause_generation"] = 503
        with pytest.raises(FenceError, match=f"engine {urls[0]} refused"):
            _fence(client).open(urls)
        assert not doubles[1].holding and doubles[1].calls[-1] == "/continue_generation"
        assert "/begin_weight_update" not in doubles[0].calls + doubles[1].calls


def test_engines_are_paused_concurrently() -> None:
    """SGLang's abort-mode pause returns only once its requests are gone (abort_all, then 1 s sleeps): the fence
    pauses every engine at once. Each double's pause waits (at most 10 s) for the other's to arrive; before, the
    pauses went one after another, so the first waited out the 10 s alone."""
    barrier = threading.Barrier(2, timeout=10.0)
    with _engines(2, barrier) as (doubles, client, urls):
        fence = _fence(client)
        fence.control_timeout_s = 30.0
        live, paused = fence.open(urls)
        assert live == urls and paused == urls
        assert [d.pauses_alone for d in doubles] == [0, 0]


class BucketSender:
    """Stands in for the actor ranks' `sync_send` (the WeightSync's `actor.call`): posts the push's BUCKETS buckets
    to every engine as /update_weights_from_tensor, each carrying the push's weight_version (as actor/sync_sender.py
    sends every bucket), and fails as a rank does when an engine refuses one. `on_failure` runs before the failure is
    raised (a request reaching the engine while the failed push is being cleaned up)."""

    def __init__(self, client: RolloutClient, on_failure: Any = None) -> None:
        self.client, self.on_failure = client, on_failure
        self.handles: list[Any] = []

    def call(self, method: Any, *args: Any) -> list[dict]:  # ActorGroup.call, given a MegatronActor method
        if method.__name__ == "offload":  # the colocated actor moves its state to host memory
            return [{"bytes": 0}]
        assert method.__name__ == "sync_send", method
        return self.sync_send(*args)

    def sync_send(self, request: Any) -> list[dict]:
        version, transport, urls = request.version, request.transport, request.engine_urls
        assert transport == "tensor"
        try:
            for url in urls:
                for bucket in range(BUCKETS):
                    body = {"bucket": bucket, "weight_version": str(version)}
                    self.client.post(url, "/update_weights_from_tensor", body, 5.0)
        except RolloutRequestError:
            if self.on_failure is not None:
                self.on_failure()
            raise
        return [{"bytes": 0}]


def _weight_sync(client: RolloutClient, urls: list[str], sender: BucketSender) -> WeightSync:
    """The project's WeightSync (push, its retry, the fence) over the doubles; the actor ranks are `sender`."""
    pool = SimpleNamespace(
        client=client, health=EngineHealth(client, 5.0, 3), replace=lambda url, why: False, live_urls=list(urls),
        pending=set(), urls=list(urls), api_key=None, weight_version=1, wait_for_restarts=lambda: None,
        admit_pending=lambda: None, engines=[],
    )  # fmt: skip
    sync = WeightSync.__new__(WeightSync)
    sync.actor, sync.pool = sender, pool
    sync.cfg, sync.rollout = SyncConfig(transport="tensor", timeout_s=10.0), RolloutConfig(engine="sglang")
    sync.fence = EngineFence(client, "abort", pool.replace, control_timeout_s=5.0, update_timeout_s=10.0)
    sync.backend, sync.ranks_per_engine, sync.run_dir, sync.colocation = "gloo", 1, "/nonexistent", None
    sync.version = sync.actor_version = 1
    sync.dirty, sync.step, sync.last_stats = set(), None, []
    sync._lock, sync._connected = threading.RLock(), []
    return sync


@pytest.mark.parametrize("bucket", [1, BUCKETS - 1])
def test_no_request_is_served_from_a_half_updated_engine(bucket: int) -> None:
    """A push of version 2 fails at bucket k of n on an engine that behaves as SGLang 0.5.23 (labelled 2 after the
    first bucket, no /abort_weight_update). A request reaches it while the failed push is cleaned up. Before, the
    fence closed the session with /end_weight_update and continued generation: the request was served by weights
    half of version 1 and half of 2, labelled 2. Now the engine stays paused until the retry commits, and the
    request is served by complete version-2 weights."""
    with _engines(1) as ((double,), client, urls):
        answers: list[Any] = []

        def request_arrives() -> None:
            other = RolloutClient(urls[0], engine="sglang")
            thread = threading.Thread(target=lambda: answers.append(other.generate_samples([[1]], 1, {})))
            thread.start()
            assert double.waiting.wait(60)  # it is held by the pause, as SGLang holds it
            request.update(thread=thread, client=other)

        request: dict[str, Any] = {}
        double.fail_bucket = ("2", bucket)
        sync = _weight_sync(client, urls, BucketSender(client, on_failure=request_arrives))
        sync.push(2)
        request["thread"].join(30)
        request["client"].close()
        assert double.weights == ["2"] * BUCKETS and double.label == "2" and sync.version == 2
        assert double.served, "the request was answered"
        for label, weights, calls in double.served:
            assert set(weights) == {label}, f"served by weights {weights} labelled {label}"
            # served only after the retry's commit: two begins, the last end after the last begin
            assert calls.count("/begin_weight_update") == 2 and calls[-1] == "/continue_generation", calls
        ((sample,),) = answers
        assert sample.weight_version == 2 and sample.weight_versions == [(2, 0, 1)]


def test_colocated_generation_continues_only_with_its_kv_cache_back() -> None:
    """The colocated hand-over to generation (ColocatedPlacement.sync_weights): engines resume their weights, the
    push refills them, the actor offloads, engines resume KV cache and CUDA graphs. Before, the push's own
    /continue_generation ran before the KV cache was back: SGLang's scheduler then runs batches with its KV pool
    and CUDA graphs released. Now generation continues after the last resume."""
    from mcore_rl.controller.engine_state import ReleasedMemory
    from mcore_rl.controller.placement import ColocatedPlacement

    with _engines(1) as ((double,), client, urls):
        sync = _weight_sync(client, urls, BucketSender(client))
        memory = ReleasedMemory(client, sync.pool.health)
        sync.pool.resume_memory = lambda tags: memory.resume(urls, tags)
        memory.release(urls)  # to_training
        placement = object.__new__(ColocatedPlacement)
        placement.cuda = False
        placement.sync_weights(sync, 2)
        assert double.label == "2" and not double.released and not double.holding
        assert double.continued_without == [set()], double.calls
