"""The rollout engines of a run behind sglang-router, driven through one HTTP client; dead engines are replaced.

```
EnginePool.start: N engines (CPU/GPU embedded servers as Ray actors | real SGLang servers) on loopback, one per-run
                  API key -> sglang-router in front of them -> RolloutClient(router)
generate:         client -> router -> engines (the n samples of a prompt are one request: one engine, one prefill)
weights:          pushed to every engine directly by controller/weight_sync.py (the router proxies no control call)
an engine dies:   found by the pool's /health probe (every health_check_interval_s, never during a weight push or
                  while memory is released: controller/engine_state.py) or when a request fails (client.on_failure):
                  it leaves the router (whose retries move its in-flight requests to the others), a new engine
                  starts, is synced to the current weight version, and only then joins
```
Engines start all at once (SGLang servers load weights and capture CUDA graphs for minutes each). On a multi-node Ray
cluster every engine binds its node's address (guarded by the per-run API key): the router and the actor ranks that
push weights may be on other nodes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch

from mcore_rl.config import RolloutConfig
from mcore_rl.controller.engine_state import MEMORY_TAGS, EngineHealth, ReleasedMemory
from mcore_rl.controller.placement import ray_wait, wait_scheduled
from mcore_rl.rollout.client import RolloutClient, run_api_key
from mcore_rl.rollout.sampling import Sample

#: a router that dies more often than this in one run ends it (ProcessDied naming it): something kills it on purpose
MAX_ROUTER_RESTARTS = 3

log = logging.getLogger(__name__)
#: an embedded engine's Ray actor builds its server (the model) in its constructor; the wait for its URL ends here
ENGINE_BUILD_TIMEOUT_S = 1200.0


class EmbeddedEngineActor:
    """Ray actor body: one embedded SGLang-compatible server (`mcore_rl.rollout.server`) on a loopback port."""

    def __init__(
        self,
        model: str | dict[str, Any],
        tokenizer: str | None,
        dtype: str,
        device: str,
        max_running_requests: int,
        api_key: str,
        init_seed: int,
        num_threads: int,
        bind_node_ip: bool = False,
        latency_model_s_per_token: float | None = None,
        keep_update_buffers: bool = True,
    ) -> None:
        """`bind_node_ip`: listen on this node's address (the router and the actor ranks may be on other nodes; the
        per-run API key guards it), else on 127.0.0.1. `latency_model_s_per_token`: rollout.latency_model_s_per_token
        (the engine models a GPU engine's decode latency instead of running the model; rollout/engine.py forward).
        `keep_update_buffers`: sync.keep_buffers, the engine's side of it (rollout/weight_receiver.py)."""
        from mcore_rl.metrics.startup import process_start
        from mcore_rl.rollout.server import ServerThread, build_server

        began = time.time()
        #: where this engine's start-up went (the run's startup.json)
        self._startup = {"worker start + imports": began - process_start()}
        torch.set_num_threads(max(1, num_threads))
        server = build_server(
            model,
            tokenizer=tokenizer,
            dtype=dtype,
            device=device,
            max_running_requests=max_running_requests,
            api_key=api_key,
            init_seed=init_seed,
            latency_model_s_per_token=latency_model_s_per_token,
            keep_update_buffers=keep_update_buffers,
        )
        host = ray.util.get_node_ip_address() if bind_node_ip else "127.0.0.1"
        self._thread = ServerThread(server, host, 0)
        self._startup["model load and server"] = time.time() - began

    def url(self) -> str:
        return self._thread.url

    def startup_s(self) -> dict[str, float]:
        return self._startup

    def pid(self) -> int:
        return os.getpid()


@dataclass
class Engine:
    """One rollout engine of the pool."""

    index: int
    url: str
    handle: Any  # the Ray actor that owns the server process


class EnginePool:
    """See the module docstring."""

    def __init__(
        self,
        cfg: RolloutConfig,
        *,
        model: str | dict[str, Any],
        tokenizer: str | None,
        dtype: str,
        runtime: str,
        log_dir: str,
        init_seed: int = 0,
        engine_options: Any = None,
        return_routed_experts: bool = False,
        fp8: bool = False,
        keep_update_buffers: bool = True,
    ) -> None:
        """`engine_options(index)`: extra Ray options of an embedded engine (controller/placement.py).
        `keep_update_buffers` (sync.keep_buffers): embedded engines keep their weight-update staging between syncs.
        Real SGLang engines only: `return_routed_experts` (actor.router_replay_mode=R3) starts them able to answer
        `routed_experts`; `fp8` (sync.fp8) starts them with FP8 parameters for the blockwise e4m3 weights a push
        sends."""
        self.cfg = cfg
        self.return_routed_experts, self.fp8 = return_routed_experts, fp8
        self.keep_update_buffers = keep_update_buffers
        self.engine_options = engine_options
        self.model = model
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.runtime = runtime
        self.init_seed = init_seed
        # per run: engines and router answer nobody else; MCORE_RL_API_KEY sets it (to call them while the run is
        # live; pre-flight checks its form), never a config key, which the run dir and checkpoints would keep
        self.api_key = run_api_key()
        self.weight_version: int | None = None  #: set by the weight sync after each push
        self.restarts = 0
        #: replacement engines up but not yet at the current weight version, kept out of the router
        self.pending: set[str] = set()
        #: called with a replacement engine's URL; True if it synced it (then it joins the router at once)
        self.on_engine_started: Any = None
        self._lock = threading.Lock()
        self._router_lock = threading.Lock()
        self._check_lock: asyncio.Lock | None = None
        self._restarting: dict[int, threading.Thread] = {}
        self.log_dir = log_dir
        # on a multi-node Ray cluster an engine may land on another node than the router and the senders
        self.bind_node_ip = len([n for n in ray.nodes() if n.get("Alive")]) > 1
        self.engines = [Engine(i, url, handle) for i, (url, handle) in enumerate(self._start_engines(cfg.num_engines))]
        self.router = cfg.kind.router_class()(
            [e.url for e in self.engines],
            policy=cfg.router_policy,
            api_key=self.api_key,
            log_dir=log_dir,
            request_timeout_s=cfg.request_timeout_s,
        )
        self.router.start()
        log.info("rollout engines at %s behind sglang-router at %s", ", ".join(e.url for e in self.engines),
                 self.router.url)  # fmt: skip
        self.client = RolloutClient(
            self.router.url,
            api_key=self.api_key,
            timeout_s=cfg.request_timeout_s,
            max_retries=cfg.max_retries,
            on_failure=self._check_engines,
            engine=cfg.engine,
        )
        self.health = EngineHealth(self.client, cfg.health_check_timeout_s, cfg.health_check_failures)
        self.memory = ReleasedMemory(self.client, self.health)
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, name="engine-monitor", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ engines
    def _start_engines(self, count: int, first_index: int = 0) -> list[tuple[str, Any]]:
        return self.cfg.kind.start_engines(self, list(range(first_index, first_index + count)))

    def start_embedded_engines(self, indices: list[int]) -> list[tuple[str, Any]]:
        """Embedded engines (our server inside an EmbeddedEngineActor each), all starting at once: rollout.num_cpus
        CPUs and one GPU on CUDA each, on the placement's bundles."""
        first_index, count = (indices[0] if indices else 0), len(indices)
        base = {"num_cpus": self.cfg.num_cpus, "num_gpus": 1 if self.runtime == "cuda" else 0, "max_restarts": 0}
        handles = [
            ray.remote(EmbeddedEngineActor)
            .options(**{**base, **(self.engine_options(first_index + i) if self.engine_options else {})})
            .remote(
                self.model,
                self.tokenizer,
                self.dtype,
                "cuda" if self.runtime == "cuda" else "cpu",
                self.cfg.max_running_requests,
                self.api_key,
                self.init_seed,
                max(1, int(self.cfg.num_cpus)),
                self.bind_node_ip,
                self.cfg.latency_model_s_per_token,
                self.keep_update_buffers,
            )
            for i in range(count)
        ]
        what = f"embedded engines {first_index}..{first_index + count - 1} to build their servers"
        urls = ray_wait([h.url.remote() for h in handles], what, ENGINE_BUILD_TIMEOUT_S)
        return list(zip(urls, handles))

    def start_sglang_engines(self, indices: list[int]) -> list[tuple[str, list[Any]]]:
        """Real SGLang engines, all starting at once: one Ray actor per node of an engine holding tp/nnodes GPUs (on
        its placement's bundle: its own in split placement, the actor's shared ones when colocated); node 0 of a
        multi-node engine names its rendezvous."""
        from mcore_rl.rollout.sglang_launcher import SGLangServerActor, engine_model_dir

        sgl = self.cfg.sglang
        model_path = engine_model_dir(self.model, os.path.join(self.log_dir, "engine_model"), self.fp8)
        base = {"num_gpus": sgl.tp // sgl.nnodes, "num_cpus": 1, "max_restarts": 0}
        engines = {
            index: [
                ray.remote(SGLangServerActor)
                .options(**{**base, **(self.engine_options(index, rank) if self.engine_options else {})})
                .remote(
                    sgl, model_path, self.dtype, self.api_key, self.cfg.max_running_requests, None, rank,
                    None, os.path.join(self.log_dir, "sglang"), bind_node_ip=self.bind_node_ip,
                    return_routed_experts=self.return_routed_experts, fp8=self.fp8,
                )
                for rank in range(sgl.nnodes)
            ]
            for index in indices
        }  # fmt: skip
        # Scheduling first, with its own short limit: an engine Ray cannot place is named at once, not after the
        # server's start-up limit
        for index, nodes in engines.items():
            wait_scheduled(nodes, f"rollout engine {index} ({sgl.nnodes} node(s) x {sgl.tp // sgl.nnodes} GPUs)")
        if sgl.nnodes > 1:
            heads = [nodes[0].address_for_dist_init.remote() for nodes in engines.values()]
            addresses = ray_wait(heads, f"the rendezvous of engines {indices}", 60)
            calls = [n.set_dist_init_addr.remote(a) for a, nodes in zip(addresses, engines.values()) for n in nodes]
            ray_wait(calls, f"the rendezvous of engines {indices}", 60)
        # start() itself gives up after startup_timeout_s (it stops the server and says why); the margin covers it
        starts = [[n.start.remote() for n in nodes] for nodes in engines.values()]
        urls = ray_wait(
            [ref for refs in starts for ref in refs], f"rollout engines {indices} to answer /health",
            sgl.startup_timeout_s + 60,
        )  # fmt: skip
        return [(urls[k * sgl.nnodes], nodes) for k, nodes in enumerate(engines.values())]

    @property
    def urls(self) -> list[str]:
        with self._lock:
            return [e.url for e in self.engines]

    @property
    def live_urls(self) -> list[str]:
        """The engines not being replaced (a replacement is synced by itself once it is up: on_engine_started)."""
        with self._lock:
            return [e.url for e in self.engines if e.index not in self._restarting]

    def engine_pids(self) -> list[int]:
        with self._lock:
            handles = [e.handle for e in self.engines]
        return ray.get([h.pid.remote() for h in handles])

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        seed: int | None,
        stop_token_ids: list[int],
        overrides: dict[str, Any] | None = None,
        return_routed_experts: bool = False,
    ) -> list[Sample]:
        """`n` samples per prompt through the router (prompt-major), with the rollout config's sampling settings
        (`overrides` replaces some, e.g. temperature 0 for validation's greedy pass); with `return_routed_experts`
        (R3 routing replay) straight to the engines, each sample carrying its routing."""
        params = {
            "max_new_tokens": self.cfg.max_new_tokens,
            "temperature": self.cfg.temperature,
            "top_p": self.cfg.top_p,
            "stop_token_ids": stop_token_ids,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            **(overrides or {}),
        }
        if return_routed_experts:
            return self.client.run(self._generate_direct(prompts, n, params, seed))
        from mcore_rl.rollout.client import RolloutRequestError

        live = [u for u in self.urls if u not in self.pending]
        groups = max(1, len(live)) if self.cfg.request_grouping == "engine" else 0
        try:
            return self.client.generate_samples(prompts, n, params, seed, groups=groups)
        except RolloutRequestError:
            with self._lock:
                restarting = bool(self._restarting)
            if not restarting:
                raise
            # Every engine that could answer is being replaced (a lone engine killed mid-generation): the client's
            # retries end before a replacement that takes a minute to start is up and synced. Wait for it, then
            # generate the batch again (same seeds).
            log.warning("generation failed while engines are being replaced; waiting for them, then generating again")
            self.wait_for_restarts()
            return self.client.generate_samples(prompts, n, params, seed, groups=groups)

    async def _generate_direct(
        self, prompts: list[list[int]], n: int, params: dict[str, Any], seed: int | None
    ) -> list[Sample]:
        """Requests that ask for routed experts bypass the router: sglang-router 0.3.2 drops `return_routed_experts`
        from the body it forwards (the same request answers `routed_experts` from an engine, none through the router;
        tests/test_router_replay.py checks it). Prompts are spread round-robin over the engines in the router; a
        request that fails on one engine is tried on the next."""
        from mcore_rl.rollout.client import RolloutRequestError

        num_layers = self._num_hidden_layers()

        async def one(i: int, prompt: list[int]) -> list[Sample]:
            last: Exception | None = None
            for attempt in range(max(1, len(self.urls))):
                urls = [u for u in self.urls if u not in self.pending] or self.urls
                url = urls[(i + attempt) % len(urls)]
                try:
                    return await self.client.agenerate_one(
                        prompt,
                        n,
                        params,
                        seed=None if seed is None else seed + i * n,
                        return_routed_experts=True,
                        num_layers=num_layers,
                        url=url,
                    )
                except RolloutRequestError as err:
                    last = err
            raise RolloutRequestError(f"/generate with return_routed_experts failed on every engine: {last}")

        groups = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return [s for group in groups for s in group]

    def _num_hidden_layers(self) -> int:
        if isinstance(self.model, dict):
            return int(self.model["num_hidden_layers"])
        import json

        with open(os.path.join(self.model, "config.json")) as f:
            return int(json.load(f)["num_hidden_layers"])

    # ------------------------------------------------------------------ weights (pushed by controller/weight_sync.py)
    def admit_pending(self) -> None:
        """Replacement engines that a push has just brought to the current version join the router."""
        with self._lock:
            ready, self.pending = list(self.pending), set()
        for url in ready:
            self.router.add_worker(url)

    # ------------------------------------------------------------------ memory (colocated placement)
    def release_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        """Every engine releases `tags` (weights, KV cache, CUDA graphs) while the actor trains; no /health probes
        until all is resumed."""
        self.memory.release(self.urls, tags)

    def resume_memory(self, tags: list[str]) -> None:
        """Every engine takes back those of `tags` it released (a tag never released is never resumed: SGLang's
        scheduler dies of it)."""
        self.memory.resume(self.urls, tags)

    # ------------------------------------------------------------------ faults
    def _monitor_loop(self) -> None:
        while not self._stop.wait(self.cfg.health_check_interval_s):
            try:
                self.client.run(self._check_engines())
            except Exception:  # noqa: BLE001 (a probe must never kill the run; the next one tries again)
                log.exception("engine health check failed")

    async def _check_engines(self) -> None:
        """Probe every engine's /health (unless a push or released memory holds probes off); a dead one leaves the
        router and is restarted in the background. The client also calls this before retrying a failed request."""
        if self._check_lock is None:
            self._check_lock = asyncio.Lock()
        async with self._check_lock:
            await asyncio.to_thread(self.check_router)
            with self._lock:
                engines = {e.url: e for e in self.engines if e.index not in self._restarting}
            for url in await self.health.dead(engines):
                await asyncio.to_thread(self.replace, url, "it failed its /health probes")

    def check_router(self) -> None:
        """A router that died is launched again at its address with the engines that are live (the client keeps its
        URL; its failed requests are retried on the new one). ProcessDied naming it after MAX_ROUTER_RESTARTS, or
        when it cannot start again. The vLLM pool's router is in this process and cannot die alone."""
        died = getattr(self.router, "died", None)
        why = died() if died is not None else None
        if why is None:
            return
        from mcore_rl.errors import ProcessDied

        with self._router_lock:
            if self.router.died() is None:  # another caller restarted it meanwhile
                return
            if self.router.restarts >= MAX_ROUTER_RESTARTS:
                raise ProcessDied(f"{why}; it was started again {self.router.restarts} times already this run")
            with self._lock:
                busy = set(self.pending) | {e.url for e in self.engines if e.index in self._restarting}
                live = [e.url for e in self.engines if e.url not in busy]
            log.warning("%s: starting it again at %s with engines %s", why, self.router.url, ", ".join(live))
            try:
                self.router.restart(live)
            except (RuntimeError, TimeoutError, OSError) as err:
                raise ProcessDied(f"{why}; starting it again failed: {err}") from None
            log.warning("the router is back at %s (restart %d)", self.router.url, self.router.restarts)

    def replace(self, url: str, why: str) -> bool:
        """Take the engine at `url` out of the router and restart it in the background; it joins the router once
        synced to the current weight version. False if `url` is no engine of the pool or is being replaced."""
        with self._lock:
            engine = next((e for e in self.engines if e.url == url), None)
            if engine is None or engine.index in self._restarting:
                return False
            thread = threading.Thread(target=self._restart, args=(engine,), daemon=True)
            self._restarting[engine.index] = thread
            self.pending.discard(url)
        log.warning("rollout engine %d at %s is dead (%s): removing it from the router", engine.index, url, why)
        try:
            self.router.remove_worker(url)
        finally:
            self.memory.forget(url)
            thread.start()
        return True

    def _restart(self, dead: Engine) -> None:
        for handle in dead.handle if isinstance(dead.handle, list) else [dead.handle]:
            try:
                if not self.cfg.kind.embedded:  # a server process, which its actor stops
                    ray.get(handle.stop.remote(), timeout=30)
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 (already gone)
                pass
        try:
            ((url, handle),) = self._start_engines(1, dead.index)
            with self._lock:
                self.engines[dead.index] = Engine(dead.index, url, handle)
                self.pending.add(url)
                self.restarts += 1
            # Synced before it sees any traffic: now if the actor still holds the current version, else by the
            # next push (which then adds it to the router).
            if self.on_engine_started is not None and self.on_engine_started(url):
                self.admit_pending()
            log.warning("rollout engine %d restarted at %s (weight version %s)", dead.index, url, self.weight_version)
        finally:
            with self._lock:
                self._restarting.pop(dead.index, None)

    def wait_for_restarts(self, timeout_s: float = 600.0) -> None:
        """Block until engine restarts in progress have finished (before a weight sync)."""
        with self._lock:
            threads = list(self._restarting.values())
        for thread in threads:
            thread.join(timeout=timeout_s)

    def shutdown(self) -> None:
        self._stop.set()
        self._monitor.join(timeout=30)
        self.wait_for_restarts()
        self.client.close()
        self.router.stop()
        handles = [h for e in self.engines for h in (e.handle if isinstance(e.handle, list) else [e.handle])]
        if not self.cfg.kind.embedded:
            # each server runs in its own process group, which its actor stops (SIGTERM, SIGKILL after a grace):
            # all at once, as they started
            try:
                ray.get([h.stop.remote() for h in handles], timeout=120)
            except Exception:  # noqa: BLE001 (shutting down: say so and kill the actors anyway)
                log.exception("stopping the engine servers")
        for handle in handles:
            ray.kill(handle, no_restart=True)
