"""Weight-update broadcast groups: trainer ranks and rollout-engine ranks in one process group, outside torch's
default group.

SGLang's `/init_weights_update_group` joins such a group (`master_address`, `master_port`, `rank_offset`,
`world_size`, `group_name`, `backend`); rank 0 is the sender and hosts the TCP store. The group is built directly
from a `TCPStore` + `ProcessGroupGloo` / `ProcessGroupNCCL`, so neither side needs `init_process_group` and a process
can hold several groups (one per pipeline stage) beside its own training groups.

    group = new_update_group("gloo", "127.0.0.1", 29600, rank=0, world_size=3, group_name="pp0")
    broadcast(group, flat_bucket, src=0)
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class UpdateGroup:
    """A joined broadcast group; it keeps the TCP store alive as long as the group (rank 0 serves it)."""

    name: str
    rank: int
    world_size: int
    backend: str
    group: dist.ProcessGroup
    store: Any


def new_update_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300.0,
) -> UpdateGroup:
    """Join (rank 0: host) the broadcast group `group_name`; blocks until all `world_size` ranks have joined.

    `backend` is gloo (CPU tensors) or nccl (CUDA tensors). Raises ValueError for a bad argument, RuntimeError (from
    torch) when the rendezvous times out.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    if not group_name:
        raise ValueError("group_name must not be empty")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(f"mcore_rl_update/{group_name}/", store)
    if backend == "gloo":
        # Gloo advertises the address its hostname resolves to, which is loopback on many machines (and in network
        # namespaces): bind it to the local address that routes to the master instead, so peers on other nodes
        # reach it.
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address(master_address, master_port))]
        options._timeout = timeout
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return UpdateGroup(group_name, rank, world_size, backend, group, store)


def _local_address(master_address: str, master_port: int) -> str:
    """This host's address on the route to the master (a UDP connect sends nothing)."""
    import socket

    family = socket.AF_INET6 if ":" in master_address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master_address, master_port))
            return s.getsockname()[0]
        except OSError:
            return master_address if master_address.startswith("127.") else "127.0.0.1"


def broadcast(group: UpdateGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast `tensor` from `src` to every rank of `group`, in place; waits for completion."""
    options = dist.BroadcastOptions()
    options.rootRank = src
    group.group.broadcast([tensor], options).wait()
