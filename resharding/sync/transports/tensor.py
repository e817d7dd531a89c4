"""The `tensor` transport: the bucket goes to engines on this node as one `/update_weights_from_tensor` payload.

The payload is SGLang's flattened bucket: `{"flattened_tensor": uint8 buffer, "metadata": [records with name, shape,
dtype, start_idx, end_idx, numel]}`, pickled with `ForkingPickler` and base64-encoded, one per engine TP rank. CPU
buffers are allocated in shared memory (torch's `file_system` strategy: the default `file_descriptor` one cannot
cross between unrelated processes), so the engine maps the same pages and nothing is copied on the way; on GPU the
buffer travels as a CUDA IPC handle. Metadata records are `types.SimpleNamespace`, which SGLang's SafeUnpickler
admits and its loader reads by attribute.

Segments are reused: the executor (resharding/sync/execute.py) packs every bucket of every sync into one of two
buffers this transport allocated once. That is safe because (1) an engine answers the POST only after it has copied
the bucket out of the segment (its staging copy), (2) `send` submits to a one-deep BackgroundSender, which waits for
the previous bucket's POSTs to be answered, so when bucket k is packed into the segment of bucket k - 2, every engine
has answered for k - 2 already.
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


def encode_payload(named: NamedTensors, load_format: str | None = "flattened_bucket") -> SharedPayload:
    """Named tensors -> one payload of `load_format` (flattened_bucket, or null: a list of (name, tensor))."""
    if load_format == "flattened_bucket":
        flat, metadata = flatten(named)
        return encode({"flattened_tensor": flat, "metadata": metadata})
    return encode([(name, t.detach()) for name, t in named])


class TensorTransport:
    """See the module docstring. `ranks_per_engine` copies of the payload go to each engine (SGLang's TP rank r
    reads element r; every rank gets the whole bucket, as SGLang's loaders shard it themselves)."""

    def __init__(
        self,
        engine_urls: list[str],
        *,
        api_key: str | None,
        weight_version: str,
        ranks_per_engine: int = 1,
        timeout_s: float = 300.0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.engine_urls = list(engine_urls)
        self.api_key = api_key
        self.weight_version = weight_version
        self.ranks_per_engine = ranks_per_engine
        self.timeout_s = timeout_s
        self.device = torch.device(device)
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
        payload = encode({"flattened_tensor": buffer, "metadata": metadata})
        body = {
            "serialized_named_tensors": [payload] * self.ranks_per_engine,
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
