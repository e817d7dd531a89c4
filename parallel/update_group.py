"""Weight-update broadcast groups: trainer ranks and rollout-engine ranks in one process group, outside torch's
default group.

SGLang's `/init_weights_update_group` joins such a group (`master_address`, `master_port`, `rank_offset`,
`world_size`, `group_name`, `backend`) with its `init_custom_process_group` (init_method `tcp://address:port`, rank
`rank_offset + tp_rank`); rank 0 is the sender and hosts the TCP store. The group is built directly from a `TCPStore`
+ `ProcessGroupGloo` / `ProcessGroupNCCL` under the same store keys as SGLang's side (`sglang_group_store`), so
neither side needs `init_process_group` and a process can hold several groups (one per pipeline stage) beside its own
training groups.

    group = new_update_group("gloo", "127.0.0.1", 29600, rank=0, world_size=3, group_name="pp0")
    broadcast(group, flat_bucket, src=0)

vLLM engines on GPU join their own NCCL weight-transfer group from a unique id instead; that rendezvous is vLLM's and
lives beside its sender (`mcore_rl/rollout/vllm_nccl.py`), which builds on `UpdateGroup` and the store here.
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
    listener: Any = None,
    store: Any = None,
) -> UpdateGroup:
    """Join (rank 0: host) the broadcast group `group_name`; blocks until all `world_size` ranks have joined (gloo;
    an NCCL communicator is made at the first broadcast, on both sides).

    `backend` is gloo (CPU tensors) or nccl (CUDA tensors). `store` (rank 0): the rendezvous store already serving on
    `master_port` (`serve_store`: the engines' handshakes meet it whenever they come). Else `listener` (rank 0): a
    socket already bound to `master_port` and listening (`reserve_port`), which the TCP store serves on from here, so
    no other process can take the port between the moment it was given out and the store (EADDRINUSE). Raises
    ValueError for a bad argument, RuntimeError (from torch) when the rendezvous times out.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    if not group_name:
        raise ValueError("group_name must not be empty")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is not None and rank == 0:
        store.set_timeout(timeout)
    else:
        # the store's server owns the socket from here (it closes it): the Python object lets go of it
        fd = {"master_listen_fd": listener.detach()} if rank == 0 and listener is not None else {}
        store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout, **fd)
    prefixed = sglang_group_store(store, group_name, backend)
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
        options.group_name = group_name  # as torch's _new_process_group_helper sets it
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    # torch's _new_process_group_helper (which builds SGLang's side) does this for every gloo and nccl group: build
    # ours alike
    group._set_sequence_number_for_group()
    return UpdateGroup(group_name, rank, world_size, backend, group, store)


def reserve_port(host: str) -> Any:
    """A socket bound to a free port of `host` and listening: the port is this process's from now on (give
    `socket.getsockname()[1]` out, then the socket to `new_update_group(listener=...)`)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(1024)
    return listener


def serve_store(host: str, listener: Any, timeout_s: float = 300.0) -> dist.TCPStore:
    """A group's rendezvous store, serving at once on the port `listener` holds (`reserve_port`; the store's server
    owns the socket from here). A leader serves it as soon as it hands the port out, not when it joins: an engine
    whose rendezvous handshake comes first (SGLang runs an engine's inits one at a time, in arrival order) then
    completes it instead of blocking on a port that accepts but never answers (torch's handshake ignores its
    timeout there). It waits for no workers; the group (`new_update_group(store=...)`) counts the ranks."""
    return dist.TCPStore(
        host, listener.getsockname()[1], None, True, timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=listener.detach(),
    )  # fmt: skip


def sglang_group_store(store: dist.Store, group_name: str, backend: str) -> dist.PrefixStore:
    """`store` under the key prefixes an SGLang engine's side of the group uses, so both sides meet.

    SGLang's `init_custom_process_group` (sglang/srt/utils/common.py, 0.5.23) wraps the rendezvous store in
    `PrefixStore(group_name)` and hands it to torch's `_new_process_group_helper`, which adds `"{group_name}/"` and
    then the device of the backend (`"cpu/"` for gloo, the first device gloo serves; `"cuda/"` for nccl). A key `k`
    is therefore `{group_name}/{group_name}//{device}//k` on the engines (PrefixStore joins with "/"), and the same
    chain here gives the same keys. tests/test_sglang_receiver_sync.py checks it against SGLang's own function.
    """
    device = "cpu" if backend == "gloo" else "cuda"
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))


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
