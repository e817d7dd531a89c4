"""Where a Megatron rank's tensors live on each runtime, and the checks a CUDA run needs before any rank starts.

    device = rank_device(runtime)            # cuda:<local> on CUDA runs, cpu on the CPU runtime
    payload = to_host(payload)               # what goes back to the Ray driver: CPU tensors, always
    torch.set_num_threads(threads_per_rank(runtime))
    check_runtime(cfg)                       # pre-flight (mcore_rl/preflight.py): ConfigError naming the key
                                             # (no GPU; cp > 1; packing or optimizer offload without TE)

The batch arrives from the driver in host memory and the micro-batcher moves it to `rank_device` (actor/batch.py);
what a rank returns (logprobs, values, metrics) goes back to the driver through Ray's object store, which must not
receive CUDA tensors (the driver has no GPU; unpickling one there fails).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from mcore_rl.config import ConfigError

if TYPE_CHECKING:
    from mcore_rl.config import RLConfig

#: environment variable that overrides the intra-op threads of a rank (both runtimes)
THREADS_ENV = "MCORE_RL_THREADS_PER_RANK"


def rank_device(runtime: str) -> torch.device:
    """The device this rank computes on: its current CUDA device (set by parallel/groups.py) or the CPU."""
    if runtime == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_host(obj: Any) -> Any:
    """`obj` with every tensor inside (dicts, lists, tuples) moved to host memory; other values as they are."""
    if torch.is_tensor(obj):
        return obj if obj.device.type == "cpu" else obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj


def threads_per_rank(runtime: str, env: dict[str, str] | None = None, cpus: int | None = None,
                     local_ranks: int | None = None, reserved: float = 1.0) -> int:  # fmt: skip
    """Intra-op threads of one rank: `MCORE_RL_THREADS_PER_RANK` when set; else, on the CPU runtime, the Ray CPUs the
    rank reserves (`reserved`: num_cpus_per_rank, whole CPUs, at least 1; every rank is a process on the same cores,
    so more threads than that only oversubscribe them); on CUDA the cores this process may use shared by the node's
    GPU ranks, since the CPU work there is Megatron's CPU Adam when the optimizer is offloaded (HybridDeviceOptimizer
    steps the host share with torch on these threads) and host copies."""
    env = os.environ if env is None else env
    if env.get(THREADS_ENV):
        try:
            value = int(env[THREADS_ENV])
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigError(f"{THREADS_ENV}={env[THREADS_ENV]!r} is invalid: expected an integer >= 1")
        return value
    if runtime != "cuda":
        return max(1, int(reserved))
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    local_ranks = local_ranks if local_ranks is not None else node_gpus()
    return max(1, cpus // local_ranks)


def node_gpus(proc: str = "/proc/driver/nvidia/gpus") -> int:
    """GPUs on this node, one rank each: the NVIDIA driver's list, which CUDA_VISIBLE_DEVICES does not narrow (Ray
    shows each rank only its own GPU, so torch.cuda.device_count() is 1 there); torch's count where the list is
    missing."""
    try:
        found = len(os.listdir(proc))
    except OSError:
        found = 0
    return max(1, found or (torch.cuda.device_count() if torch.cuda.is_available() else 1))


def cuda_problem(runtime: str, visible_gpus: int | None = None) -> str | None:
    """Why `trainer.runtime=cuda` cannot start here (no GPU visible), or None."""
    if runtime != "cuda":
        return None
    if visible_gpus is None:
        visible_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible_gpus == 0:
        return (
            "trainer.runtime=cuda: no GPU is visible to this process (torch.cuda.is_available() is false; "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); expected a CUDA build of "
            "torch on a GPU node, or trainer.runtime=cpu"
        )
    return None


def layout_problem(group: str, cp: int, runtime: str, te: bool) -> str | None:
    """Why a worker group's context parallelism cannot run (or None). CP lives in Transformer Engine's attention, and
    the actor does not split sequences per CP rank yet (zigzag split + logprob gather): cp > 1 would compute wrong
    logprobs silently, so it is refused on every runtime."""
    if cp <= 1:
        return None
    need = "" if te or runtime != "cuda" else " and needs Transformer Engine, which is not importable here"
    return (
        f"{group}.layout.cp={cp} is not supported: the actor does not split sequences per context-parallel rank "
        f"(zigzag split and logprob gather are not implemented){need}; expected {group}.layout.cp=1"
    )


def check_runtime(cfg: RLConfig, visible_gpus: int | None = None, te: bool | None = None) -> None:
    """Pre-flight of the device runtime and what the workers' settings need from it; ConfigError naming the key."""
    from mcore_rl.models.spec import te_in_use

    runtime = cfg.trainer.runtime
    problem = cuda_problem(runtime, visible_gpus)
    if problem:
        raise ConfigError(problem)
    te = te_in_use(runtime) if te is None else te
    groups = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.critic.enable else [])
    for name, group in groups:
        problem = layout_problem(name, group.layout.cp, runtime, te)
        if problem:
            raise ConfigError(problem)
        if getattr(group, "dynamic_batching", False) and (
            group.layout.ep > 1 or (group.layout.pp > 1 and runtime != "cuda")
        ):
            # every expert-parallel rank must run the same micro-batches (its collectives pair them up), and the CPU
            # path exchanges one fixed shape between pipeline stages
            raise ConfigError(
                f"{name}.dynamic_batching=true is invalid with {name}.layout.ep={group.layout.ep}, "
                f"pp={group.layout.pp} on trainer.runtime={runtime}: expected ep=1, and pp=1 unless runtime=cuda"
            )
        if getattr(group, "packing", False):
            if not te:
                where = " (not importable here)" if runtime == "cuda" else f" (trainer.runtime={runtime})"
                why = "needs Transformer Engine's attention (THD format), which this run does not use" + where
            elif group.dynamic_batching:
                why = "is not combined with dynamic_batching"
            elif getattr(group, "router_replay_mode", "disabled") != "disabled":
                why = "is not combined with routing replay (it replays [batch, sequence] layouts)"
            else:
                why = None
            if why:
                raise ConfigError(f"{name}.packing=true {why}; expected {name}.packing=false")
        moe_problem = _moe_problem(name, group, runtime, te)
        if moe_problem:
            raise ConfigError(moe_problem)
        from mcore_rl.actor.optimizer import optimizer_plan

        optimizer_plan(group.optim, cfg.model.dtype, runtime, f"{name}.optim")  # its nulls resolved by the runtime
        if group.optim.offload_fraction and runtime == "cuda" and not te:
            # 0.16.1's HybridDeviceOptimizer runs through the precision-aware optimizer, which asks TE's version
            raise ConfigError(
                f"{name}.optim.offload_fraction={group.optim.offload_fraction!r} needs Transformer Engine (Megatron's "
                "precision-aware optimizer), which is not importable here; expected 0, or install the GPU extra"
            )


def _moe_problem(name: str, group: Any, runtime: str, te: bool) -> str | None:
    """Why the MoE dispatcher / permute settings cannot run here, or None."""
    import importlib.util

    dispatcher = getattr(group, "moe_dispatcher", None)
    if dispatcher == "alltoall" and runtime != "cuda":
        return f"{name}.moe_dispatcher='alltoall' needs trainer.runtime=cuda (it creates a CUDA stream); expected null"
    if dispatcher == "flex":
        missing = [what for what, ok in (("trainer.runtime=cuda", runtime == "cuda"), ("Transformer Engine", te),
                   ("the deep_ep package", importlib.util.find_spec("deep_ep") is not None)) if not ok]  # fmt: skip
        if missing:
            return f"{name}.moe_dispatcher='flex' (DeepEP) needs {', '.join(missing)}; expected null or alltoall"
    if getattr(group, "moe_permute_fusion", False) and not te:
        return f"{name}.moe_permute_fusion=true needs Transformer Engine's fused permute kernels; expected false"
    return None
