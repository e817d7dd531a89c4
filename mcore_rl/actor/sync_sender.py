"""The actor rank's side of weight sync: the plan (every rank computes the same), broadcast groups, sending.

    digest = sender.plan(engine_layout, bucket_bytes, mode)       # all ranks; digests must agree
    sender.addresses()                                           # streams this rank leads -> (host, port)
    sender.join(stream_name, host, port, world_size, backend, timeout_s, engine)  # leader = rank 0 of the group
    stats = sender.send(version, transport="distributed", engine_urls=[...], api_key=...)
    sender.release()                                             # drop the reused buffers (see keep_buffers)

The plan comes from every rank's exported tensors (all-gathered metadata, `resharding/sync/inventory.py`), so it
is the same on every rank; `resharding/sync/execute.py` does the gathering, packing and sending.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.parallel.update_group import UpdateGroup, reserve_port, serve_store
from mcore_rl.resharding.sync.execute import SyncExecutor
from mcore_rl.resharding.sync.inventory import local_sources, merge_sources
from mcore_rl.resharding.sync.order import InGlobalOrder, global_order
from mcore_rl.resharding.sync.plan import EngineLayout, SyncPlan, build_plan
from mcore_rl.resharding.sync.transports import DiskTransport, DistributedTransport, TensorTransport
from mcore_rl.rollout.engines import kind_of


@dataclass(frozen=True)
class PushRequest:
    """One weight push as the controller asks it of every actor rank (MegatronActor.sync_send)."""

    version: int  #: the weight version the engines commit
    transport: str  #: sync.transport: "distributed" | "tensor" | "disk"
    engine_urls: list[str]  #: the engines pushed to, in the order of the plan's engine ranks
    api_key: str | None = None  #: the run's engine key
    disk_dir: str | None = None  #: the disk transport's directory for this version
    ranks_per_engine: int = 1  #: engine ranks behind each URL (its TP x DP)
    timeout_s: float = 300.0  #: sync.timeout_s: one bucket's delivery
    keep_buffers: bool = True  #: sync.keep_buffers: the executor's buffers stay resident for the next push
    #: tensor transport: colocation[i][r] is the actor rank on the GPU of engine i's TP rank r; given, every rank takes
    #: part in every bucket and makes the payloads of the engine ranks beside it (transports/tensor.py)
    colocation: list[list[int]] | None = None
    #: rollout.engine: its kind's receiver (rollout/engines/receivers.py) builds the requests the transports post
    engine: str = "hf"


#: a test's hook, "<version>:<rank>:<marker file>": that rank writes its pid to the marker file and stops inside the
#: push of that version, after the fence paused the engines and while its peers wait for it in the push's collectives
#: (tests/test_run_endings.py kills it there)
PAUSE_ENV = "MCORE_RL_TEST_PAUSE_PUSH"


def _pause_for_test(version: int, rank: int) -> None:
    wanted = os.environ.get(PAUSE_ENV)
    if not wanted:
        return
    at_version, at_rank, marker = wanted.split(":", 2)
    if (int(at_version), int(at_rank)) == (version, rank):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)


class SyncSender:
    """Weight-sync state of one actor rank (built lazily by the actor; see the module docstring)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.plan_: SyncPlan | None = None
        self.executor: SyncExecutor | None = None
        self.groups: dict[str, UpdateGroup] = {}
        self._stores: dict[str, Any] = {}  # rendezvous stores serving on the ports `addresses` gave out, until `join`
        self._sends = 0  # syncs run so far (the same count on every rank): names each one's keys in the store
        #: `connect` / `mint_id` for a kind's own group (vLLM's NCCL: rollout/vllm_nccl.py new_vllm_nccl_group):
        #: empty, or a test's stand-in communicator
        self.vllm_connect: dict[str, Any] = {}

    def plan(
        self, engines: dict[str, int], bucket_bytes: int, mode: str, fp8: bool = False, one_leader: bool = False
    ) -> str:
        """Compute the plan (collective over the actor's world); returns its digest. `one_leader`: every stream from
        one rank (controller/weight_sync.py one_sync_leader: vLLM's one NCCL group)."""
        a = self.actor
        coords = a.layout.coords(a.rank, a.world_size)
        mine = local_sources(a.chunks, a.contexts, a.weight_map, coords.pp_rank, a.pg.tp.size(), a.pg.expt_tp.size())
        every: list[Any] = [None] * a.world_size
        dist.all_gather_object(every, mine)
        hf = a.spec.hf
        self.plan_ = build_plan(
            merge_sources(every),
            actor_layout=a.layout,
            world_size=a.world_size,
            engines=EngineLayout(**engines),
            rules=a.spec.family.engine_shards,
            receive_together=a.spec.family.engine_receive_together,
            bucket_bytes=bucket_bytes,
            mode=mode,
            num_experts=a.spec.family.shape(hf).num_experts,
            num_kv_heads=a.spec.family.shape(hf).num_query_groups,
            num_heads=a.spec.family.shape(hf).num_attention_heads,
            fp8_targets=a.spec.family.fp8_targets if fp8 else None,
            one_leader=one_leader,
        )
        groups = {
            "tp": a.pg.tp if a.pg.tp.size() > 1 else None,
            "etp": a.pg.expt_tp if a.pg.expt_tp.size() > 1 else None,
        }
        self.executor = SyncExecutor(self.plan_, a.rank, a.chunks, a.contexts, a.weight_map, groups)
        return self.plan_.digest()

    def summary(self) -> dict[str, Any]:
        """Sizes of the plan, for logs and benchmarks."""
        plan = self._plan()
        return {
            "streams": len(plan.streams),
            "stream_names": [s.name for s in plan.streams],
            "stream_leaders": [s.leader for s in plan.streams],
            "max_bucket_bytes": plan.max_bucket_bytes,
            "buckets": len(plan.buckets),
            "bytes": plan.nbytes,
            "largest_tensor_bytes": plan.largest_tensor_bytes,
            "bucket_bytes": plan.bucket_bytes,
            "engines": asdict(plan.engines),
            "mode": plan.mode,
        }

    def _plan(self) -> SyncPlan:
        if self.plan_ is None:
            raise RuntimeError("weight sync has no plan yet: call sync_plan first")
        return self.plan_

    def addresses(self) -> dict[str, tuple[str, int]]:
        """A rendezvous address (this node, a port) for every stream this rank leads, its TCP store serving on it
        from now on (update_group.serve_store): an engine whose init of this group comes before the leader's `join`
        (the leader joins its groups one at a time) finds a store that answers. The port is bound before it is given
        out: a port merely found free could be taken meanwhile (an engine's HTTP server took one once: EADDRINUSE)."""
        host, _ = self.actor.rendezvous_address()
        self._stores = {
            s.name: serve_store(host, reserve_port(host)) for s in self._plan().streams if s.leader == self.actor.rank
        }  # fmt: skip (the previous call's stores stop serving as they are dropped)
        return {name: (host, store.port) for name, store in self._stores.items()}

    def store(self, name: str) -> Any:
        """The rendezvous store serving for stream `name` since `addresses` (None once `join` took it)."""
        return self._stores.get(name)

    def join(
        self, name: str, host: str, port: int, world_size: int, backend: str, timeout_s: float, engine: str = "hf"
    ) -> None:
        """Host the broadcast group `name` as its rank 0 (blocks until every engine rank has joined), made by the
        kind of `engine` (rollout.engine: `EngineKind.update_group`). A kind whose group of `backend` is shared
        (`shared_update_group`: vLLM's NCCL weight-transfer group on CUDA, one per vLLM worker) gets one group for
        every stream this rank leads (controller/weight_sync.py `check_vllm_streams` refuses a plan whose streams
        have several leaders), sized by the plan's largest bucket."""
        kind = kind_of(engine)
        store = self._stores.pop(name, None)
        if kind.shared_update_group(backend):
            led = [s.name for s in self._plan().streams if s.leader == self.actor.rank]
            self.drop_groups()
            for other in led:  # one rendezvous port for the one group: the others' stores stop
                self._stores.pop(other, None)
            device = torch.device("cuda", torch.cuda.current_device()) if self.actor.runtime == "cuda" else "cpu"
            group = kind.update_group(
                backend, host, port, world_size, name, timeout_s, store=store,
                bucket_bytes=self._plan().max_bucket_bytes, device=device, connect=self.vllm_connect,
            )  # fmt: skip
            self.groups.update({stream: group for stream in led})
            return
        self.groups.pop(name, None)
        self.groups[name] = kind.update_group(backend, host, port, world_size, name, timeout_s, store=store)

    def drop_groups(self) -> None:
        """Leave every group (a vLLM NCCL communicator is aborted: its engines get a new one on re-init)."""
        for group in {id(g): g for g in self.groups.values()}.values():
            close = getattr(group.group, "close", None)
            if close is not None:
                close()
        self.groups.clear()

    def send(self, request: PushRequest) -> dict[str, Any]:
        """Run this rank's part of the plan through the request's transport (collective within each stream's gather
        group). The executor's bucket and gather buffers stay for the next sync unless `request.keep_buffers` is
        false."""
        r = request
        if self.executor is None:
            raise RuntimeError("weight sync has no plan yet: call sync_plan first")
        device = torch.device("cuda", torch.cuda.current_device()) if self.actor.runtime == "cuda" else "cpu"
        self._sends += 1
        version = str(r.version)
        if r.transport == "distributed":
            sink: Any = DistributedTransport(
                self.groups, r.engine_urls, api_key=r.api_key, weight_version=version, timeout_s=r.timeout_s,
                device=device, receiver=kind_of(r.engine).receiver(),
            )  # fmt: skip
            # the leaders take turns in one global order of buckets: engines serve update requests one at a time,
            # each blocking in its broadcast (resharding/sync/order.py)
            plan = self._plan()
            led = {s.index for s in plan.streams if s.leader == self.actor.rank}
            store = dist.distributed_c10d._get_default_store()
            sink = InGlobalOrder(sink, global_order(plan), led, store, f"mcore_rl_sync/{self._sends}", r.timeout_s)
        elif r.transport == "tensor":
            sink = TensorTransport(
                r.engine_urls, api_key=r.api_key, weight_version=version, ranks_per_engine=r.ranks_per_engine,
                timeout_s=r.timeout_s, device=device, colocation=r.colocation, rank=self.actor.rank,
                receiver=kind_of(r.engine).receiver(),  # vLLM's: its ipc update_info (transports/tensor.py)
            )  # fmt: skip
        elif r.transport == "disk":
            if r.disk_dir is None:
                raise ValueError("the disk transport needs a directory")
            sink = DiskTransport(r.disk_dir)
        else:
            raise ValueError(f"unknown sync transport {r.transport!r}; expected distributed, tensor or disk")
        _pause_for_test(r.version, self.actor.rank)
        try:
            stats = self.executor.run(sink)
        finally:
            sink.close()
            if not r.keep_buffers:
                self.executor.release()
        out = asdict(stats)
        out["resident_bytes"] = self.executor.resident_bytes  # what stays for the next sync (0 once released)
        return out

    def release(self) -> None:
        """Free the executor's reused buffers (2 buckets + the largest tensor at most); the next sync reallocates."""
        if self.executor is not None:
            self.executor.release()
