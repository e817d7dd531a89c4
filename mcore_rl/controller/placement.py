"""Where the actor ranks, the critic's ranks and the rollout engines run, and what they hand each other between phases.

    placement = make_placement(cfg)                    # after ray.init: checks, then reserves the pools
    ActorGroup(..., options=placement.actor_options)   # rank r -> its bundle
    CriticGroup(..., options=placement.critic_options)
    EnginePool(..., engine_options=placement.engine_options)   # engine i (node k of a multi-node engine) -> bundle
    placement.to_training(actor, engines)             # after a step's generation
    placement.sync_weights(sync, version)             # after the update: the weight push, and back to generation

Before anything is reserved, the GPU count (controller/gpu_plan.py, the dry run's own) must fit the cluster's GPUs
and the sync transport must suit the placement: refused at once (PlacementError, exit 2), never a wait. Every wait on
Ray (a pool's reservation, an actor's scheduling, an engine's start) has a limit and names what it waits for.

split      a placement group per role: one bundle per actor rank and per critic rank ({CPU: num_cpus_per_rank,
           GPU: 1 on CUDA}); one per embedded engine ({CPU: rollout.num_cpus, GPU: 1 on CUDA}) or per node of a real
           SGLang engine ({CPU: 1, GPU: tp / nnodes}). Generation and training can overlap (rollout.max_staleness > 0).
           The phase hooks do nothing.
colocated  one placement group with a bundle per actor rank; on CUDA its bundles are ordered by (node, GPU), as
           slime orders them, so consecutive bundles are one node's consecutive GPUs. Critic rank r shares bundle r.
           Engines share the bundles too, with a fraction of each GPU (Ray counts a GPU once: actor 0.4 + critic
           0.3 + engine 0.2): an embedded engine i takes bundle i % world; node k of SGLang engine e the tp / nnodes
           bundles from (e x nnodes + k) x tp / nnodes on (a vLLM engine e: the tp x dp bundles from e x tp x dp on,
           one node), its Ray actor holding the first and its server seeing all of them (CUDA_VISIBLE_DEVICES set
           from the bundles' GPUs, Ray told not to override it). While the actor trains, engines release weights
           and KV cache (/release_memory_occupation: SGLang's memory saver; vLLM's sleep level 1, the launcher
           starting colocated vLLM engines in sleep mode; our server drops its parameters); while engines
           generate, the actor offloads parameters, gradients and
           optimizer state to host memory (CUDA; on CPU, where they already are, it frees its gradient buffers and
           sync buckets instead, and returns its free heap pages: actor/offload.py). The hand-over back to
           generation is verl's order: engines resume their weights -> the push refills them from the actor's (still
           on device) -> the actor offloads -> engines resume their KV cache -> generation continues.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from mcore_rl.config import ConfigError
from mcore_rl.controller.gpu_plan import PlacementError, check_fits, check_transport, engine_shape

if TYPE_CHECKING:
    from mcore_rl.config import RLConfig

log = logging.getLogger(__name__)

#: fractions of a colocated GPU Ray counts for each role on one bundle (their sum stays below 1)
GPU_SHARES = {"actor": 0.4, "critic": 0.3, "engine": 0.2}
RESERVE_TIMEOUT_S = 120.0  #: a placement group's reservation, or an actor's scheduling onto its reserved bundle
#: Ray tells a process not to set CUDA_VISIBLE_DEVICES itself (its accelerator manager reads it), so a colocated
#: SGLang node sees every GPU of its bundles, not only the one whose fraction its Ray actor holds
NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
#: Ray settings of a local Ray this run starts (a cluster's own are its head's: ray.init refuses them when connecting).
#: Ray 2.60's raylet starts one idle Python worker per logical CPU when the first driver connects; a run starts one
#: Ray actor per rank and engine (fewer than its CPUs: each takes several), so the rest only took CPU from the
#: workers importing torch on a small host (2 cores: the start-up's CPU-bound phases, metrics/startup.py).
LOCAL_RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


def ray_wait(refs: list[Any], what: str, timeout_s: float) -> list[Any]:
    """ray.get(refs) within `timeout_s`; TimeoutError naming `what` and the cluster's free resources otherwise."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise TimeoutError(
            f"waited {timeout_s:g} s for {what}; Ray's free resources: {_free()} of {_total()}"
        ) from None


def wait_scheduled(handles: list[Any], what: str, timeout_s: float | None = None) -> None:
    """Wait until Ray has placed and constructed the actors `handles` (TimeoutError naming `what` otherwise), at
    most `timeout_s` (default RESERVE_TIMEOUT_S)."""
    limit = RESERVE_TIMEOUT_S if timeout_s is None else timeout_s
    ray_wait([h.__ray_ready__.remote() for h in handles], f"Ray to schedule {what}", limit)


def _free() -> dict[str, float]:
    import ray

    return {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}


def _total() -> dict[str, float]:
    import ray

    return {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}


class SplitPlacement:
    """Separate pools for the actor, the critic and the engines (see the module docstring)."""

    name = "split"
    #: whether the actor ranks may start while the engines start (train.py): yes on separate devices
    overlap_startup = True

    def __init__(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        self.cuda = cfg.trainer.runtime == "cuda"
        self.count = _check_cluster(cfg)
        gpu = {"GPU": 1} if self.cuda else {}
        self.actor_pg = self._reserve("actor", [{"CPU": cfg.actor.num_cpus_per_rank, **gpu}] * cfg.actor.world_size)
        self.critic_pg = None
        if cfg.critic.enable:
            self.critic_pg = self._reserve(
                "critic", [{"CPU": cfg.critic.num_cpus_per_rank, **gpu}] * cfg.critic.world_size
            )
        rollout = cfg.rollout
        if rollout.kind.embedded:
            bundles = [{"CPU": rollout.num_cpus, **gpu}] * rollout.num_engines
        else:  # one bundle per node of each SGLang or vLLM engine: the node's GPUs of that engine
            nnodes = engine_shape(rollout, cfg.trainer.runtime).nnodes
            bundles = [{"CPU": 1, "GPU": self.count.engine_node_gpus}] * (rollout.num_engines * nnodes)
        self.engine_pg = self._reserve("engines", bundles)
        self._wait()

    def _reserve(self, role: str, bundles: list[dict[str, float]]) -> Any:
        from ray.util.placement_group import placement_group

        group = placement_group(bundles, strategy="PACK", name="")
        self.groups = [*getattr(self, "groups", []), group]
        self.roles = [*getattr(self, "roles", []), role]
        return group

    def _wait(self, timeout_s: float = RESERVE_TIMEOUT_S) -> None:
        import ray

        refs = [g.ready() for g in self.groups]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) != len(refs):
            pending = [
                f"{role} {g.bundle_specs}" for role, g, ref in zip(self.roles, self.groups, refs) if ref not in ready
            ]
            self.shutdown()
            raise TimeoutError(
                f"trainer.placement={self.name}: Ray could not reserve the pools within {timeout_s:.0f} s "
                f"(waiting for: {'; '.join(pending)}; free {_free()} of {_total()})"
            )

    @staticmethod
    def _strategy(pg: Any, bundle: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)}

    def actor_options(self, rank: int) -> dict[str, Any]:
        """Ray options of actor rank `rank`."""
        return self._strategy(self.actor_pg, rank)

    def critic_options(self, rank: int) -> dict[str, Any]:
        """Ray options of critic rank `rank`."""
        if self.critic_pg is None:
            raise PlacementError("critic_options: this run has no critic (critic.enable=false)")
        return self._strategy(self.critic_pg, rank)

    def engine_options(self, index: int, node_rank: int = 0) -> dict[str, Any]:
        """Ray options of engine `index` (also its replacement after a crash); for a real SGLang engine, of its
        node `node_rank`'s actor, which holds that node's GPUs of the engine."""
        if self.cfg.rollout.kind.embedded:
            return self._strategy(self.engine_pg, index)
        per_node = self.count.engine_node_gpus
        bundle = index * engine_shape(self.cfg.rollout, self.cfg.trainer.runtime).nnodes + node_rank
        return {**self._strategy(self.engine_pg, bundle), "num_gpus": per_node, "num_cpus": 1}

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
    """Actor ranks, critic ranks and engines on the same bundles, taking turns (see the module docstring)."""

    name = "colocated"

    def __init__(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        self.cuda = cfg.trainer.runtime == "cuda"
        self.count = _check_cluster(cfg)
        # On a shared GPU the engine sizes its KV cache from the memory free when it starts, so the actor ranks
        # build first (verl's order); on CPU nothing is shared that a start-up measures.
        self.overlap_startup = not self.cuda
        gpu = {"GPU": 1} if self.cuda else {}
        self.actor_pg = self._reserve("actor", [{"CPU": cfg.actor.num_cpus_per_rank, **gpu}] * cfg.actor.world_size)
        self.critic_pg = self.engine_pg = None
        self._wait()
        #: bundle index of position i (node, then GPU order on CUDA) and its (node address, GPU id)
        self.order, self.where = self._bundle_order()

    def _bundle_order(self) -> tuple[list[int], list[tuple[str, str]]]:
        """Bundles sorted by (node address, GPU id), found by a probe on each (slime's way): Ray's bundle indices
        follow no node or GPU order, and one SGLang node needs consecutive bundles of one node."""
        world = self.cfg.actor.world_size
        if not self.cuda:
            return list(range(world)), [("", "")] * world
        import ray

        probe = ray.remote(_GpuProbe)
        probes = [probe.options(num_cpus=0, num_gpus=0.01, **self._strategy(self.actor_pg, i)).remote()
                  for i in range(world)]  # fmt: skip
        try:
            found = ray_wait(
                [p.where.remote() for p in probes], "the GPU probe of every actor bundle", RESERVE_TIMEOUT_S
            )
        finally:
            for p in probes:
                ray.kill(p)
        order = sorted(range(world), key=lambda i: (_ip_key(found[i][0]), _gpu_key(found[i][1])))
        return order, [found[i] for i in order]

    def actor_options(self, rank: int) -> dict[str, Any]:
        share = {"num_gpus": GPU_SHARES["actor"]} if self.cuda else {}
        return {**self._strategy(self.actor_pg, self.order[rank]), **share}

    def critic_options(self, rank: int) -> dict[str, Any]:
        if not self.cfg.critic.enable:
            raise PlacementError("critic_options: this run has no critic (critic.enable=false)")
        # the critic uses the rank's CPUs while the actor rank waits (num_cpus 0: Ray counts them once)
        share = {"num_gpus": GPU_SHARES["critic"]} if self.cuda else {}
        return {**self._strategy(self.actor_pg, self.order[rank]), "num_cpus": 0, **share}

    def engine_options(self, index: int, node_rank: int = 0) -> dict[str, Any]:
        share = {"num_gpus": GPU_SHARES["engine"]} if self.cuda else {}
        world = self.cfg.actor.world_size
        if self.cfg.rollout.kind.embedded:
            # The engine uses the rank's CPUs while the rank waits (num_cpus 0: Ray counts them once).
            return {**self._strategy(self.actor_pg, self.order[index % world]), "num_cpus": 0, **share}
        per_node = self.count.engine_node_gpus
        first = (index * engine_shape(self.cfg.rollout, self.cfg.trainer.runtime).nnodes + node_rank) * per_node
        positions = range(first, first + per_node)
        nodes = {self.where[i][0] for i in positions}
        if len(nodes) != 1:
            terms = engine_shape(self.cfg.rollout, self.cfg.trainer.runtime).terms()
            raise PlacementError(
                f"rollout engine {index} node {node_rank} would span actor bundles {list(positions)} on nodes "
                f"{sorted(nodes)}: expected the {per_node} GPUs ({terms}, over its nodes) of one node; make them "
                "divide the GPUs per node"
            )
        gpus = ",".join(self.where[i][1] for i in positions)
        env = {NOSET_CUDA: "1", "CUDA_VISIBLE_DEVICES": gpus} if self.cuda else {}
        return {
            **self._strategy(self.actor_pg, self.order[first]),
            "num_cpus": 0,
            **share,
            "runtime_env": {"env_vars": env},
        }

    def to_training(self, actor: Any, engines: Any) -> dict[str, float]:
        """Engines release weights and KV cache; the actor loads its state back onto its devices."""
        released = 0
        engines.release_memory()  # weights, KV cache and CUDA graphs; no /health probes until they are back
        for url in engines.urls:
            if not engines.client.dialect.server_info_is_cheap:
                # vLLM's /server_info collects its host's environment (seconds: past the GET's 10 s on a loaded
                # host) and says nothing of released memory (rollout/vllm_transfer.py: its sleep mode)
                break
            _, info = engines.client.get(url, "/server_info")
            states = (info or {}).get("internal_states") or [{}] if isinstance(info, dict) else [{}]
            released += bool(states[0].get("weights_released"))  # our server says so; SGLang's does not
        from mcore_rl.actor.megatron_actor import MegatronActor

        moved = sum(r["bytes"] for r in actor.call(MegatronActor.onload))
        return {"placement/onload_gib": moved / 2**30, "placement/engines_released": float(released)}

    def engine_ranks(self) -> list[list[int]]:
        """Engine index -> the actor rank sharing the GPU of each of its TP ranks. SGLang engine e's TP rank r is on
        bundle position e x tp + r (node k's GPUs are positions (e x nnodes + k) x tp / nnodes on, in the order of
        its CUDA_VISIBLE_DEVICES, and SGLang numbers TP ranks node by node), and actor rank i on position i; any
        other engine i is one rank on position i % world."""
        rollout, world = self.cfg.rollout, self.cfg.actor.world_size
        if rollout.kind.embedded:
            return [[i % world] for i in range(rollout.num_engines)]
        tp = engine_shape(rollout, self.cfg.trainer.runtime).ranks  # vLLM: tp x dp ranks, replica by replica
        return [[e * tp + r for r in range(tp)] for e in range(rollout.num_engines)]

    def sync_weights(self, sync: Any, version: int) -> dict[str, float]:
        # on CUDA an engine rank opens only payloads made on its own GPU: the tensor transport needs the map (on
        # CPU every process maps shared memory, and the leader alone sends, as in split placement)
        sync.colocation = self.engine_ranks() if self.cuda else None
        engines = sync.pool
        # Generation continues only once the KV cache and CUDA graphs are back: the push's own
        # /continue_generation would let SGLang's scheduler run batches on a released KV pool.
        from mcore_rl.actor.megatron_actor import MegatronActor

        with sync.fence.continue_after():
            # On the CPU runtime the actor moves nothing and frees its gradients and the step's activations, so it
            # does that before the engines take their weights back, not on top of them (actor/offload.py); on CUDA
            # the push reads the weights from the actor's GPUs, so it offloads after it
            offloaded = [] if self.cuda else sync.actor.call(MegatronActor.offload)
            # only what an engine released is resumed (at start nothing is: SGLang's scheduler dies resuming a tag
            # it never released)
            engines.resume_memory(["weights"])
            sync.push(version)
            if self.cuda:
                offloaded = sync.actor.call(MegatronActor.offload)
            engines.resume_memory(["kv_cache", "cuda_graph"])
        out = {"placement/offload_gib": sum(r["bytes"] for r in offloaded) / 2**30}
        if any("freed" in r for r in offloaded):  # the CPU runtime frees instead (actor/offload.py)
            out["placement/freed_gib"] = sum(r.get("freed", 0) for r in offloaded) / 2**30
        return out

    def to_generation(self, sync: Any, version: int) -> dict[str, float]:
        """The engines released their weights for training: they take the unchanged ones back (same version)."""
        return self.sync_weights(sync, version)


class _GpuProbe:
    """Ray actor body: where its bundle is (node address, the GPU id Ray gave it)."""

    def where(self) -> tuple[str, str]:
        import ray

        return ray.util.get_node_ip_address(), str(ray.get_gpu_ids()[0])


def _ip_key(address: str) -> tuple[int, ...] | tuple[str]:
    try:
        return tuple(int(p) for p in address.split("."))
    except ValueError:
        return (address,)


def _gpu_key(gpu: str) -> tuple[int, str]:
    return (int(gpu), "") if gpu.isdigit() else (1 << 30, gpu)  # numeric ids in number order; UUIDs after


def _check_cluster(cfg: RLConfig) -> Any:
    """The GPU count against the connected cluster's GPUs, and the transport against the placement: PlacementError
    at once (never a reservation that would wait for GPUs that do not exist)."""
    import ray

    check_transport(cfg)
    if cfg.trainer.runtime != "cuda":
        return check_fits(cfg, 0, None, "a CPU run")
    gpus = ray.cluster_resources().get("GPU", 0)
    per_node = [n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive")]
    return check_fits(cfg, gpus, int(max(per_node, default=0)), f"the Ray cluster ({len(per_node)} nodes)")


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
    if rollout.kind.embedded and cfg.trainer.placement == "split":
        terms.append((
            f"rollout.num_engines={rollout.num_engines} x rollout.num_cpus={rollout.num_cpus:g}",
            rollout.num_engines * rollout.num_cpus,
        ))  # fmt: skip
    elif not rollout.kind.embedded:  # SGLangServerActor (vLLM's too): num_cpus=1 per node
        nnodes = engine_shape(rollout, cfg.trainer.runtime).nnodes
        terms.append((
            f"rollout.num_engines={rollout.num_engines} x {nnodes} node(s) per engine",
            float(rollout.num_engines * nnodes),
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
            **({} if cfg.trainer.ray_address else {"_system_config": LOCAL_RAY_SYSTEM_CONFIG}),
        )
    except ConnectionError as err:  # ray.init's message names the address; the cause says why (refused, auth token)
        if not cfg.trainer.ray_address:
            raise
        raise ray_connect_error(cfg.trainer.ray_address, err) from err
    from mcore_rl.watchdog import reclaim_sigterm

    reclaim_sigterm()  # ray.init replaced the run's SIGTERM handler (watchdog.py says why that matters)


def ray_connect_error(address: str, err: BaseException) -> ConfigError:
    """The user error for a cluster at `address` that answers but refuses this process, most often its auth token
    (raised by init_ray when ray.init fails to connect, and by pre-flight's token check)."""
    cause = f" ({type(err.__cause__).__name__})" if err.__cause__ is not None else ""
    return ConfigError(
        f"trainer.ray_address={address!r}: {err}{cause}; expected the address of a running Ray cluster "
        "(`ray start --head` prints it) whose auth token this process has (RAY_AUTH_MODE=token and RAY_AUTH_TOKEN, as "
        "launch/submit.py sets), or null for a local Ray"
    )


def make_placement(cfg: RLConfig) -> SplitPlacement:
    """The run's placement (Ray must be initialised: the pools are reserved now). Before anything is reserved: the
    GPU packages real SGLang engines need (mcore_rl/gpu_extra.py), the GPU count and the transport (_check_cluster)."""
    from mcore_rl.gpu_extra import check_gpu_extra

    check_gpu_extra(cfg)
    return PLACEMENTS[cfg.trainer.placement](cfg)
