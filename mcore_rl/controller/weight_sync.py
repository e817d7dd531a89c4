"""The version fence around the weight-sync pipeline: actor ranks -> every rollout engine, weight_version += 1.

```
setup    every actor rank computes the plan (resharding/sync/plan.py); the digests must agree
connect  (distributed) per stream: its leader hosts a broadcast group, every engine rank joins it
         (/init_weights_update_group), one group after another (every engine's init of a group answered before the
         next group's is posted: SGLang serves inits one at a time); again after an engine is replaced.
         vLLM on CUDA: one group, vLLM's own NCCL weight-transfer one (backend vllm_nccl: rollout/vllm_nccl.py
         new_vllm_nccl_group), for every stream
push(v)  no /health probes -> [pause engines] -> /begin_weight_update on every engine -> actor ranks stream their
         buckets (gather -> HF layout -> transport) -> /end_weight_update (the engine commits v) -> /flush_cache (its
         radix cache holds KV of the old weights) -> [/update_weights_from_disk (disk: after the session, so SGLang
         post-processes the weights once)] -> [continue]
```
An engine that does not answer /begin_weight_update (dead, or hung) is replaced (engine_pool: out of the router, a
new one started and synced to the current version before it serves) and the push goes on without it. If a sender
dies or an engine refuses a bucket, the push fails: every engine's session is closed (/abort_weight_update where the
engine has it: our server keeps the old weights and version; else /end_weight_update: SGLang keeps what it loaded),
the broadcast groups are rebuilt by the next push, and every engine is marked dirty (`dirty`) until a push succeeds.
`push` retries a failed push once at once, so no engine generates dirty; a second failure ends the run (SyncError
naming the step, the version and the engines: exit 1).
A session left open (SGLang refuses begin on it) is closed and begun again. No tensor passes through this process;
it only sends control calls.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Any

import ray

from mcore_rl.actor.megatron_actor import MegatronActor
from mcore_rl.actor.sync_sender import PushRequest
from mcore_rl.config import RolloutConfig, SyncConfig
from mcore_rl.controller.actor_group import ActorGroup
from mcore_rl.controller.engine_fence import CONTROL_TIMEOUT_S, UNREACHABLE, EngineFence, FenceError
from mcore_rl.controller.engine_pool import EnginePool
from mcore_rl.controller.gpu_plan import engine_shape
from mcore_rl.resharding.sync.plan import EngineLayout
from mcore_rl.rollout.engines import kind_of

log = logging.getLogger(__name__)


class SyncError(RuntimeError):
    """A weight push failed; the engines are dirty until the next successful push."""


class _Unanswered(SyncError):
    """Engines that did not answer their /init_weights_update_group in time (`urls`)."""

    def __init__(self, message: str, urls: list[str]) -> None:
        super().__init__(message)
        self.urls = urls


#: how long past sync.timeout_s an engine's init may take to answer: a rendezvous that cannot meet fails after
#: sync.timeout_s (the engine's side too, with our server), and its answer then still has to arrive; only an engine
#: silent past both is taken for hung
INIT_GRACE_S = 10.0


def engine_layout(rollout: RolloutConfig, num_engines: int) -> EngineLayout:
    """The engines' layout as the plan needs it (controller/gpu_plan.py engine_shape, which the dry run reads too; our
    embedded server is one rank)."""
    return engine_shape(rollout, "cuda").layout(num_engines)


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
        # pause_mode_for: ConfigError for a mode SGLang cannot be updated under
        self.fence = EngineFence(
            pool.client, push_pause_mode(cfg, rollout.engine), pool.replace,
            control_timeout_s=min(CONTROL_TIMEOUT_S, cfg.timeout_s), update_timeout_s=cfg.timeout_s,
        )  # fmt: skip
        self.backend = update_group_backend(rollout.engine, runtime)
        self.run_dir = run_dir
        self.layout = engine_layout(rollout, len(pool.urls))
        self.ranks_per_engine = self.layout.tp
        #: engine index -> the actor rank on each of its TP ranks' GPUs (ColocatedPlacement.engine_ranks, set by the
        #: colocated placement on CUDA): the tensor transport then has each payload made on its engine rank's GPU
        self.colocation: list[list[int]] | None = None
        self.version: int | None = None  #: the version every engine holds
        self.actor_version: int | None = None  #: the version the actor's weights are (None: training changed them)
        self.dirty: set[str] = set()
        self.step: int | None = None  #: the training step whose weights are pushed next (weights_changing)
        self.last_stats: list[dict[str, Any]] = []
        self._lock = threading.RLock()
        one_leader = one_sync_leader(rollout.engine, runtime, cfg.transport)  # as the dry run's plan
        digests = set(
            actor.call(MegatronActor.sync_plan, asdict(self.layout), cfg.bucket_bytes, cfg.mode, cfg.fp8, one_leader)
        )
        if len(digests) != 1:
            raise SyncError(f"actor ranks computed different sync plans (digests {sorted(digests)})")
        self.digest = digests.pop()
        self.summary = actor.call_rank(0, MegatronActor.sync_summary)
        if self.shared_group and cfg.transport == "distributed":
            check_vllm_streams(self.summary)
            self.groups_per_engine_gpu = 1  # every stream in the one group vLLM's worker holds
        else:
            self.groups_per_engine_gpu = update_groups_per_engine_gpu(cfg, self.summary["streams"])
        self._connected: list[str] = []
        self.model = model or {}
        for url in pool.urls:
            self.check_engine(url)
        pool.on_engine_started = self._engine_started

    def check_engine(self, url: str) -> None:
        """SyncError unless the engine at `url` serves the actor's model (`check_model_info`)."""
        status, info = self.pool.client.get(url, "/model_info")
        if status != 200 or not isinstance(info, dict):
            raise SyncError(f"engine {url} did not answer /model_info ({status})")
        check_model_info(url, info, self.model)

    # ------------------------------------------------------------------ groups
    def connect(self, urls: list[str]) -> None:
        """(Re)build the broadcast groups: every stream leader + every rank of every engine in `urls`."""
        if self.cfg.transport != "distributed":
            return
        with self._lock:
            for url in self._connected:
                if url in urls:  # engines already in groups leave them; dead ones are gone anyway
                    self.pool.client.run(self._leave_all(url, self.summary["stream_names"]))
            try:
                self._connect_once(urls)
            except _Unanswered as err:
                # A hung engine costs itself, not the run: it is replaced (synced before it serves) and the groups
                # are formed again without it; it is not asked again (its scheduler is still blocked in that init)
                for url in err.urls:
                    self.pool.replace(
                        url, f"it did not answer /init_weights_update_group within sync.timeout_s={self.cfg.timeout_s}"
                    )
                rest = [u for u in urls if u not in err.urls]
                if not rest:
                    raise SyncError(f"no engine of {urls} answered its broadcast-group init: {err}") from err
                log.warning("%s; forming the groups again without %s", err, err.urls)
                for url in rest:  # leave the groups formed before the one that failed
                    self.pool.client.run(self._leave_all(url, self.summary["stream_names"]))
                self._connect_once(rest)
                urls = rest
            self._connected = list(urls)

    def _connect_once(self, urls: list[str]) -> None:
        """One rendezvous of every stream's group with every engine in `urls`, group by group: the leader's join
        and the group's init on every engine, every answer awaited, then the next group (docs/weight_sync.md, "The
        group order"). SGLang serves an engine's inits one at a time, in arrival order, each blocking until its group
        forms, and a Ray actor joins one group at a time: with every group's init posted at once, two engines that
        see two groups in different orders each wait in a group the other never reaches. Each leader serves its
        rendezvous store from `sync_addresses` on (update_group.serve_store)."""
        self.actor.call(MegatronActor.sync_drop_groups)
        addresses: dict[str, tuple[int, tuple[str, int]]] = {}
        for rank, found in enumerate(self.actor.call(MegatronActor.sync_addresses)):
            for name, address in found.items():
                addresses[name] = (rank, address)
        order = {name: i for i, name in enumerate(self.summary["stream_names"])}
        groups = sorted(addresses.items(), key=lambda item: (order.get(item[0], len(order)), item[0]))
        if self.shared_group:  # one group (the leader's first stream) carries every stream
            groups = sorted(addresses.items())[:1]
        world = 1 + len(urls) * self.ranks_per_engine
        for name, (rank, (host, port)) in groups:
            self._form_group(urls, name, rank, host, port, world)

    @property
    def shared_group(self) -> bool:
        """Whether one group carries every stream (EngineKind.shared_update_group: vLLM's NCCL weight-transfer
        group)."""
        return kind_of(self.rollout.engine).shared_update_group(self.backend)

    def _form_group(self, urls: list[str], name: str, rank: int, host: str, port: int, world: int) -> None:
        """Group `name`: its leader (actor rank `rank`) joins while every engine in `urls` posts its init; returns
        once all have answered. SyncError naming the group otherwise (_Unanswered naming the engines that did not
        answer within sync.timeout_s + INIT_GRACE_S, or could not be reached)."""
        join = self.actor.submit(
            rank, MegatronActor.sync_join, name, host, port, world, self.backend, self.cfg.timeout_s,
            self.rollout.engine,
        )  # fmt: skip
        calls = [
            self.pool.client.apost(
                url, "/init_weights_update_group",
                init_group_body(self.rollout.engine, host, port, 1 + i * self.ranks_per_engine, world, name,
                                self.backend, self.cfg.timeout_s),
                self.cfg.timeout_s + INIT_GRACE_S,
            )
            for i, url in enumerate(urls)
        ]  # fmt: skip

        async def _all() -> list[Any]:
            return await asyncio.gather(*calls, return_exceptions=True)

        answers = self.pool.client.run(_all())
        try:
            ray.get(join)
            hosted: BaseException | None = None
        except Exception as err:  # noqa: BLE001 (raised below with the engines' answers)
            hosted = err
        silent = [url for url, answer in zip(urls, answers) if isinstance(answer, UNREACHABLE)]
        if silent:
            raise _Unanswered(f"broadcast group {name!r}: engines {silent} did not answer their init", silent)
        failed = [e for e in [hosted, *answers] if isinstance(e, BaseException)]
        if failed:
            raise SyncError(f"broadcast group {name!r} of {urls} not joined: {failed[0]}") from failed[0]

    async def _leave_all(self, url: str, names: list[str]) -> None:
        for name in names:
            try:
                await self.pool.client.apost(url, "/destroy_weights_update_group", {"group_name": name}, 10)
            except Exception:  # noqa: BLE001 (a group it never joined)
                pass

    # ------------------------------------------------------------------ the fence
    def push(self, version: int, urls: list[str] | None = None) -> list[dict[str, Any]]:
        """Put the actor's current weights on the engines as `version` (all live engines, or `urls`). A failed push
        of all engines leaves them on their old version (the fence closed their sessions: our server drops what it
        staged; SGLang keeps what it loaded, and the engine is marked dirty) and is retried once, from scratch, before
        anything generates, once the engines being replaced are up (each then takes part in it); SyncError naming
        the step, the version and the engines if the retry fails too (the run ends: exit 1). A replacement engine's
        own push (`urls`) is not retried here: the pool replaces it again."""
        try:
            return self._push_once(version, urls)
        except SyncError as err:
            if urls is not None:
                raise
            first = err
        log.warning(
            "%sweight push of version %d failed (%s): the engines keep version %s (dirty: %s); retrying once",
            self._where(), version, first, self.version, sorted(self.dirty),
        )  # fmt: skip
        # An engine that died just before the push (the fence found it dead and is replacing it) takes part in the
        # retry once it is up: with one engine, none is left otherwise, and the retry failed at once (the vLLM
        # train test's engine killed between a step's generation and its push ended the run).
        self.pool.wait_for_restarts()
        try:
            return self._push_once(version, None)
        except Exception as err:  # noqa: BLE001 (a dead rank fails the groups' rebuild with Ray's own error)
            engines = sorted(self.dirty) or list(self.pool.live_urls)
            raise SyncError(
                f"{self._where()}weight push of version {version} failed twice, on engines {engines} (their version "
                f"stays {self.version}, dirty): first {first}; then {type(err).__name__}: {err}"
            ) from err

    def _where(self) -> str:
        return f"step {self.step}: " if self.step is not None else ""

    def _push_once(self, version: int, urls: list[str] | None) -> list[dict[str, Any]]:
        """One try of `push`."""
        with self._lock, self.pool.health.quiet("weight push"):
            urls = list(urls if urls is not None else self.pool.live_urls)
            if self.cfg.transport == "distributed":
                # every engine in the broadcast groups takes part in each broadcast, so all of them are pushed
                live = self.pool.live_urls if urls == self.pool.live_urls else sorted(set(urls) | set(self._connected))
                if sorted(self._connected) != sorted(live):
                    self.connect(live)
                urls = list(self._connected)
            start = time.perf_counter()
            try:
                urls, paused = self.fence.open(urls)
            except FenceError as err:
                self._connected = []
                raise SyncError(f"weight push of version {version} failed: {err}") from err
            try:
                if self.cfg.transport == "distributed" and sorted(urls) != sorted(self._connected):
                    self.connect(urls)  # the groups without the engines being replaced
                disk_dir = (
                    os.path.join(self.run_dir, "weights", f"v{version}") if self.cfg.transport == "disk" else None
                )
                request = PushRequest(
                    version=version, transport=self.cfg.transport, engine_urls=urls, api_key=self.pool.api_key,
                    disk_dir=disk_dir, ranks_per_engine=self.ranks_per_engine, timeout_s=self.cfg.timeout_s,
                    keep_buffers=self.cfg.keep_buffers, colocation=self._colocation_of(urls),
                    engine=self.rollout.engine,
                )  # fmt: skip
                self.last_stats = self.actor.call(MegatronActor.sync_send, request)
                self.fence.commit(urls)
                if disk_dir is not None:
                    # After the session, not inside it: SGLang's /end_weight_update post-processes the weights again
                    # unless a tensor or distributed update loaded them (weight_updater.py:330), and its disk loader
                    # has post-processed them already; the empty session's begin/end undoes and redoes the
                    # post-processing of the old weights. Ours commits a disk update outside a session at once.
                    self.fence.update_from_disk(urls, disk_dir, version)
            except Exception as err:
                self.dirty.update(urls)
                self.fence.close(urls)
                self._connected = []  # a broadcast cut short leaves the groups out of step: rebuilt by the next push
                raise SyncError(f"weight push of version {version} failed; the engines are dirty: {err}") from err
            finally:
                self.fence.resume(paused)
            self.dirty.difference_update(urls)
            self.version = self.actor_version = version
            self.pool.weight_version = version
            # the replacements this push brought to the version join the router; not while one that came up during
            # the push waits (behind this push's lock) for its own sync: admit_pending would admit it too
            if set(self.pool.pending) <= set(urls):
                self.pool.admit_pending()
            # The first push is news; later ones are every step's timing_s/update_weights metric.
            (log.info if version == 1 else log.debug)(
                "weights v%d pushed in %.2f s", version, time.perf_counter() - start
            )
            return self.last_stats

    def _colocation_of(self, urls: list[str]) -> list[list[int]] | None:
        """The actor ranks beside each TP rank of the engines at `urls` (tensor transport with a colocation map)."""
        if self.colocation is None or self.cfg.transport != "tensor":
            return None
        index = {e.url: e.index for e in self.pool.engines}
        return [self.colocation[index[url]] for url in urls]

    def weights_changing(self, step: int | None = None) -> None:
        """The actor is about to update its weights (at `step`, which a failed push names): a replaced engine must
        now wait for the next push."""
        with self._lock:
            self.actor_version = None
            self.step = step

    def _engine_started(self, url: str) -> bool:
        """A replacement engine is up: sync it now if the actor still holds the engines' version (True), else it
        waits for the next push (False)."""
        with self._lock:
            if self.version is None or self.actor_version != self.version:
                return False
            self.check_engine(url)
            alive = [u for u in self.pool.live_urls if u not in self.pool.pending] + [url]  # not one being replaced
            # The serving engines join the new groups too: SGLang's scheduler blocks in each init (no /health probe
            # answers meanwhile), so probes are held as for a push
            with self.pool.health.quiet("weight sync of a replacement engine"):
                self.connect(alive)
                self.push(self.version, urls=[url])
            return True


def check_model_info(url: str, info: dict[str, Any], model: dict[str, Any]) -> None:
    """SyncError unless the /model_info answer `info` of the engine at `url` is the actor's HF config `model`.
    SGLang 0.5.23's /model_info says `model_type` and `architectures` (of the HF config it loaded) and nothing of
    the model's size; our server also says `num_hidden_layers` and `vocab_size`. A key is compared where both sides
    have it; `model_type` must be there (an engine that says nothing of its model is not trusted)."""
    if not info.get("model_type"):
        raise SyncError(f"engine {url} answered /model_info without a model_type: {sorted(info)}")
    for key in ("model_type", "architectures", "num_hidden_layers", "vocab_size"):
        theirs, ours = info.get(key), model.get(key)
        if theirs is not None and ours is not None and theirs != ours:
            raise SyncError(f"engine {url} serves another model: its {key} is {theirs!r}, the actor's is {ours!r}")


def update_group_backend(engine: str, runtime: str) -> str:
    """The broadcast groups' backend: gloo on CPU; on CUDA torch's NCCL (SGLang's and our server's rendezvous), or
    `vllm_nccl` for vLLM engines (vLLM's own NCCL weight-transfer backend, joined from a unique id the leader mints:
    rollout/vllm_nccl.py new_vllm_nccl_group): the engine kind's."""
    return kind_of(engine).update_group_backend(runtime)


def init_group_body(
    engine: str, host: str, port: int, rank_offset: int, world_size: int, name: str, backend: str, timeout_s: float
) -> dict[str, Any]:
    """SGLang's /init_weights_update_group body for one engine (the vLLM dialect maps it: vllm_dialect.py)."""
    body: dict[str, Any] = {
        "master_address": host, "master_port": port, "rank_offset": rank_offset, "world_size": world_size,
        "group_name": name, "backend": backend,
    }  # fmt: skip
    body.update(kind_of(engine).init_group_options(timeout_s))  # our server also takes the broadcast timeout
    return body


def push_pause_mode(cfg: SyncConfig, engine: str) -> str:
    """The fence's pause mode (SyncConfig.pause_mode_for: `auto` is abort with vLLM, on CPU and CUDA alike). vLLM's
    own GPU backends load each bucket as it arrives (layerwise reload: a layer is on the meta device until its last
    tensor is in), and its prefix cache holds KV of the old weights until a pause empties it, so a vLLM engine is
    always paused for a push (the client continues the aborted requests); `none` is refused in the config."""
    return cfg.pause_mode_for(engine)


def one_sync_leader(engine: str, runtime: str, transport: str) -> bool:
    """Whether every stream of the sync plan must leave from one actor rank (build_plan's `one_leader`): vLLM's NCCL
    weight-transfer backend (split vLLM on CUDA, the distributed transport), whose worker holds one group with one
    sender. The ranks' plan (WeightSync) and the dry run's (recipe_check.build_run_plan) both ask this: they agree."""
    return kind_of(engine).shared_update_group(update_group_backend(engine, runtime)) and transport == "distributed"


def check_vllm_streams(summary: dict[str, Any]) -> None:
    """SyncError unless every stream of the plan has one leader: vLLM's NCCL worker holds one transfer group, whose
    rank 0 (the sender of every broadcast) is that leader. The plan is built with one leader there (`one_sync_leader`)
    and gpu_plan.transport_problem refuses the layouts that cannot have one (actor pp > 1, ep > 1) before anything
    starts; this is the guard for any plan that still has several."""
    leaders = sorted(set(summary.get("stream_leaders") or [0]))
    if len(leaders) > 1:
        streams = dict(zip(summary["stream_names"], summary["stream_leaders"]))
        raise SyncError(
            f"rollout.engine=vllm on CUDA: the sync plan's streams {streams} (stream -> actor rank) have "
            f"{len(leaders)} leaders, but vLLM's NCCL weight-transfer worker holds one group with one sender; "
            "expected one leader (a plan built with one_leader, at actor.layout.pp=1 and ep=1; "
            "gpu_plan.transport_problem refuses the others before anything starts)"
        )


def update_groups_per_engine_gpu(cfg: SyncConfig, streams: int) -> int:
    """The broadcast groups every engine GPU joins (the distributed transport: one per stream of the plan; else 0);
    SyncError naming sync.max_update_groups when there are more."""
    groups = streams if cfg.transport == "distributed" else 0
    if groups > cfg.max_update_groups:
        raise SyncError(
            f"the sync plan has {streams} streams: every engine GPU would join {groups} broadcast groups (one "
            f"communicator each), more than sync.max_update_groups={cfg.max_update_groups}; raise it if the engine "
            "GPUs have the memory, or use sync.transport=tensor (colocated) or disk"
        )
    log.info("weight sync: %d broadcast group(s) per engine GPU (one per stream)", groups)
    return groups
