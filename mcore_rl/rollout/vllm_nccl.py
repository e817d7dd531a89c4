"""The stream leader's end of vLLM's `nccl` weight-transfer group: a raw NCCL communicator through ctypes.

vLLM's workers join with `PyNcclCommunicator.from_unique_id_bytes` (vllm_transfer.nccl_init_info); the leader is
rank 0 of the same communicator. torch's ProcessGroupNCCL cannot be that rank (it mints its NCCL id itself and
exchanges it through its own store keys), so this calls libnccl directly, as vLLM's `pynccl_wrapper` does, with the
same signatures (tests/test_vllm_transfer.py compares them with vLLM's table):

```
NcclSender.mint_id()                      ncclGetUniqueId                 -> 128 bytes, sent to the engines in base64
NcclSender(uid, world_size, device)       ncclCommInitRank(rank 0)        blocks until every worker joins, so the
                                          + the warm-up all_reduce         init POSTs run beside it (`connect`)
sender.broadcast([bucket], options)       ncclBroadcast(root 0) on a side stream; a torch-Work-like answer
                                          (is_completed / wait), what DistributedTransport polls
```
The rendezvous around it is vLLM's too: `new_vllm_nccl_group` (the actor's stream leader) mints the id and publishes
it on the rendezvous port the controller gave out; `read_vllm_nccl_rendezvous` (the vLLM dialect, mapping
/init_weights_update_group) reads it there. Only the sender needs CUDA and libnccl (the `libnccl.so.2` a CUDA torch
already loaded), loaded on first use (`load_nccl`).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # vLLM's venv loads this file alone (tests/_vllm_transfer_side.py): no mcore_rl at import
    from mcore_rl.parallel.update_group import UpdateGroup

NCCL_UINT8, NCCL_FLOAT32, NCCL_SUM = 1, 7, 0  #: ncclDataType_t / ncclRedOp_t values (nccl.h; vLLM's enums)


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


_result, _comm, _stream, _buf = ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
#: name -> (restype, argtypes): the subset of nccl.h this sender calls
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ncclGetErrorString": (ctypes.c_char_p, [_result]),
    "ncclGetUniqueId": (_result, [ctypes.POINTER(NcclUniqueId)]),
    "ncclCommInitRank": (_result, [ctypes.POINTER(_comm), ctypes.c_int, NcclUniqueId, ctypes.c_int]),
    "ncclAllReduce": (_result, [_buf, _buf, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _comm, _stream]),
    "ncclBroadcast": (_result, [_buf, _buf, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _comm, _stream]),
    "ncclCommAbort": (_result, [_comm]),
}


def load_nccl(path: str | None = None) -> Any:
    """libnccl with SIGNATURES bound: `path`, else $NCCL_SO_PATH (vLLM reads VLLM_NCCL_SO_PATH; NCCL_SO_PATH here),
    else the `libnccl.so.2` a CUDA torch has loaded. RuntimeError naming what was tried."""
    name = path or os.environ.get("NCCL_SO_PATH") or "libnccl.so.2"
    try:
        lib = ctypes.CDLL(name)
    except OSError as err:
        raise RuntimeError(f"cannot load NCCL ({name}): {err}; a CUDA torch ships it (nvidia-nccl-cu*)") from err
    for fn, (restype, argtypes) in SIGNATURES.items():
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = restype, argtypes
    return lib


class _Work:
    """A broadcast in flight: its CUDA event, and the buffer it reads (kept alive until it is done)."""

    def __init__(self, event: torch.cuda.Event, keep: torch.Tensor) -> None:
        self.event, self.keep = event, keep

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> bool:
        self.event.synchronize()
        return True


class NcclSender:
    """Rank 0 of one stream's vLLM transfer group (see the module docstring). Also the `group` of the leader's
    UpdateGroup for DistributedTransport: `broadcast([tensor], options)` from rank 0."""

    def __init__(self, unique_id: bytes, world_size: int, device: torch.device, lib: Any = None) -> None:
        """Join as rank 0 (blocks until every worker has joined) and run vLLM's warm-up all_reduce."""
        self.lib = lib or load_nccl()
        self.device = torch.device(device)
        self.world_size = world_size
        uid = NcclUniqueId()
        ctypes.memmove(uid.internal, unique_id, 128)
        self.comm = _comm()
        self.stream = torch.cuda.Stream(device=self.device)  # reused: the allocator keys blocks by stream
        with torch.cuda.device(self.device):
            self._check(self.lib.ncclCommInitRank(ctypes.byref(self.comm), world_size, uid, 0), "ncclCommInitRank")
            # PyNcclCommunicator._init_comm: one float32 zero, SUM, right after init; a collective every rank runs
            data = torch.zeros(1, dtype=torch.float32, device=self.device)
            with torch.cuda.stream(self.stream):
                self._check(
                    self.lib.ncclAllReduce(data.data_ptr(), data.data_ptr(), 1, NCCL_FLOAT32, NCCL_SUM, self.comm,
                                           _stream(self.stream.cuda_stream)),
                    "ncclAllReduce (warm-up)",
                )  # fmt: skip
            self.stream.synchronize()

    @staticmethod
    def mint_id(lib: Any = None) -> bytes:
        """A fresh ncclUniqueId (128 bytes), for the leader and every worker of one group."""
        lib = lib or load_nccl()
        uid = NcclUniqueId()
        NcclSender._check_with(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def broadcast(self, tensors: list[torch.Tensor], options: Any = None) -> _Work:
        """Broadcast `tensors[0]` (a contiguous uint8 bucket on this device) from rank 0, after the work queued on
        the current stream (the packing kernel that wrote it)."""
        (tensor,) = tensors
        if tensor.dtype != torch.uint8 or not tensor.is_contiguous() or tensor.device != self.device:
            raise ValueError(f"broadcast takes one contiguous uint8 tensor on {self.device}, got {tensor.dtype} "
                             f"on {tensor.device}")  # fmt: skip
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._check(
                self.lib.ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), NCCL_UINT8, 0, self.comm,
                                       _stream(self.stream.cuda_stream)),
                "ncclBroadcast",
            )  # fmt: skip
            event = torch.cuda.Event()
            event.record(self.stream)
        tensor.record_stream(self.stream)
        return _Work(event, tensor)

    def close(self) -> None:
        """Abort the communicator (no collective: the workers may be gone)."""
        if self.comm:
            self.lib.ncclCommAbort(self.comm)
            self.comm = _comm()

    def _check(self, code: int, what: str) -> None:
        self._check_with(self.lib, code, what)

    @staticmethod
    def _check_with(lib: Any, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed: NCCL error {code} ({lib.ncclGetErrorString(code).decode()})")


def connect(
    unique_id: bytes,
    world_size: int,
    device: torch.device,
    init_engines: Callable[[], Any],
    lib: Any = None,
    timeout_s: float | None = None,
) -> NcclSender:
    """Join as rank 0 while `init_engines()` posts /init_weight_transfer_engine to every engine (the workers block in
    ncclCommInitRank until the leader joins, and the leader until they do): the sender, or the first error. An
    engine that refuses its init never joins, and a blocking ncclCommInitRank cannot be cancelled: the leader's join
    runs in a daemon thread, so the engines' error is raised at once and the stuck join does not hold the process
    (that group is dead; the controller builds a new one with a fresh id). `timeout_s`: TimeoutError when the
    workers have not all joined by then (the sync's leader posts nothing itself: the controller does, through the
    vLLM dialect, so an engine that never joins shows here)."""
    result: dict[str, Any] = {}

    def join() -> None:
        try:
            result["sender"] = NcclSender(unique_id, world_size, device, lib)
        except BaseException as err:  # noqa: BLE001 (handed to the caller's thread)
            result["error"] = err

    thread = threading.Thread(target=join, name="vllm-nccl-join", daemon=True)
    thread.start()
    init_engines()  # raises an engine's refusal; the join stays behind in its thread
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(
            f"vLLM's NCCL weight-transfer group: {world_size - 1} engine ranks did not all join "
            f"within {timeout_s} s (an engine refused /init_weight_transfer_engine, or is not up)"
        )
    if "error" in result:
        raise result["error"]
    return result["sender"]


_connect = connect  # new_vllm_nccl_group's default; its parameter of the same name shadows the function


def _vllm_nccl_key(group_name: str, key: str) -> str:
    """A store key a vLLM-NCCL leader publishes for the vLLM dialect: unique_id | packed_buffer_size_bytes."""
    return f"mcore_rl_vllm/{group_name}/{key}"


def new_vllm_nccl_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    buffer_bytes: int,
    device: Any,
    timeout_s: float = 300.0,
    listener: Any = None,
    connect: Any = None,
    mint_id: Any = None,
    store: Any = None,
) -> UpdateGroup:
    """Host vLLM's `nccl` weight-transfer group as its rank 0 (rollout.engine=vllm on CUDA); blocks until every engine
    rank has joined. vLLM's workers join an NCCL communicator from a unique id (`vllm_transfer.nccl_init_info`), not
    SGLang's store keys: the leader mints the id (`NcclSender.mint_id`) and publishes it, with `buffer_bytes` (the
    plan's largest bucket), in a TCP store on the rendezvous port the controller already gave out, where the vLLM
    dialect reads them when it maps /init_weights_update_group (`read_vllm_nccl_rendezvous`); so the controller's
    order (addresses, joins, init POSTs) is the same as for SGLang. The group is an `NcclSender`, whose
    `broadcast` is what DistributedTransport calls. `connect` / `mint_id` default to this module's (CUDA, libnccl);
    tests pass a stand-in communicator. `store`: the store already serving on the port (`serve_store`), else one is
    started on `listener`."""
    if world_size < 2:
        raise ValueError(f"world_size {world_size}: the leader and at least one engine rank, expected >= 2")
    if buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes (the plan's largest bucket) must be positive, got {buffer_bytes}")
    connect = connect or _connect
    mint_id = mint_id or NcclSender.mint_id
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        fd = {"master_listen_fd": listener.detach()} if listener is not None else {}
        # no workers wait on this store: the dialect's reads are its only clients
        store = dist.TCPStore(master_address, master_port, None, True, timeout=timeout, wait_for_workers=False, **fd)
    else:
        store.set_timeout(timeout)
    from mcore_rl.parallel.update_group import UpdateGroup

    unique_id = mint_id()
    store.set(_vllm_nccl_key(group_name, "unique_id"), unique_id)
    store.set(_vllm_nccl_key(group_name, "packed_buffer_size_bytes"), str(int(buffer_bytes)))
    sender = connect(unique_id, world_size, device, lambda: None, timeout_s=timeout_s)
    return UpdateGroup(group_name, 0, world_size, "vllm_nccl", sender, store)


def read_vllm_nccl_rendezvous(
    master_address: str, master_port: int, group_name: str, timeout_s: float = 60.0
) -> tuple[bytes, int]:
    """(unique id, packed_buffer_size_bytes) that the leader of `group_name` published (`new_vllm_nccl_group`);
    waits for them up to `timeout_s` (the leader publishes them as soon as its join starts)."""
    store = dist.TCPStore(master_address, master_port, None, False, timeout=datetime.timedelta(seconds=timeout_s))
    unique_id = bytes(store.get(_vllm_nccl_key(group_name, "unique_id")))
    return unique_id, int(store.get(_vllm_nccl_key(group_name, "packed_buffer_size_bytes")).decode())
