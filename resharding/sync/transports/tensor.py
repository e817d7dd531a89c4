"""The `tensor` transport: the bucket goes to engines on this node as one `/update_weights_from_tensor` payload per
engine TP rank.

The payload is SGLang's flattened bucket: `{"flattened_tensor": uint8 buffer, "metadata": [records with name, shape,
dtype, start_idx, end_idx, numel]}`, pickled with `ForkingPickler` and base64-encoded; SGLang's TP rank r opens
element r of `serialized_named_tensors` with its `MultiprocessingSerializer` (after `monkey_patch_torch_reductions`).
Metadata records are `types.SimpleNamespace`, which SGLang's SafeUnpickler admits and its loader reads by attribute.

CPU: the buffer is allocated in shared memory (torch's `file_system` strategy: the default `file_descriptor` one
cannot cross between unrelated processes), so the engine maps the same pages and nothing is copied on the way; every
rank may open the same payload (each attach counts itself in the segment's reference count).

GPU (CUDA IPC), as SGLang 0.5.23 expects it:
- one payload per engine rank, each its own copy of the bucket on the GPU that rank can see (`rank_devices`, the GPU
  colocated with it): a CUDA IPC handle is counted once per share, and SGLang's `deserialize_own_rank` opens only
  its own element, so ranks sharing one payload would release it once each;
- the device index is written as the GPU's UUID, as SGLang's `monkey_patch_torch_reductions` does on its senders
  (`_reduce_tensor_modified`): processes number GPUs by their own CUDA_VISIBLE_DEVICES, a UUID names one GPU
  everywhere, and SGLang's patched `rebuild_cuda_tensor` maps it back to its own index;
- the engine never sees the executor's reused buffer. SGLang answers `/update_weights_from_tensor` after a CPU
  barrier of its ranks, while its copies out of the IPC memory may still be queued on its stream, so repacking that
  buffer (the executor reuses two) could change bytes it has not read yet. Each send therefore shares a fresh copy
  and drops it after the POST: torch keeps a shared block out of reuse until every receiver has released it, and a
  receiver synchronises its stream before releasing (torch's CUDA IPC reference counting). Cost: one device copy per
  engine rank and bucket, and up to that many bucket copies in flight per GPU.

Segments are reused on CPU: the executor (resharding/sync/execute.py) packs every bucket of every sync into one of
two buffers this transport allocated once. That is safe because (1) an engine answers the POST only after it has
copied the bucket out of the segment (a copy from host memory has read its source when it returns), (2) `send`
submits to a one-deep BackgroundSender, which waits for the previous bucket's POSTs to be answered, so when bucket k
is packed into the segment of bucket k - 2, every engine has answered for k - 2 already.
"""

from __future__ import annotations

import base64
import io
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from mcore_rl.resharding.sync.plan import Bucket, Stream
from mcore_rl.resharding.sync.transports.base import BackgroundSender, http_post

NamedTensors = list[tuple[str, torch.Tensor]]


def flatten(named: NamedTensors) -> tuple[torch.Tensor, list[types.SimpleNamespace]]:
    """Named tensors -> one uint8 buffer + metadata records with SGLang's FlattenedTensorMetadata fields."""
    if not named:
        raise ValueError("cannot flatten an empty bucket")
    pieces, metadata, offset = [], [], 0
    for name, tensor in named:
        pad = -offset % tensor.element_size()  # every tensor starts at a multiple of its item size
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8))
            offset += pad
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(_record(name, tensor.shape, tensor.dtype, offset, flat.numel()))
        pieces.append(flat)
        offset += flat.numel()
    return torch.cat(pieces), metadata


def _record(name: str, shape: Any, dtype: torch.dtype, start: int, nbytes: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name=name, shape=torch.Size(shape), dtype=dtype, start_idx=start, end_idx=start + nbytes, numel=nbytes
    )


class SharedPayload(str):
    """Base64 text of a pickle whose tensors live in shared memory, holding those tensors: the receiver maps the
    memory by name, which exists only as long as a tensor refers to it, so keep the payload until the call returns."""

    keep: Any


def encode(obj: Any) -> SharedPayload:
    """ForkingPickler dump (tensors shared, not copied) -> base64 text that keeps `obj` alive."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    tmp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    payload = SharedPayload(base64.b64encode(buf.getvalue()).decode("ascii"))
    payload.keep = obj
    return payload


def encode_cuda(obj: Any) -> SharedPayload:
    """ForkingPickler dump with CUDA tensors shared by IPC handle and their device written as the GPU's UUID (what
    SGLang's `monkey_patch_torch_reductions` makes its senders write) -> base64 text that keeps `obj` alive."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor_by_uuid  # this dump only; torch's reducer stays global
    pickler.dump(obj)
    payload = SharedPayload(base64.b64encode(buf.getvalue()).decode("ascii"))
    payload.keep = obj
    return payload


#: the position of `storage_device` in the arguments of torch's rebuild_cuda_tensor (SGLang 0.5.23 patches the same)
_DEVICE_ARG = 6


def _reduce_tensor_by_uuid(tensor: torch.Tensor) -> tuple[Any, tuple]:
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda and isinstance(args[_DEVICE_ARG], int):  # a process SGLang already patched wrote the UUID
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])
    return rebuild, args


def encode_payload(named: NamedTensors, load_format: str | None = "flattened_bucket") -> SharedPayload:
    """Named tensors -> one payload of `load_format` (flattened_bucket, or null: a list of (name, tensor))."""
    if load_format == "flattened_bucket":
        flat, metadata = flatten(named)
        return encode({"flattened_tensor": flat, "metadata": metadata})
    return encode([(name, t.detach()) for name, t in named])


class TensorTransport:
    """See the module docstring. Each engine gets `ranks_per_engine` payloads (SGLang's TP rank r reads element r;
    every rank gets the whole bucket, as SGLang's loaders shard it themselves). On GPU `rank_devices[r]` is where
    rank r's copy is made (default: this transport's device for every rank)."""

    def __init__(
        self,
        engine_urls: list[str],
        *,
        api_key: str | None,
        weight_version: str,
        ranks_per_engine: int = 1,
        timeout_s: float = 300.0,
        device: torch.device | str = "cpu",
        rank_devices: list[torch.device | str] | None = None,
    ) -> None:
        self.engine_urls = list(engine_urls)
        self.api_key = api_key
        self.weight_version = weight_version
        self.ranks_per_engine = ranks_per_engine
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.rank_devices = (
            [torch.device(d) for d in rank_devices] if rank_devices else [self.device] * ranks_per_engine
        )
        if len(self.rank_devices) != ranks_per_engine:
            raise ValueError(f"rank_devices names {len(self.rank_devices)} devices for {ranks_per_engine} engine ranks")
        #: where allocate puts buffers: the executor reuses them while this stays the same, so one pair of shared
        #: segments serves every bucket of every sync (a fresh segment per bucket faulted in 64 MB of pages each time)
        self.memory = "cpu-shared" if self.device.type == "cpu" else str(self.device)
        self._http = ThreadPoolExecutor(max_workers=max(1, len(self.engine_urls)), thread_name_prefix="sync-http")
        self._sender = BackgroundSender(self._send)

    def allocate(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buffer.share_memory_() if self.device.type == "cpu" else buffer

    def send(self, stream: Stream, bucket: Bucket, buffer: torch.Tensor) -> None:
        self._sender.submit((stream, bucket, buffer))

    def _send(self, item: tuple[Stream, Bucket, torch.Tensor]) -> None:
        stream, bucket, buffer = item
        metadata = [_record(e.name, e.shape, getattr(torch, e.dtype), e.offset, e.nbytes) for e in bucket.entries]
        if buffer.device.type == "cpu":
            payloads = [encode({"flattened_tensor": buffer, "metadata": metadata})] * self.ranks_per_engine
        else:  # one fresh copy per engine rank, never the executor's reused buffer (see the module docstring)
            payloads = [
                encode_cuda({"flattened_tensor": buffer.to(device, copy=True), "metadata": metadata})
                for device in self.rank_devices
            ]
        body = {
            "serialized_named_tensors": payloads,
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "weight_version": self.weight_version,
        }
        calls = [
            self._http.submit(http_post, url + "/update_weights_from_tensor", body, self.api_key, self.timeout_s)
            for url in self.engine_urls
        ]
        for call in calls:
            call.result()

    def wait(self) -> None:
        self._sender.wait()

    def close(self) -> None:
        self._sender.close()
        self._http.shutdown(wait=False)
