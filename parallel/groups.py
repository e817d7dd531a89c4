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
from mcore_rl.parallel.net import is_loopback

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
    timeout = datetime.timedelta(seconds=timeout_s)
    if is_loopback(master_addr) and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo listens on the address the hostname resolves to (often the LAN's): keep a local world on loopback
        interface = _loopback_interface()
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    dist.init_process_group(
        backend=backend_for(runtime),
        store=_store(master_addr, master_port, rank, world_size, timeout),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def rendezvous_host() -> str:
    """Where a run's ranks meet (torch.distributed's store, weight-update groups): loopback when every process of the
    run is on this machine (no Ray, or a Ray cluster of one node), so nothing listens beyond it; else this node's
    address. (A node that joins later does not change a rendezvous already made.)"""
    import ray

    if not ray.is_initialized():
        return "127.0.0.1"
    if sum(1 for node in ray.nodes() if node.get("Alive")) == 1:
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def _loopback_interface() -> str | None:
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addresses):
            return name
    return None


def _store(master_addr: str, master_port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """torch.distributed's TCP store, served by rank 0 on `master_addr` only: torch's own (init_method env://) listens
    on every interface (`::`) without authentication, so a local run bound all of them. Rank 0 binds the socket and
    hands it to the store (master_listen_fd, libuv backend)."""
    listener = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((master_addr, master_port))
        listener.listen(1024)
    fd = {"master_listen_fd": listener.detach()} if listener is not None else {}  # the store closes it
    return dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=timeout, **fd)


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
