"""The bytes of a tensor bucket on its way to an engine's `/update_weights_from_tensor` (SGLang 0.5.23's format):
the sender side (`flatten`, `encode`, `encode_cuda`, `encode_payload`: transports/tensor.py, tools) and the receiver
side (`unflatten`, `decode_payload`: our embedded server, rollout/weight_receiver.py) in one module, so the two cannot
drift apart.

One payload per engine TP rank (SGLang's rank r reads element r of `serialized_named_tensors`):

```
payload  = base64(ForkingPickler dump of obj)            ASCII text, standard alphabet, padded
load_format="flattened_bucket" (what the transports send):
  obj    = {"flattened_tensor": uint8 tensor of the bucket's bytes,
            "metadata": [record, ...]}                   one record per tensor, in bucket order
  record = types.SimpleNamespace(name=str, shape=torch.Size, dtype=torch.dtype, start_idx=int, end_idx=int, numel=int)
           the tensor is bytes [start_idx, end_idx) of flattened_tensor, C-contiguous, in the sender's byte order;
           numel = end_idx - start_idx is its byte count; start_idx is a multiple of the dtype's item size (zero
           bytes pad the gap), which SGLang's receivers need to view the bytes as the dtype
load_format=null (or "auto"):
  obj    = [(name, tensor), ...]                         each tensor pickled whole; a value may be SGLang's
                                                          LocalSerializedTensor (verl sends them), whose values[0]
                                                          is this rank's tensor, serialized again
```
Records are `types.SimpleNamespace`, which SGLang's SafeUnpickler admits and its loader reads by attribute; our
receiver also reads SGLang's own FlattenedTensorMetadata (rollout/safe_pickle.py stands it in).

The tensors in the pickle are not copied: a CPU tensor travels as a shared-memory segment name (torch's
`file_system` sharing strategy; the default `file_descriptor` one cannot cross between unrelated processes), a CUDA
tensor as an IPC handle whose device is written as the GPU's UUID (as SGLang's `monkey_patch_torch_reductions` makes
its senders write it: processes number GPUs by their own CUDA_VISIBLE_DEVICES, a UUID names one GPU everywhere). So
a payload is valid only on the sender's node and only while the sender keeps its tensors (`SharedPayload.keep`).

The receiver unpickles with the allow-list it passes as `loads` (rollout/safe_pickle.py: exact (module, name) pairs,
a subset of SGLang's own SafeUnpickler's); this module never unpickles by itself.
"""

from __future__ import annotations

import base64
import io
import types
from collections.abc import Callable
from typing import Any

import torch

NamedTensors = list[tuple[str, torch.Tensor]]

#: the load_format values a payload may declare: the flattened bucket, or a list of (name, tensor) (null / "auto")
FLATTENED_BUCKET = "flattened_bucket"
LOAD_FORMATS = (FLATTENED_BUCKET, None, "auto")


class WireFormatError(ValueError):
    """A payload that does not follow the format (or that `loads` refused); the message says what is wrong."""


# ---------------------------------------------------------------- sender side


def record(name: str, shape: Any, dtype: torch.dtype, start: int, nbytes: int) -> types.SimpleNamespace:
    """One metadata record (SGLang's FlattenedTensorMetadata fields): `nbytes` bytes of `dtype` at byte `start`."""
    return types.SimpleNamespace(
        name=name, shape=torch.Size(shape), dtype=dtype, start_idx=start, end_idx=start + nbytes, numel=nbytes
    )


def flatten(named: NamedTensors) -> tuple[torch.Tensor, list[types.SimpleNamespace]]:
    """Named tensors -> one uint8 buffer + metadata records, each tensor at a multiple of its item size."""
    if not named:
        raise ValueError("cannot flatten an empty bucket")
    pieces, metadata, offset = [], [], 0
    for name, tensor in named:
        pad = -offset % tensor.element_size()  # every tensor starts at a multiple of its item size
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8))
            offset += pad
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(record(name, tensor.shape, tensor.dtype, offset, flat.numel()))
        pieces.append(flat)
        offset += flat.numel()
    return torch.cat(pieces), metadata


class SharedPayload(str):
    """Base64 text of a pickle whose tensors live in shared memory, holding those tensors: the receiver maps the
    memory by name, which exists only as long as a tensor refers to it, so keep the payload until the call returns."""

    keep: Any


def encode(obj: Any) -> SharedPayload:
    """ForkingPickler dump (CPU tensors shared by segment name, not copied) -> base64 text that keeps `obj` alive.
    Each pickle of a segment hands over one reference: give every opener a pickle of its own (transports/tensor.py)."""
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


def encode_payload(named: NamedTensors, load_format: str | None = FLATTENED_BUCKET) -> SharedPayload:
    """Named CPU tensors -> one payload of `load_format` (flattened_bucket, or null: a list of (name, tensor))."""
    if load_format == FLATTENED_BUCKET:
        flat, metadata = flatten(named)
        return encode({"flattened_tensor": flat, "metadata": metadata})
    return encode([(name, t.detach()) for name, t in named])


# ---------------------------------------------------------------- receiver side


def unflatten(obj: Any) -> NamedTensors:
    """A flattened bucket (`{"flattened_tensor": ..., "metadata": [...]}`) -> named views of its buffer, each record
    checked against its shape, the buffer and its dtype's alignment."""
    if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
        raise WireFormatError('a flattened_bucket payload is {"flattened_tensor": uint8 tensor, "metadata": [...]}')
    flat = obj["flattened_tensor"]
    out = []
    for meta in obj["metadata"]:
        size = int(torch.Size(meta.shape).numel()) * meta.dtype.itemsize
        if meta.end_idx - meta.start_idx != size or meta.end_idx > flat.numel():
            raise WireFormatError(f"bucket metadata of {meta.name!r} does not fit its shape or the buffer")
        if meta.start_idx % meta.dtype.itemsize:
            raise WireFormatError(
                f"tensor {meta.name!r} starts at byte {meta.start_idx}, not a multiple of its {meta.dtype} item "
                f"size {meta.dtype.itemsize}: pad the flattened bucket (SGLang's receivers require alignment)"
            )
        out.append((meta.name, flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)))
    return out


def decode_payload(payload: str | bytes, load_format: str | None, loads: Callable[[bytes], Any]) -> NamedTensors:
    """One TP rank's payload -> named tensors (views of the shared buffers: copy before keeping). `loads` is the
    receiver's unpickler (its allow-list); what it raises as WireFormatError passes through unchanged."""
    try:
        raw = base64.b64decode(payload, validate=True) if isinstance(payload, str) else payload
        obj = loads(raw)
    except WireFormatError:
        raise
    except Exception as err:
        raise WireFormatError(f"serialized_named_tensors could not be decoded: {err}") from err
    if load_format == FLATTENED_BUCKET:
        return unflatten(obj)
    if load_format not in LOAD_FORMATS:
        raise WireFormatError(f"load_format={load_format!r} is not supported; expected null or 'flattened_bucket'")
    if isinstance(obj, dict):
        obj = list(obj.items())
    if not isinstance(obj, list) or not all(isinstance(i, tuple) and len(i) == 2 for i in obj):
        raise WireFormatError("a tensor payload is a list of (name, tensor) pairs")
    out = []
    for name, value in obj:
        if isinstance(value, types.SimpleNamespace) and isinstance(getattr(value, "values", None), list):
            # SGLang's LocalSerializedTensor (verl): one serialization per engine TP rank; this rank reads element 0
            try:
                value = loads(value.values[0])
            except WireFormatError:
                raise
            except Exception as err:
                raise WireFormatError(f"payload entry {name!r} could not be decoded: {err}") from err
        if not isinstance(value, torch.Tensor):
            raise WireFormatError(f"payload entry {name!r} is a {type(value).__name__}, expected a tensor")
        out.append((name, value))
    return out
