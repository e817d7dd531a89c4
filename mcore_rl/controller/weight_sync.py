"""The version fence around the weight-sync pipeline: actor ranks -> every rollout engine, weight_version += 1.

```
setup    every actor rank computes the plan (resharding/sync/plan.py); the digests must agree
connect  (distributed) per stream: its leader hosts a broadcast group, every engine rank joins it
         (/init_weights_update_group); again after an engine is replaced
push(v)  [pause engines] -> /begin_weight_update on every engine -> actor ranks stream their buckets
         (gather -> HF layout -> transport) -> [/update_weights_from_disk] -> /end_weight_update (the engine commits
         v atomically) -> [continue]
```
If a sender dies or an engine refuses a bucket, the push fails: engines that stage updates (our server) keep the old
weights and version, and every engine is marked dirty (`dirty`): it is re-synced before it may serve again. No
tensor passes through this process; it only sends control calls.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Any

import ray

from mcore_rl.config import RolloutConfig, SyncConfig
from mcore_rl.controller.actor_group import ActorGroup
from mcore_rl.controller.engine_pool import EnginePool
from mcore_rl.resharding.sync.plan import EngineLayout

log = logging.getLogger(__name__)


class SyncError(RuntimeError):
    """A weight push failed; the engines are dirty until the next successful push."""


def engine_layout(rollout: RolloutConfig, num_engines: int) -> EngineLayout:
    """The engines' layout as the plan needs it (our embedded server is one rank)."""
    if rollout.engine != "sglang":
        return EngineLayout(num_engines=num_engines)
    s = rollout.sglang
    return EngineLayout(num_engines, s.tp, s.ep, s.dp if s.enable_dp_attention else 1)


class WeightSync:
    """See the module docstring."""

    def __init__(
        self,
        actor: ActorGroup,
        pool: EnginePool,
        cfg: SyncConfig,
        rollout: RolloutConfig,
        runtime: str,
        run_dir: str,
        model: dict[str, Any] | None = None,
    ) -> None:
        """`model`: the actor's HF config; every engine must answer /model_info with the same model (checked
        before anything moves)."""
        self.actor, self.pool, self.cfg, self.rollout = actor, pool, cfg, rollout
        self.backend = "nccl" if runtime == "cuda" else "gloo"
        self.run_dir = run_dir
        self.layout = engine_layout(rollout, len(pool.urls))
        self.ranks_per_engine = self.layout.tp
        self.version: int | None = None  #: the version every engine holds
        self.actor_version: int | None = None  #: the version the actor's weights are (None: training changed them)
        self.dirty: set[str] = set()
        self.last_stats: list[dict[str, Any]] = []
        self._lock = threading.RLock()
        digests = set(actor.call("sync_plan", asdict(self.layout), cfg.bucket_bytes, cfg.mode, cfg.fp8))
        if len(digests) != 1:
            raise SyncError(f"actor ranks computed different sync plans (digests {sorted(digests)})")
        self.digest = digests.pop()
        self.summary = ray.get(actor.handles[0].sync_summary.remote())
        self._connected: list[str] = []
        self.model = model or {}
        for url in pool.urls:
            self.check_engine(url)
        pool.on_engine_started = self._engine_started

    def check_engine(self, url: str) -> None:
        """SyncError unless the engine at `url` serves the actor's model (type, layers, vocabulary where it says)."""
        status, info = self.pool.client.get(url, "/model_info")
        if status != 200 or not isinstance(info, dict):
            raise SyncError(f"engine {url} did not answer /model_info ({status})")
        for key in ("model_type", "num_hidden_layers", "vocab_size"):
            if key in info and key in self.model and info[key] != self.model[key]:
                raise SyncError(
                    f"engine {url} serves another model: its {key} is {info[key]!r}, the actor's is {self.model[key]!r}"
                )

    # ------------------------------------------------------------------ groups
    def connect(self, urls: list[str]) -> None:
        """(Re)build the broadcast groups: every stream leader + every rank of every engine in `urls`."""
        if self.cfg.transport != "distributed":
            return
        with self._lock:
            for url in self._connected:
                if url in urls:  # engines already in groups leave them; dead ones are gone anyway
                    self.pool.client.run(self._leave_all(url, self.summary["stream_names"]))
            ray.get([h.sync_drop_groups.remote() for h in self.actor.handles])
            addresses: dict[str, tuple[int, tuple[str, int]]] = {}
            for rank, found in enumerate(ray.get([h.sync_addresses.remote() for h in self.actor.handles])):
                for name, address in found.items():
                    addresses[name] = (rank, address)
            world = 1 + len(urls) * self.ranks_per_engine
            joins = [
                self.actor.handles[rank].sync_join.remote(name, host, port, world, self.backend, self.cfg.timeout_s)
                for name, (rank, (host, port)) in addresses.items()
            ]
            calls = []
            for name, (_, (host, port)) in addresses.items():
                for i, url in enumerate(urls):
                    body = {
                        "master_address": host, "master_port": port, "rank_offset": 1 + i * self.ranks_per_engine,
                        "world_size": world, "group_name": name, "backend": self.backend,
                    }  # fmt: skip
                    if self.rollout.engine == "hf":  # our server also takes the broadcast timeout (SGLang has none)
                        body["timeout_s"] = self.cfg.timeout_s
                    calls.append(self.pool.client.apost(url, "/init_weights_update_group", body, self.cfg.timeout_s))

            async def _all() -> None:
                import asyncio

                await asyncio.gather(*calls)

            self.pool.client.run(_all())
            ray.get(joins)
            self._connected = list(urls)

    async def _leave_all(self, url: str, names: list[str]) -> None:
        for name in names:
            try:
                await self.pool.client.apost(url, "/destroy_weights_update_group", {"group_name": name}, 10)
            except Exception:  # noqa: BLE001 (a group it never joined)
                pass

    # ------------------------------------------------------------------ the fence
    def push(self, version: int, urls: list[str] | None = None) -> list[dict[str, Any]]:
        """Put the actor's current weights on the engines as `version` (all engines, or `urls`)."""
        with self._lock:
            urls = list(urls if urls is not None else self.pool.urls)
            if self.cfg.transport == "distributed":
                # every engine in the broadcast groups takes part in each broadcast, so all of them are pushed
                if sorted(self._connected) != sorted(self.pool.urls):
                    self.connect(self.pool.urls)
                urls = list(self._connected)
            client = self.pool.client
            start = time.perf_counter()
            if self.cfg.pause_mode != "none":
                for url in urls:
                    client.post(url, "/pause_generation", {"mode": self.cfg.pause_mode})
            for url in urls:
                client.post(url, "/begin_weight_update")
            disk_dir = os.path.join(self.run_dir, "weights", f"v{version}") if self.cfg.transport == "disk" else None
            try:
                self.last_stats = self.actor.call(
                    "sync_send", version, self.cfg.transport, urls, self.pool.api_key, disk_dir,
                    self.ranks_per_engine, self.cfg.timeout_s, self.cfg.keep_buffers,
                )  # fmt: skip
                if disk_dir is not None:
                    for url in urls:
                        body = {"model_path": disk_dir, "weight_version": str(version), "flush_cache": False}
                        client.post(url, "/update_weights_from_disk", body, self.cfg.timeout_s)
                for url in urls:
                    client.post(url, "/end_weight_update")
            except Exception as err:
                self.dirty.update(urls)
                for url in urls:  # an open session with a refused bucket commits nothing; drop it
                    try:
                        client.post(url, "/begin_weight_update")
                    except Exception:  # noqa: BLE001 (a dead engine)
                        pass
                raise SyncError(f"weight push of version {version} failed; engines keep their weights: {err}") from err
            finally:
                if self.cfg.pause_mode != "none":
                    for url in urls:
                        try:
                            client.post(url, "/continue_generation")
                        except Exception:  # noqa: BLE001
                            pass
            self.dirty.difference_update(urls)
            self.version = self.actor_version = version
            self.pool.weight_version = version
            self.pool.admit_pending()
            # The first push is news; later ones are every step's timing_s/update_weights metric.
            (log.info if version == 1 else log.debug)(
                "weights v%d pushed in %.2f s", version, time.perf_counter() - start
            )
            return self.last_stats

    def weights_changing(self) -> None:
        """The actor is about to update its weights: a replaced engine must now wait for the next push."""
        with self._lock:
            self.actor_version = None

    def _engine_started(self, url: str) -> bool:
        """A replacement engine is up: sync it now if the actor still holds the engines' version (True), else it
        waits for the next push (False)."""
        with self._lock:
            if self.version is None or self.actor_version != self.version:
                return False
            self.check_engine(url)
            alive = [u for u in self.pool.urls if u not in self.pool.pending] + [url]
            self.connect(alive)
            self.push(self.version, urls=[url])
            return True
