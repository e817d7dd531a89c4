"""Process groups: start torch.distributed for a runtime and build Megatron's groups for a layout.

This is the only module that touches `megatron.core.parallel_state`. Everything else receives the
`ProcessGroupCollection` returned by `initialize_model_parallel` (Megatron's guidance: pass groups in, do not read the
globals).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from mcore_rl.parallel.layout import ParallelLayout

RUNTIMES = ("cpu", "cuda")


def backend_for(runtime: str) -> str:
    """The torch.distributed backend of a runtime: gloo on CPU, NCCL on CUDA."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    return "gloo" if runtime == "cpu" else "nccl"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (loopback by default: rendezvous of local ranks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_distributed(
    runtime: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float | None = None,
    local_rank: int | None = None,
) -> None:
    """Start torch.distributed for this rank (idempotent) and prepare the runtime's device.

    On `cpu` this installs the CPU patches first (see cpu_runtime.py); on `cuda` it binds the rank to its local GPU.
    `timeout_s`: how long a collective waits for its peers; None = `MCORE_RL_DIST_TIMEOUT_S` (launch/submit.py sets
    an hour on GPU runs: a peer may be reading its part of a 1.3 TB checkpoint), else torch's 10 minutes.
    """
    if timeout_s is None:
        timeout_s = float(os.environ.get("MCORE_RL_DIST_TIMEOUT_S", "600"))
    if runtime == "cpu":
        from mcore_rl.parallel.cpu_runtime import enable_cpu_runtime

        enable_cpu_runtime()
    elif runtime == "cuda":
        torch.cuda.set_device(local_rank if local_rank is not None else rank % torch.cuda.device_count())
    if dist.is_initialized():
        return
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    dist.init_process_group(
        backend=backend_for(runtime),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def initialize_model_parallel(layout: ParallelLayout, seed: int = 1234):
    """Build Megatron's process groups for `layout` on the running world and seed its RNG streams.

    Returns a `megatron.core.process_groups_config.ProcessGroupCollection` to pass into models and schedules.
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world_size = dist.get_world_size()
    layout.validate(world_size)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.virtual_stages > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        # Gloo side groups duplicate every group; on CPU the main groups already are gloo.
        create_gloo_process_groups=False,
    )
    model_parallel_cuda_manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups()


def destroy_model_parallel() -> None:
    """Tear down Megatron's groups and torch.distributed (for tests and clean shutdown)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
