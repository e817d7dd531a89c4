"""What every rollout engine kind answers (`EngineKind`), the shape of one engine (`EngineShape`), and the registry
of kinds by config name (`KINDS`, `kind_of`).

```
rollout.engine -> kind_of(name) -> the kind: shape, availability, router, client dialect, update-group backend,
                                   the stream leader's group and the engines' request options, pause mode,
                                   placement and GPU-plan facts, the sync receiver (the routes and bodies the
                                   transports post: receivers.py)
```
Code outside this folder asks the kind and never compares the engine's name; the registry is the list of accepted
names (`RolloutConfig.validate` reads it). Nothing here imports torch, SGLang or vLLM: a kind imports its launcher
inside the method that needs it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mcore_rl.config.checks import _check


@dataclass(frozen=True)
class EngineShape:
    """One rollout engine as its own settings give it: its GPUs, its parallelism as the sync plan sees it, and its
    share of each GPU (controller/gpu_plan.py reads it for the placement, the sync plan and the dry run)."""

    key: str  #: the config prefix of its settings: rollout.sglang | rollout.vllm | rollout (our embedded server)
    tp: int  #: tensor-parallel size (vLLM: of each of its dp replicas)
    dp: int  #: SGLang: DP-attention groups inside tp; vLLM: data-parallel replicas, each tp GPUs
    ep: int  #: expert-parallel size over the engine's ranks (1: experts TP-split)
    gpus: int  #: GPUs of one engine (0: our embedded server on CPU)
    nnodes: int  #: nodes one engine spans
    memory_key: str  #: the key of its share of each GPU ("" when it has none)
    memory_fraction: float  #: weights + KV cache share of each of its GPUs
    releases: bool  #: whether it releases weights and KV cache while a colocated actor trains

    @property
    def ranks(self) -> int:
        """Ranks of one engine that hold weights (one per GPU; our embedded server is one)."""
        return max(1, self.gpus)

    def terms(self) -> str:
        """Where its GPU count comes from, in config keys."""
        if self.key == "rollout.vllm":
            return f"rollout.vllm.tp={self.tp} x rollout.vllm.dp={self.dp}"
        if self.key == "rollout.sglang":
            return f"rollout.sglang.tp={self.tp}"
        return "1"

    def layout(self, num_engines: int) -> Any:
        """The engines as the sync plan sees them (resharding/sync/plan.py EngineLayout): ranks per engine, expert
        parallelism over them, attention groups (vLLM's dp replicas each hold attention at tp)."""
        from mcore_rl.resharding.sync.plan import EngineLayout

        if self.key == "rollout":
            return EngineLayout(num_engines=num_engines)
        return EngineLayout(num_engines, self.ranks, self.ep, self.dp)


class EngineKind(ABC):
    """One kind of rollout engine: everything that differs by `rollout.engine`. A kind is stateless; `cfg` is the
    run's RLConfig, `rollout` its RolloutConfig."""

    #: its `rollout.engine` name
    name: str
    #: the rollout client's dialect for it (rollout/client.py DIALECTS)
    dialect: str
    #: our server inside the engine's own Ray actor, sized by rollout.num_cpus (one bundle per engine when split,
    #: the actor rank's bundle when colocated); otherwise a server process per engine node whose Ray actor takes one
    #: CPU and the node's GPUs of the engine, and is stopped (its process group ended) before it is killed
    embedded: bool
    #: a run on it on CUDA needs the pinned GPU package set (gpu_extra.py, constraints-gpu.txt)
    uses_gpu_extra: bool

    @abstractmethod
    def shape(self, rollout: Any, runtime: str) -> EngineShape:
        """One engine's shape from its settings in `rollout` on `runtime` (trainer.runtime)."""

    @abstractmethod
    def unavailable_reason(self, cfg: Any, hf_config: Callable[[], dict[str, Any]]) -> str | None:
        """None where this kind's engines can start for the run `cfg`, else the whole error message (the run refuses
        it before Ray starts; not in the config: a CPU login node validates GPU recipes). `hf_config` returns the
        run's HF config, read only by a kind that needs it."""

    @abstractmethod
    def validate_rollout(self, rollout: Any) -> None:
        """ConfigError for a rollout setting this kind cannot serve (RolloutConfig.validate)."""

    @abstractmethod
    def check_run(self, cfg: Any) -> None:
        """ConfigError for a combination of groups this kind cannot run (config/validate.py validate_run)."""

    @abstractmethod
    def complete(self, cfg: Any) -> None:
        """Fill in this kind's null settings that the run decides (RLConfig.validate, after max_sequence_length)."""

    @abstractmethod
    def pause_mode(self, requested: str) -> str:
        """The /pause_generation mode a push uses for sync.pause_mode `requested`, or "none"; ConfigError for a mode
        this kind cannot be updated under (SyncConfig.pause_mode)."""

    @abstractmethod
    def update_group_backend(self, runtime: str) -> str:
        """The broadcast groups' backend on `runtime`: gloo on CPU; on CUDA nccl or vLLM's own vllm_nccl."""

    @abstractmethod
    def init_group_options(self, timeout_s: float) -> dict[str, Any]:
        """What this kind's /init_weights_update_group body takes beyond SGLang's keys."""

    def update_group(
        self,
        backend: str,
        host: str,
        port: int,
        world_size: int,
        name: str,
        timeout_s: float,
        *,
        store: Any = None,
        bucket_bytes: int = 0,
        device: Any = None,
        connect: dict[str, Any] | None = None,
    ) -> Any:
        """The actor's stream leader's side (rank 0) of the broadcast group `name` of `backend` (this kind's
        `update_group_backend`), rendezvous on `host`:`port` (`store`: the one already serving there); blocks until
        every engine rank has joined (actor/sync_sender.py `join`). Default: parallel/update_group.py's group (gloo,
        torch's NCCL). `bucket_bytes` (the plan's largest bucket), `device` and `connect` (a test's stand-in
        communicator) are for a kind that makes its own group."""
        from mcore_rl.parallel.update_group import new_update_group

        return new_update_group(backend, host, port, 0, world_size, name, timeout_s, store=store)

    def shared_update_group(self, backend: str) -> bool:
        """True where one group of `backend` carries every stream its leader leads (the engines' workers hold one
        group each), so the controller forms one group and the leader maps every stream it leads to it."""
        return False

    def receiver(self) -> Any:
        """What the weight-sync transports post to this kind's engines (resharding/sync/transports/base.py
        UpdateReceiver): SGLang's API unless the kind says otherwise. Built on the actor ranks (PushRequest.engine)."""
        from mcore_rl.rollout.engines.receivers import SGLangReceiver

        return SGLangReceiver()

    @abstractmethod
    def router_class(self) -> type:
        """The router the engine pool puts in front of its engines (constructed with the URLs and router settings)."""

    @abstractmethod
    def start_engines(self, pool: Any, indices: list[int]) -> list[tuple[str, Any]]:
        """Start the engine pool's engines `indices`, all at once: [(URL, Ray actor handle or handles)]."""

    @abstractmethod
    def nodes_problem(self, rollout: Any) -> str | None:
        """Why one engine's GPUs do not divide over its nodes, or None (controller/gpu_plan.py count_gpus)."""

    def node_gpus_problem(self, rollout: Any, runtime: str, node_gpus: int, gpus_per_node: int) -> str:
        """The refusal when one engine puts `node_gpus` GPUs on a node of `gpus_per_node` (gpu_plan.check_fits)."""
        return (
            f"{self.shape(rollout, runtime).terms()} = {node_gpus} GPUs of one engine, on one node, which has "
            f"{gpus_per_node}; expected at most {gpus_per_node}"
        )

    @abstractmethod
    def cuda_transport_problem(self, cfg: Any) -> str | None:
        """What of this kind's weight sync cannot run on CUDA with the run's transport and layouts, or None
        (gpu_plan.transport_problem asks it before its placement rules, which apply to every kind)."""


#: rollout.engine -> its kind, in registration order (rollout/engines/__init__.py registers the built-in ones)
KINDS: dict[str, EngineKind] = {}


def register(kind: EngineKind) -> EngineKind:
    """Add `kind` to the registry under its name (replacing one of that name); returns it."""
    KINDS[kind.name] = kind
    return kind


def kind_of(name: str) -> EngineKind:
    """The kind whose `rollout.engine` name is `name`; ConfigError naming the accepted names otherwise."""
    _check(isinstance(name, str) and name in KINDS, "rollout.engine", name, f"one of {tuple(KINDS)}")
    return KINDS[name]
