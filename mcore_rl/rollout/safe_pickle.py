"""The unpickler for weight payloads that arrive over HTTP (`/update_weights_from_tensor`): data, never code.

SGLang's tensor payloads are pickles (a `ForkingPickler` dump whose tensors live in shared memory or CUDA IPC
handles), so the receiver must unpickle bytes a client sent. A pickle names callables by (module, name) and calls
them; an unpickler that admits a callable admits whatever that callable can do with arguments the sender chose.
So this one admits an exact set of (module, name) pairs, as SGLang 0.5.23's own `SafeUnpickler`
(`sglang/srt/utils/common.py`) does, and never a module prefix or a name pattern: `torch.storage._load_from_bytes`,
for one, calls `torch.load(weights_only=False)` on the sender's bytes, and a prefix rule that admitted `_load_*` ran
a shell command on the server (an adversarial probe). That name is answered, as in SGLang, with a loader that runs
`torch.load(weights_only=True)` (plain `pickle.dumps` of a tensor goes through it).

The set is the part of SGLang's that a CPU engine needs, and a test checks it is a subset of the set in the pinned
SGLang wheel (`tests/test_weight_receiver_security.py`). Left out on purpose:
- CUDA rebuilders (`rebuild_cuda_tensor`, SGLang's UUID-patched one): this engine has no GPU.
- `rebuild_storage_fd` with `multiprocessing.resource_sharer.DupFd`: a DupFd connects to an address the payload
  names to fetch a file descriptor. Our sender uses torch's `file_system` sharing strategy (a shared-memory name),
  which needs no connection.
- SGLang's request structs, `functools.partial`, `itertools`, `_codecs.encode`: no weight payload holds them.
"""

from __future__ import annotations

import io
import pickle
import types
from typing import Any

import torch

# torch dtypes by the names a pickle uses for them (`torch.float32` pickles as ("torch", "float32")).
_DTYPE_NAMES = (
    "float32", "float", "float16", "half", "bfloat16", "float64", "double", "int8", "int16", "short", "int32", "int",
    "int64", "long", "uint8", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu", "complex64", "complex128",
)  # fmt: skip
_STORAGE_NAMES = (
    "BFloat16Storage", "BoolStorage", "ByteStorage", "CharStorage", "DoubleStorage", "FloatStorage", "HalfStorage",
    "IntStorage", "LongStorage", "ShortStorage",
)  # fmt: skip

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("builtins", n) for n in ("bool", "bytearray", "bytes", "dict", "float", "int", "list", "slice", "str", "tuple")}
    | {("torch", n) for n in _DTYPE_NAMES + _STORAGE_NAMES}
    | {
        ("collections", "OrderedDict"),  # the backward-hooks slot of torch._utils._rebuild_tensor_v2
        ("copyreg", "__newobj__"),
        ("types", "SimpleNamespace"),  # flattened-bucket metadata records
        ("torch", "Size"),
        ("torch", "dtype"),
        ("torch", "device"),
        ("torch", "Tensor"),
        ("torch", "UntypedStorage"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch.nn.parameter", "Parameter"),
        ("torch._utils", "_rebuild_tensor"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        # SGLang's data classes; answered with stand-ins below (SGLang is not installed here)
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
        ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"),
        ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"),
    }
)


class UnsafePayload(pickle.UnpicklingError):
    """The payload names a global outside `ALLOWED_GLOBALS`; the message names it."""


class LocalSerializedTensor(types.SimpleNamespace):
    """Stands in for SGLang's `LocalSerializedTensor` (what verl sends): `values[tp_rank]` is one serialized tensor
    per engine TP rank."""


class FlattenedTensorMetadata(types.SimpleNamespace):
    """Stands in for `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata` when a client pickled SGLang's
    class (name, shape, dtype, start_idx, end_idx, numel)."""


def _load_storage_weights_only(data: bytes) -> Any:
    """`torch.storage._load_from_bytes` without its `weights_only=False`: a storage saved with torch.save, or a
    refusal (SGLang 0.5.23 answers that name the same way)."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, torch.storage.TypedStorage | torch.UntypedStorage):
        raise UnsafePayload(f"torch.storage._load_from_bytes gave a {type(storage).__name__}, expected a storage")
    return storage


_STAND_INS: dict[tuple[str, str], Any] = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"): (
        LocalSerializedTensor
    ),
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
    ("torch.storage", "_load_from_bytes"): _load_storage_weights_only,
}


class SafeUnpickler(pickle.Unpickler):
    """Unpickles only the exact (module, name) pairs of `ALLOWED_GLOBALS` (plus the weights-only storage loader)."""

    def find_class(self, module: str, name: str) -> Any:
        stand_in = _STAND_INS.get((module, name))
        if stand_in is not None:
            return stand_in
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise UnsafePayload(f"payload refers to {module}.{name}, which a weight payload may not contain")


def safe_loads(raw: bytes) -> Any:
    """`pickle.loads` through `SafeUnpickler`."""
    return SafeUnpickler(io.BytesIO(raw)).load()
