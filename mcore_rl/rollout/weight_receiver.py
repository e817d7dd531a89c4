"""The receiving end of weight sync inside the embedded server: payload decoding, staging and the atomic commit.

```
/begin_weight_update                      open a session (a session left open by a dead sender is discarded)
/update_weights_from_tensor | _distributed | _disk
    payload -> named tensors -> every name/shape checked against the model -> staged (copies, not yet visible)
/end_weight_update                        commit between two decode steps: staged tensors copied into the
                                          parameters, weight_version set; a session with a refused bucket commits
                                          nothing (old weights and version stay)
```
Staging costs up to one model's bytes on the engine and buys atomicity without stopping generation while buckets
stream in: requests keep decoding on the old weights until the commit, and no token mixes versions. The staging
tensors and the broadcast receive buffers are reused by the next session (fresh pages cost more than the copies into
them), so they stay resident between syncs until `release()` (the server's /release_memory_occupation of weights).

Tensor payloads are SGLang's: base64 of a `ForkingPickler` dump (CPU tensors through shared memory with torch's
`file_system` strategy; CUDA IPC handles on GPU), either a list of `(name, tensor)` or, with
`load_format="flattened_bucket"`, `{"flattened_tensor": uint8, "metadata": [...]}`. They are unpickled with an
allow-list (tensor and storage rebuilders, plain containers), as SGLang's own `SafeUnpickler` does, so a request
cannot name arbitrary callables.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import threading
import types
from collections.abc import Iterable
from typing import Any

import torch

from mcore_rl.resharding.sync.transports.tensor import encode_payload, flatten  # noqa: F401 (the client side)
from mcore_rl.rollout.engine import HFRolloutEngine

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightUpdateError(ValueError):
    """A refused weight update; the server answers 400 with `{"success": false, "message": ...}`."""


_ALLOWED_MODULE_PREFIXES = ("torch.multiprocessing.reductions", "torch._utils", "torch.storage", "torch._tensor")
_ALLOWED_GLOBALS = {
    ("builtins", n) for n in ("list", "tuple", "dict", "str", "int", "float", "bool", "bytes", "bytearray", "slice")
} | {
    ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"),
    ("copyreg", "_reconstructor"),
    ("types", "SimpleNamespace"),
    ("torch", "Size"),
    ("torch", "dtype"),
    ("torch", "device"),
    ("torch", "Tensor"),
    ("torch", "UntypedStorage"),
    ("torch.nn.parameter", "Parameter"),
    ("multiprocessing.resource_sharer", "DupFd"),
}


class LocalSerializedTensor(types.SimpleNamespace):
    """Stands in for SGLang's `LocalSerializedTensor` (what verl sends): `values[tp_rank]` is one serialized tensor
    per engine TP rank; this one-rank engine takes values[0]."""


class FlattenedTensorMetadata(types.SimpleNamespace):
    """Stands in for `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata` when a client pickled SGLang's
    class (name, shape, dtype, start_idx, end_idx, numel)."""


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"):
            return FlattenedTensorMetadata
        if name == "LocalSerializedTensor" and module in (
            "sglang.srt.model_executor.model_runner_components.weight_updater",
            "sglang.srt.model_executor.model_runner",
        ):
            return LocalSerializedTensor
        if (module, name) in _ALLOWED_GLOBALS or (
            module.startswith(_ALLOWED_MODULE_PREFIXES) and name.startswith(("rebuild_", "_rebuild_", "_load_"))
        ):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in ("torch", "torch.storage") and name.endswith("Storage"):  # storage classes (plain data)
            return super().find_class(module, name)
        raise WeightUpdateError(f"payload refers to {module}.{name}, which a weight payload may not contain")


def decode_payload(payload: str | bytes, load_format: str | None) -> NamedTensors:
    """One TP rank's serialized tensors -> named tensors (views of the shared buffers; copy before keeping)."""
    try:
        raw = base64.b64decode(payload, validate=True) if isinstance(payload, str) else payload
        obj = _SafeUnpickler(io.BytesIO(raw)).load()
    except WeightUpdateError:
        raise
    except Exception as err:
        raise WeightUpdateError(f"serialized_named_tensors could not be decoded: {err}") from err
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
            raise WeightUpdateError(
                'a flattened_bucket payload is {"flattened_tensor": uint8 tensor, "metadata": [...]}'
            )
        flat = obj["flattened_tensor"]
        out = []
        for meta in obj["metadata"]:
            size = int(torch.Size(meta.shape).numel()) * meta.dtype.itemsize
            if meta.end_idx - meta.start_idx != size or meta.end_idx > flat.numel():
                raise WeightUpdateError(f"bucket metadata of {meta.name!r} does not fit its shape or the buffer")
            if meta.start_idx % meta.dtype.itemsize:
                raise WeightUpdateError(
                    f"tensor {meta.name!r} starts at byte {meta.start_idx}, not a multiple of its {meta.dtype} item "
                    f"size {meta.dtype.itemsize}: pad the flattened bucket (SGLang's receivers require alignment)"
                )
            out.append((meta.name, flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)))
        return out
    if load_format not in (None, "auto"):
        raise WeightUpdateError(f"load_format={load_format!r} is not supported; expected null or 'flattened_bucket'")
    if isinstance(obj, dict):
        obj = list(obj.items())
    if not isinstance(obj, list) or not all(isinstance(i, tuple) and len(i) == 2 for i in obj):
        raise WeightUpdateError("a tensor payload is a list of (name, tensor) pairs")
    out = []
    for name, value in obj:
        if isinstance(value, LocalSerializedTensor):  # verl: one serialized tensor per engine TP rank
            value = _SafeUnpickler(io.BytesIO(value.values[0])).load()
        if not isinstance(value, torch.Tensor):
            raise WeightUpdateError(f"payload entry {name!r} is a {type(value).__name__}, expected a tensor")
        out.append((name, value))
    return out


class _Received(list):
    """Named views of one received flattened bucket, with the pooled buffer they live in."""

    buffer: torch.Tensor


class WeightReceiver:
    """Staged weight updates for one `HFRolloutEngine` (see the module docstring). Thread-safe."""

    def __init__(self, engine: HFRolloutEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._staged: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._failed: str | None = None
        self._version: str | None = None
        self.groups: dict[str, Any] = {}
        self._spare: dict[str, torch.Tensor] = {}  # staging tensors of earlier sessions, by name, to reuse
        self._committing: dict[str, torch.Tensor] = {}  # handed out by take_commit, back with recycle
        #: flattened-bucket receive buffers not in use: a broadcast takes one (or allocates), stage() gives it back,
        #: so there are as many as buckets ever arrived at once (one per stream sending in parallel), not per group
        self._receive_buffers: list[torch.Tensor] = []

    @property
    def resident_bytes(self) -> int:
        """Bytes of the staging and receive buffers kept for the next session (see `release`)."""
        spare = sum(t.numel() * t.element_size() for t in self._spare.values())
        return spare + sum(t.numel() for t in self._receive_buffers)

    def release(self) -> None:
        """Drop the buffers kept for reuse (an open session keeps what it staged)."""
        with self._lock:
            self._spare.clear()
            self._committing.clear()
            self._receive_buffers = []

    def recycle(self) -> None:
        """Give the last commit's staging tensors back for the next session (call once the commit copied them)."""
        with self._lock:
            self._spare.update(self._committing)
            self._committing = {}

    def _return_staged(self) -> None:  # with self._lock held
        for name, (_, value) in (self._staged or {}).items():
            self._spare[name] = value

    @property
    def session_open(self) -> bool:
        return self._staged is not None

    @property
    def staged_count(self) -> int:
        """Tensors staged in the open session (0 when none is open)."""
        return len(self._staged or {})

    def begin(self) -> str:
        with self._lock:
            dropped = "" if self._staged is None else f" (discarded an unfinished session of {len(self._staged)})"
            self._return_staged()
            self._staged, self._failed, self._version = {}, None, None
        return "weight update session opened" + dropped

    def stage(self, named: Iterable[tuple[str, torch.Tensor]], weight_version: str | None) -> int:
        """Check every tensor, then stage copies of them; WeightUpdateError (and the session is spoiled) if any is
        refused, so a later end_weight_update commits nothing. The copies run outside the lock, so buckets of
        different streams stage in parallel (copy_ releases the GIL)."""
        with self._lock:
            if self._staged is None:
                raise WeightUpdateError("no weight update session: call /begin_weight_update first")
            if self._failed is not None:
                raise WeightUpdateError(f"this session already had a refused bucket ({self._failed}); begin again")
            session = self._staged
            checked = []
            named_in = named
            try:
                named = _dequantize_fp8(list(named))
                for name, tensor in named:
                    view = self.engine.target_view(name, tensor)
                    if view is not None:
                        checked.append((name, view, tensor))
            except ValueError as err:
                self._failed = str(err)
                raise WeightUpdateError(f"bucket refused, old weights kept: {err}") from err
            values = []
            for name, view, tensor in checked:  # reuse the tensor this name was staged in last time
                value = self._spare.pop(name, None)
                if value is None or value.shape != tensor.shape or value.dtype != view.dtype:
                    value = torch.empty(tensor.shape, dtype=view.dtype, device=view.device)
                values.append(value)
        for (_, _, tensor), value in zip(checked, values):
            value.copy_(tensor)
        with self._lock:
            if isinstance(named_in, _Received):  # its views are copied: the buffer serves the next bucket
                self._receive_buffers.append(named_in.buffer)
            if self._staged is not session:  # the session was discarded or committed meanwhile: stage nothing
                self._spare.update((name, value) for (name, _, _), value in zip(checked, values))
                raise WeightUpdateError("the weight update session ended while this bucket was being staged")
            for (name, view, _), value in zip(checked, values):
                if name in self._staged:  # sent twice in one session: the later copy wins
                    self._spare[name] = self._staged[name][1]
                self._staged[name] = (view, value)
            if weight_version is not None:
                self._version = str(weight_version)
            return len(checked)

    def fail(self, message: str) -> None:
        """Spoil the open session (a bucket that could not even be read): end_weight_update will commit nothing."""
        with self._lock:
            if self._staged is not None:
                self._failed = message

    def discard(self) -> None:
        """Drop the open session, if any, without committing."""
        with self._lock:
            self._return_staged()
            self._staged, self._failed, self._version = None, None, None

    def take_commit(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str | None]:
        """Close the session: the (parameter view, new value) pairs and version to commit; WeightUpdateError if the
        session had a refused bucket or none was open. Call `recycle()` once the values are copied."""
        with self._lock:
            staged, failed, version = self._staged, self._failed, self._version
            if failed is not None:
                self._return_staged()
            elif staged is not None:
                self._committing = {name: value for name, (_, value) in staged.items()}
            self._staged, self._failed, self._version = None, None, None
        if staged is None:
            raise WeightUpdateError("no weight update session: call /begin_weight_update first")
        if failed is not None:
            raise WeightUpdateError(f"a bucket of this session was refused ({failed}); nothing committed")
        return list(staged.values()), version

    def receive_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, load_format: str | None
    ) -> NamedTensors:
        """Receive one broadcast (per tensor, or one flattened bucket) from rank 0 of `group_name`."""
        from mcore_rl.parallel.update_group import broadcast

        group = self.groups.get(group_name)
        if group is None:
            raise WeightUpdateError(f"no update group {group_name!r}: call /init_weights_update_group first")
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise WeightUpdateError("names, dtypes and shapes must be non-empty lists of the same length")
        try:
            types_ = [getattr(torch, d.removeprefix("torch.")) for d in dtypes]
            assert all(isinstance(t, torch.dtype) for t in types_)
        except (AttributeError, AssertionError) as err:
            raise WeightUpdateError(f"dtypes {dtypes!r} are not all torch dtype names") from err
        device = self.engine.device
        if load_format == "flattened_bucket":
            sizes = [int(torch.Size(s).numel()) * t.itemsize for s, t in zip(shapes, types_)]
            # A buffer from the pool: stage() copies the views returned here before the request answers, then
            # gives the buffer back (a refused bucket's buffer is simply dropped).
            nbytes = sum(sizes)
            with self._lock:
                pool = self._receive_buffers
                fits = [k for k, b in enumerate(pool) if b.numel() >= nbytes and b.device == torch.device(device)]
                buffer = pool.pop(min(fits, key=lambda k: pool[k].numel())) if fits else None
            if buffer is None:
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            flat = buffer[:nbytes]
            broadcast(group, flat)
            out, offset = _Received(), 0
            out.buffer = buffer
            for name, shape, dtype, size in zip(names, shapes, types_, sizes):
                out.append((name, flat[offset : offset + size].view(dtype).reshape(shape)))
                offset += size
            return out
        tensors = [(name, torch.empty(shape, dtype=t, device=device)) for name, shape, t in zip(names, shapes, types_)]
        for _, tensor in tensors:
            broadcast(group, tensor)
        return tensors


def _dequantize_fp8(named: NamedTensors) -> NamedTensors:
    """FP8 tensors (e4m3 with a `<name>_scale_inv` in the same payload, 128x128 blocks: an FP8 sync or an FP8
    checkpoint) -> float32 values for this engine's parameters; ValueError naming a scale that is missing."""
    if not any(t.dtype == torch.float8_e4m3fn for _, t in named):
        return named
    from mcore_rl.kernels.fp8_blockwise import dequantize_blockwise

    scales = {name.removesuffix("_scale_inv"): t for name, t in named if name.endswith("_scale_inv")}
    out = []
    for name, tensor in named:
        if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in scales:
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            if name not in scales:
                raise ValueError(f"FP8 tensor {name!r} came without {name}_scale_inv")
            tensor = dequantize_blockwise(tensor, scales[name], (128, 128), torch.float32)
        out.append((name, tensor))
    return out


def read_safetensors_dir(path: str) -> NamedTensors:
    """Every tensor of the `*.safetensors` files in `path` (for /update_weights_from_disk)."""
    from safetensors import safe_open

    if not os.path.isdir(path):
        raise WeightUpdateError(f"model_path {path!r} is not a directory")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise WeightUpdateError(f"model_path {path!r} holds no .safetensors files")
    out = []
    for file in files:
        with safe_open(os.path.join(path, file), framework="pt") as handle:
            out.extend((name, handle.get_tensor(name)) for name in handle.keys())  # noqa: SIM118
    return out
