"""Stream leaders and SGLang-code engines for driving the project's `WeightSync.connect` without a Megatron model.

Used by tests/test_connect_order.py and tools/bench_sync.py `--connect`:

    ray.init(...)
    leaders = [Leader.remote(rank) for rank in range(2)]
    lead(leaders, {"s0": 0, "s1": 1})                      # stream -> the rank leading it
    sync = weight_sync(leaders, client, "gloo", ["s0", "s1"], timeout_s=10)
    sync.connect(engine_urls)                              # engines: tests/_sglang_receiver.py processes

A `Leader` is a Ray actor running the project's `SyncSender.addresses` / `join` / `drop_groups`; only the plan is a
stand-in (which streams the rank leads). `weight_sync` is the project's `WeightSync` with what `connect` reads set,
no plan or model (its constructor asks the Megatron ranks for those).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import ray

from mcore_rl.config import RolloutConfig, SyncConfig
from mcore_rl.controller.engine_state import EngineHealth
from mcore_rl.controller.weight_sync import WeightSync


@ray.remote(num_cpus=0)
class Leader:
    """An actor rank's weight-sync side: the project's SyncSender, with the streams it leads given by `lead`."""

    def __init__(self, rank: int) -> None:
        from mcore_rl.actor.sync_sender import SyncSender

        self.rank, self.runtime = rank, "cpu"
        self.sender = SyncSender(self)

    def rendezvous_address(self) -> tuple[str, int]:  # SyncSender asks its actor for the host
        return "127.0.0.1", 0

    def lead(self, streams: list[str]) -> None:
        self.sender.drop_groups()
        self.sender.plan_ = SimpleNamespace(streams=[SimpleNamespace(name=n, leader=self.rank) for n in streams])

    def groups(self) -> list[str]:
        return sorted(self.sender.groups)

    def sync_drop_groups(self) -> None:
        self.sender.drop_groups()

    def sync_addresses(self) -> dict[str, tuple[str, int]]:
        return self.sender.addresses()

    def sync_join(
        self, name: str, host: str, port: int, world: int, backend: str, timeout_s: float, engine: str = "hf"
    ) -> None:
        if backend != "nccl":
            self.sender.join(name, host, port, world, backend, timeout_s, engine)
            return
        # NCCL without a GPU: only the leader's TCP store (serving since sync_addresses), which is all the engines'
        # rendezvous handshake needs; NCCL makes its communicator at the first broadcast
        self.sender.groups[name] = SimpleNamespace(group=None, store=self.sender.store(name))


def lead(leaders: list[Any], streams: dict[str, int]) -> None:
    """Give each leader the streams it leads (`streams`: stream name -> rank)."""
    ray.get([h.lead.remote([s for s, r in streams.items() if r == rank]) for rank, h in enumerate(leaders)])


def weight_sync(leaders: list[Any], client: Any, backend: str, streams: list[str], timeout_s: float) -> WeightSync:
    """The project's WeightSync over `leaders` (SGLang engines, one rank each), as far as `connect` needs it."""
    pool = SimpleNamespace(
        client=client, health=EngineHealth(client, 5.0, 3), replace=lambda url, why: False, live_urls=[],
        pending=set(), urls=[],
    )  # fmt: skip
    sync = WeightSync.__new__(WeightSync)
    sync.actor = SimpleNamespace(  # ActorGroup's calls over the Ray actors, given MegatronActor methods
        call=lambda method, *args: ray.get([getattr(h, method.__name__).remote(*args) for h in leaders]),
        submit=lambda rank, method, *args: getattr(leaders[rank], method.__name__).remote(*args),
    )
    sync.pool, sync.cfg, sync.rollout = pool, SyncConfig(timeout_s=timeout_s), RolloutConfig(engine="sglang")
    sync.backend, sync.ranks_per_engine = backend, 1
    sync.summary = {"stream_names": streams}
    sync._lock, sync._connected = threading.RLock(), []
    return sync
