"""Where the actor ranks and the rollout engines run, and what they hand each other between phases.

    placement = make_placement(cfg)                    # after ray.init: reserves the pools (Ray placement groups)
    ActorGroup(..., options=placement.actor_options)   # rank r -> its bundle
    EnginePool(..., engine_options=placement.engine_options)
    placement.to_training(actor, engines)             # after a step's generation
    placement.sync_weights(sync, version)             # after the update: the weight push, and back to generation

split      two placement groups: one bundle per actor rank ({CPU: actor.num_cpus_per_rank, GPU: 1 on CUDA}) and one
           per engine ({CPU: rollout.num_cpus, GPU: 1}); generation and training can overlap (trainer.async_rollout).
           The phase hooks do nothing.
colocated  one placement group with a bundle per actor rank; engine i shares rank i % world's bundle (its CPUs; on
           CUDA its GPU, half each). While the actor trains, engines release weights and KV cache
           (/release_memory_occupation, SGLang's memory saver; our server drops its parameters); while engines
           generate, the actor offloads parameters, gradients and optimizer state to host memory (CUDA; on CPU a
           no-op that says so in the log). The hand-over back to generation is verl's order: engines resume their
           weights -> the push refills them from the actor's (still on device) -> the actor offloads -> engines
           resume their KV cache.
Real SGLang engines (rollout.engine=sglang) start with their own GPU requests; colocating them with the actor is
done by SGLang's memory saver on shared nodes, not by these bundles.
"""

from __future__ import annotations

import logging
from typing import Any

from mcore_rl.config import RLConfig

log = logging.getLogger(__name__)

MEMORY_TAGS = ["weights", "kv_cache"]


class SplitPlacement:
    """Separate pools for the actor and the engines (see the module docstring)."""

    name = "split"
    #: whether the actor ranks may start while the engines start (train.py): yes on separate devices
    overlap_startup = True

    def __init__(self, cfg: RLConfig) -> None:
        from ray.util.placement_group import placement_group

        self.cfg = cfg
        self.cuda = cfg.trainer.runtime == "cuda"
        gpu = {"GPU": 1} if self.cuda else {}
        self.actor_pg = placement_group(
            [{"CPU": cfg.actor.num_cpus_per_rank, **gpu} for _ in range(cfg.actor.world_size)], strategy="PACK"
        )
        self.groups = [self.actor_pg]
        self.engine_pg = None
        if cfg.rollout.engine == "hf":
            self.engine_pg = placement_group(
                [{"CPU": cfg.rollout.num_cpus, **gpu} for _ in range(cfg.rollout.num_engines)], strategy="PACK"
            )
            self.groups.append(self.engine_pg)
        self._wait()

    def _wait(self, timeout_s: float = 120.0) -> None:
        import ray

        ready, _ = ray.wait([g.ready() for g in self.groups], num_returns=len(self.groups), timeout=timeout_s)
        if len(ready) != len(self.groups):
            raise ValueError(
                f"trainer.placement={self.name}: Ray could not reserve the pools within {timeout_s:.0f} s "
                f"(bundles {[g.bundle_specs for g in self.groups]}; cluster resources {ray.cluster_resources()})"
            )

    @staticmethod
    def _strategy(pg: Any, bundle: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)}

    def actor_options(self, rank: int) -> dict[str, Any]:
        """Ray options of actor rank `rank`."""
        return self._strategy(self.actor_pg, rank)

    def engine_options(self, index: int) -> dict[str, Any]:
        """Ray options of embedded engine `index` (also its replacement after a crash)."""
        return self._strategy(self.engine_pg, index) if self.engine_pg is not None else {}

    def to_training(self, actor: Any, engines: Any) -> dict[str, float]:
        """Hand the devices from the engines to the actor (nothing to do when they have their own)."""
        return {}

    def sync_weights(self, sync: Any, version: int) -> dict[str, float]:
        """Push the actor's weights to the engines as `version` and hand the devices back to the engines."""
        sync.push(version)
        return {}

    def to_generation(self, sync: Any, version: int) -> dict[str, float]:
        """After a step that did not change the actor (critic warm-up): the engines serve `version` again."""
        return {}

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 (Ray already shut down)
                pass


class ColocatedPlacement(SplitPlacement):
    """Actor ranks and engines on the same bundles, taking turns (see the module docstring)."""

    name = "colocated"

    def __init__(self, cfg: RLConfig) -> None:
        from ray.util.placement_group import placement_group

        self.cfg = cfg
        self.cuda = cfg.trainer.runtime == "cuda"
        # On a shared GPU the engine sizes its KV cache from the memory free when it starts, so the actor ranks
        # build first (verl's order); on CPU nothing is shared that a start-up measures.
        self.overlap_startup = not self.cuda
        gpu = {"GPU": 1} if self.cuda else {}
        cpus = cfg.actor.num_cpus_per_rank
        self.actor_pg = placement_group([{"CPU": cpus, **gpu} for _ in range(cfg.actor.world_size)], strategy="PACK")
        self.groups, self.engine_pg = [self.actor_pg], None
        self._wait()

    def actor_options(self, rank: int) -> dict[str, Any]:
        share = {"num_gpus": 0.5} if self.cuda else {}
        return {**self._strategy(self.actor_pg, rank), **share}

    def engine_options(self, index: int) -> dict[str, Any]:
        if self.cfg.rollout.engine != "hf":
            return {}
        # The engine uses the rank's CPUs while the rank waits (num_cpus 0: Ray counts them once).
        share = {"num_gpus": 0.5} if self.cuda else {}
        return {**self._strategy(self.actor_pg, index % self.cfg.actor.world_size), "num_cpus": 0, **share}

    def to_training(self, actor: Any, engines: Any) -> dict[str, float]:
        """Engines release weights and KV cache; the actor loads its state back onto its devices."""
        released = 0
        for url in engines.urls:
            engines.client.post(url, "/release_memory_occupation", {"tags": MEMORY_TAGS})
            _, info = engines.client.get(url, "/server_info")
            states = (info or {}).get("internal_states") or [{}] if isinstance(info, dict) else [{}]
            released += bool(states[0].get("weights_released"))  # our server says so; SGLang's does not
        moved = sum(r["bytes"] for r in actor.call("onload"))
        return {"placement/onload_gib": moved / 2**30, "placement/engines_released": float(released)}

    def sync_weights(self, sync: Any, version: int) -> dict[str, float]:
        engines = sync.pool
        for url in engines.urls:
            engines.client.post(url, "/resume_memory_occupation", {"tags": ["weights"]})
        sync.push(version)
        moved = sum(r["bytes"] for r in sync.actor.call("offload"))
        for url in engines.urls:
            engines.client.post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        return {"placement/offload_gib": moved / 2**30}

    def to_generation(self, sync: Any, version: int) -> dict[str, float]:
        """The engines released their weights for training: they take the unchanged ones back (same version)."""
        return self.sync_weights(sync, version)


PLACEMENTS: dict[str, type[SplitPlacement]] = {"split": SplitPlacement, "colocated": ColocatedPlacement}
"""trainer.placement choices."""


def ray_cpu_reservations(cfg: RLConfig) -> list[tuple[str, float]]:
    """What the run's Ray actors reserve, term by term (the config keys behind each, its logical CPUs): the actor's and
    the critic's Megatron ranks, the embedded engines with split placement (colocated, they use their rank's
    bundle), one per node actor of a real SGLang engine, and the reward-model worker."""
    actor, critic, rollout = cfg.actor, cfg.critic, cfg.rollout
    terms = [
        (f"actor.world_size={actor.world_size} x actor.num_cpus_per_rank={actor.num_cpus_per_rank:g}",
         actor.world_size * actor.num_cpus_per_rank),
    ]  # fmt: skip
    if critic.enable:
        terms.append((
            f"critic.world_size={critic.world_size} x critic.num_cpus_per_rank={critic.num_cpus_per_rank:g}",
            critic.world_size * critic.num_cpus_per_rank,
        ))  # fmt: skip
    if rollout.engine == "hf" and cfg.trainer.placement == "split":
        terms.append((
            f"rollout.num_engines={rollout.num_engines} x rollout.num_cpus={rollout.num_cpus:g}",
            rollout.num_engines * rollout.num_cpus,
        ))  # fmt: skip
    elif rollout.engine != "hf":  # SGLangServerActor: num_cpus=1 per node
        terms.append((
            f"rollout.num_engines={rollout.num_engines} x rollout.sglang.nnodes={rollout.sglang.nnodes}",
            float(rollout.num_engines * rollout.sglang.nnodes),
        ))  # fmt: skip
    if cfg.reward.model_path and cfg.reward.model_num_cpus:
        terms.append((f"reward.model_num_cpus={cfg.reward.model_num_cpus:g}", cfg.reward.model_num_cpus))
    return terms


def ray_cpus_needed(cfg: RLConfig) -> float:
    """Logical CPUs the run's Ray actors reserve (ray_cpu_reservations summed): the one figure behind the local Ray's
    size and pre-flight's check of trainer.ray_num_cpus."""
    return sum(cpus for _, cpus in ray_cpu_reservations(cfg))


def init_ray(cfg: RLConfig) -> None:
    """Connect to trainer.ray_address, or start a local Ray of trainer.ray_num_cpus logical CPUs (default: what the
    actors reserve, plus one spare for Ray's own work); quiet (mcore_rl/_quiet.py). No-op if Ray is up."""
    import math

    import ray

    from mcore_rl._quiet import ray_init_kwargs

    if ray.is_initialized():
        return
    cpus = cfg.trainer.ray_num_cpus or math.ceil(ray_cpus_needed(cfg)) + 1
    try:
        ray.init(
            # null: a new local Ray ("local"), even where RAY_ADDRESS is set or a `ray start` cluster runs here (with
            # address=None Ray would join that one, unsized and without its token)
            address=cfg.trainer.ray_address or "local",
            num_cpus=None if cfg.trainer.ray_address else cpus,
            include_dashboard=False,
            log_to_driver=True,
            **ray_init_kwargs(),
        )
    except ConnectionError as err:  # ray.init's message names the address; the cause says why (refused, auth token)
        if not cfg.trainer.ray_address:
            raise
        from mcore_rl.preflight import ray_connect_error

        raise ray_connect_error(cfg.trainer.ray_address, err) from err


def make_placement(cfg: RLConfig) -> SplitPlacement:
    """The run's placement (Ray must be initialised: the pools are reserved now)."""
    return PLACEMENTS[cfg.trainer.placement](cfg)
