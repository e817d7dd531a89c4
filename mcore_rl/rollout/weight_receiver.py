"""The receiving end of weight sync inside the embedded server: payload decoding, staging and the atomic commit.

```
/begin_weight_update                      open a session; refused while one is open (as SGLang 0.5.23 refuses it)
/update_weights_from_tensor | _distributed | _disk
    payload -> named tensors -> every name/shape checked against the model -> copied into the parameter's shadow
    (a tensor shaped like the parameter; not yet visible), or, in a session begun while generation is paused,
    into the live parameter itself
/end_weight_update                        commit between two decode steps: a parameter the session wrote whole
                                          swaps storage with its shadow, a partly written one has those regions
                                          copied in; weight_version set. A session with a refused bucket commits
                                          nothing (old weights and version stay)
/abort_weight_update                      (ours, not SGLang's) drop the open session without committing: how the
                                          controller frees an engine whose sender died mid-push
```
Two ways to receive, chosen when the session begins:
- **staged** (generation running: sync.pause_mode none). The shadows cost up to one model's bytes on the engine and
  buy atomicity without stopping generation while buckets stream in: requests keep decoding on the old weights
  until the commit, and no token mixes versions. The commit moves no bytes for what a sync sends whole (every
  parameter, in a full sync): the old storage becomes the next session's shadow. Shadows and the broadcast receive
  buffers stay resident between syncs until `release()` (the server's /release_memory_occupation of weights), since
  fresh pages cost more than the copies into them.
- **in place** (generation paused: a pause mode other than none, or weights released and resumed in colocated
  placement), as SGLang always loads. No decode step runs until the session ends, so no token mixes versions
  either, and no shadow is allocated: the engine holds one copy of the weights. What it gives up is the rollback:
  a session that is refused or aborted after a bucket was written leaves those parameters half-updated. They are
  recorded (`incomplete`), and the server keeps generation paused (/continue_generation refused) until an update
  that rewrites each of them whole commits. Weights resumed after a release hold no values at all, so all of them
  start incomplete.

Tensor payloads are SGLang's, in the format resharding/sync/wire.py defines for both ends (the sender's
`encode_payload` and this side's `decode_payload` are its functions): base64 of a `ForkingPickler` dump, either a list
of `(name, tensor)` or, with `load_format="flattened_bucket"`, `{"flattened_tensor": uint8, "metadata": [...]}`.
They are unpickled with an exact (module, name) allow-list (`rollout/safe_pickle.py`), a subset of SGLang's own
`SafeUnpickler`'s, so a request cannot name arbitrary callables.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from mcore_rl.parallel.cpu_runtime import return_freed_memory
from mcore_rl.resharding.sync import wire
from mcore_rl.resharding.sync.wire import encode_payload, flatten  # noqa: F401 (the sender side, for clients and tests)
from mcore_rl.rollout.engine import HFRolloutEngine
from mcore_rl.rollout.safe_pickle import UnsafePayload, safe_loads

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightUpdateError(ValueError):
    """A refused weight update; the server answers 400 with `{"success": false, "message": ...}`."""


# SGLang 0.5.23's messages (srt/managers/scheduler_components/weight_updater.py), which clients may match
NO_SECOND_SESSION = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
#: /update_weights_from_disk's one answer for every path that is not a model directory (no oracle: a missing path,
#: a file, a device, a FIFO, a directory without regular safetensors files are answered alike)
NOT_A_MODEL_DIRECTORY = "is not a model directory"
#: the longest /update_weights_from_disk reads before it gives up (checked between tensors)
DISK_READ_TIMEOUT_S = 600.0


def decode_payload(payload: str | bytes, load_format: str | None) -> NamedTensors:
    """One TP rank's serialized tensors -> named tensors (views of the shared buffers; copy before keeping):
    wire.decode_payload through this server's allow-list, its refusals as WeightUpdateError."""
    try:
        return wire.decode_payload(payload, load_format, _safe_loads)
    except wire.WireFormatError as err:
        raise WeightUpdateError(str(err)) from err


def _safe_loads(raw: bytes) -> object:
    """safe_loads, a refused global reported as the wire's error (its message unchanged)."""
    try:
        return safe_loads(raw)
    except UnsafePayload as err:
        raise wire.WireFormatError(str(err)) from err


class _Received(list):
    """Named views of one received flattened bucket, with the pooled buffer they live in."""

    buffer: torch.Tensor


class _Session:
    """One open update session: the regions of each parameter's shadow (or, in place, of the parameter) that its
    buckets wrote."""

    def __init__(self, in_place: bool = False) -> None:
        #: parameter key -> {(offset, shape, stride) of a written view of its shadow: numel}
        self.written: dict[str, dict[tuple[int, tuple[int, ...], tuple[int, ...]], int]] = {}
        self.names: set[str] = set()
        self.failed: str | None = None
        self.version: str | None = None
        self.copying = 0  # buckets whose copies into the shadows are running (outside the lock)
        self.in_place = in_place  #: buckets are copied into the live parameters (generation is paused)
        #: in place: parameter keys whose live values a bucket has begun to write
        self.touched: set[str] = set()


class Commit:
    """A closed session, ready to apply between two decode steps (`apply`), with the shadows it owns until then."""

    def __init__(self, receiver: WeightReceiver, session: _Session, shadows: dict[str, torch.Tensor]) -> None:
        self._receiver, self._session, self._shadows = receiver, session, shadows
        self.count = len(session.names)
        self.version = session.version
        self._releases = receiver._releases

    def apply(self) -> None:
        """Make the session's tensors the engine's: a parameter written whole swaps storage with its shadow (no
        copy; the old storage becomes the next session's shadow), a partly written one has its regions copied."""
        engine = self._receiver.engine
        with torch.no_grad():
            for key, regions in self._session.written.items() if not self._session.in_place else ():
                live, shadow = engine.parameter(key), self._shadows[key]
                if sum(regions.values()) == live.numel():
                    live.data, self._shadows[key] = shadow, live.data
                else:
                    for offset, shape, stride in regions:
                        _region(live, offset, shape, stride).copy_(_region(shadow, offset, shape, stride))
        self._receiver._completed(self._session)
        self._receiver._give_back(self._shadows, self._releases)
        self._shadows = {}  # kept by the receiver, or freed here
        if not self._receiver.keep_buffers:
            return_freed_memory()


def _region(tensor: torch.Tensor, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """The view at element `offset` (from `tensor`'s own start) with `shape` and `stride`."""
    return tensor.as_strided(shape, stride, tensor.storage_offset() + offset)


class WeightReceiver:
    """Staged weight updates for one `HFRolloutEngine` (see the module docstring). Thread-safe."""

    def __init__(self, engine: HFRolloutEngine, keep_buffers: bool = True) -> None:
        """`keep_buffers` (sync.keep_buffers): keep the shadows, receive buffers and mapped payload segments for the
        next session; false frees them once each commit is applied (a full copy of the weights and a bucket or two
        less between syncs, for a fresh allocation in every sync)."""
        self.engine = engine
        self.keep_buffers = keep_buffers
        self._lock = threading.Condition()
        self._session: _Session | None = None
        self.groups: dict[str, Any] = {}
        #: parameter key -> a tensor shaped like it that buckets are staged into; a commit swaps it in
        self._shadows: dict[str, torch.Tensor] = {}
        self._releases = 0  # counts `release` calls: a commit applied after one gives no shadows back
        #: flattened-bucket receive buffers not in use: a broadcast takes one (or allocates), stage() gives it back,
        #: so there are as many as buckets ever arrived at once (one per stream sending in parallel), not per group
        self._receive_buffers: list[torch.Tensor] = []
        #: shared-memory storages that payloads of this and of the last session arrived in, by address. Holding one
        #: keeps torch's sharing cache entry alive, so a sender that reuses its bucket buffers (as the sync executor
        #: does) is not mapped afresh, page by page, on every sync.
        self._mapped: dict[int, torch.UntypedStorage] = {}
        self._mapped_last: dict[int, torch.UntypedStorage] = {}
        #: parameter keys whose live values are not a committed update's: written in place by a session that did
        #: not commit, or resumed after a release without values (see the module docstring)
        self._incomplete: set[str] = set()

    @property
    def incomplete(self) -> list[str]:
        """Parameter keys holding values no committed update gave them (sorted); generation must wait for an update
        that rewrites each whole."""
        with self._lock:
            return sorted(self._incomplete)

    def mark_incomplete(self, keys: Iterable[str]) -> None:
        """Record parameters whose values are gone (the server resumed released weights as zeros)."""
        with self._lock:
            self._incomplete.update(keys)

    def generation_blocked(self) -> str | None:
        """Why generation may not continue on these weights (an in-place session is open, or some parameters are
        incomplete), or None."""
        with self._lock:
            if self._session is not None and self._session.in_place:
                return (
                    "a weight update is writing into the live weights (it began while generation was paused): "
                    "end_weight_update or abort_weight_update first"
                )
            if self._incomplete:
                names = sorted(self._incomplete)
                return (
                    f"{len(names)} parameters (e.g. {names[:3]}) hold values of no committed weight update (one that "
                    "failed after writing in place, or weights resumed after a release): generation continues once "
                    "an update that rewrites them commits"
                )
            return None

    def _completed(self, session: _Session) -> None:
        """A session committed: the parameters it wrote whole are complete again."""
        with self._lock:
            for key, regions in session.written.items():
                if sum(regions.values()) == self.engine.parameter(key).numel():
                    self._incomplete.discard(key)

    @property
    def resident_bytes(self) -> int:
        """Bytes of the shadows and receive buffers kept for the next session (see `release`)."""
        with self._lock:
            shadows = sum(t.numel() * t.element_size() for t in self._shadows.values())
            return shadows + sum(t.numel() for t in self._receive_buffers)

    def release(self) -> None:
        """Drop the buffers kept for reuse and discard an open session."""
        with self._lock:
            self._end_session(committed=False)
            self._shadows.clear()
            self._receive_buffers = []
            self._mapped, self._mapped_last = {}, {}
            self._releases += 1

    def _give_back(self, shadows: dict[str, torch.Tensor], releases: int) -> None:
        with self._lock:
            if not self.keep_buffers:
                # a commit was applied: what the sessions used goes, unless another session already stages into it
                if self._session is None:
                    self._shadows.clear()
                    self._receive_buffers = []
                    self._mapped, self._mapped_last = {}, {}
                return
            if self._releases == releases:  # no release since the commit was taken: keep them for the next session
                for key, shadow in shadows.items():
                    self._shadows.setdefault(key, shadow)

    def _end_session(self, committed: bool) -> None:
        """With the lock held: wait for the session's copies, then close it. An in-place session that does not
        commit leaves what it wrote incomplete."""
        self._wait_for_copies()
        if self._session is not None and self._session.in_place and not committed:
            self._incomplete.update(self._session.touched)
        self._session = None

    def _wait_for_copies(self) -> None:  # with the lock held
        while self._session is not None and self._session.copying:
            self._lock.wait()

    @property
    def session_open(self) -> bool:
        return self._session is not None

    @property
    def staged_count(self) -> int:
        """Tensors staged in the open session (0 when none is open)."""
        session = self._session
        return 0 if session is None else len(session.names)

    def begin(self, in_place: bool = False) -> str:
        """Open a session; WeightUpdateError while one is open (SGLang's message), so a second sender can neither
        drop the first one's session nor have its tensors committed by the first one's end_weight_update.
        `in_place`: write the buckets into the live parameters (the caller guarantees that no decode step runs until
        the session ends: generation is paused, and `generation_blocked` keeps it so)."""
        with self._lock:
            if self._session is not None:
                raise WeightUpdateError(NO_SECOND_SESSION)
            self._session = _Session(in_place)
            self._mapped_last, self._mapped = self._mapped, {}  # what neither this session nor the last used goes
        return "Success"

    def abort(self) -> str:
        """Drop the open session without committing (after its running copies end); WeightUpdateError if none is
        open. The staged tensors are discarded and the shadows kept for the next session."""
        with self._lock:
            if self._session is None:
                raise WeightUpdateError(NO_SESSION)
            session = self._session
            count = len(session.names)
            self._end_session(committed=False)
            if session.in_place and session.touched:
                return (
                    f"weight update session aborted: {len(session.touched)} parameters were already written in place "
                    "(generation stays paused until an update that rewrites them commits), version unchanged"
                )
        return f"weight update session aborted: {count} staged tensors discarded, weights and version unchanged"

    def _shadow(self, key: str) -> torch.Tensor:  # with the lock held
        live = self.engine.parameter(key)
        shadow = self._shadows.get(key)
        if shadow is None or (shadow.shape, shadow.stride(), shadow.dtype) != (live.shape, live.stride(), live.dtype):
            shadow = torch.empty_strided(live.shape, live.stride(), dtype=live.dtype, device=live.device)
            self._shadows[key] = shadow
        return shadow

    def stage(self, named: Iterable[tuple[str, torch.Tensor]], weight_version: str | None) -> int:
        """Check every tensor, then copy each into its parameter's shadow; WeightUpdateError (and the session is
        spoiled) if any is refused, so a later end_weight_update commits nothing. The copies run outside the lock,
        so buckets of different streams stage in parallel (copy_ releases the GIL)."""
        with self._lock:
            session = self._session
            if session is None:
                raise WeightUpdateError(NO_SESSION)
            if session.failed is not None:
                raise WeightUpdateError(f"this session already had a refused bucket ({session.failed}); begin again")
            named_in, named = named, list(named)
            checked = []
            for _, tensor in named:
                if isinstance(tensor, torch.Tensor) and tensor.is_shared() and tensor.device.type == "cpu":
                    storage = tensor.untyped_storage()
                    self._mapped.setdefault(storage.data_ptr(), storage)
            try:
                named = _dequantize_fp8(named)
                for name, tensor in named:
                    view = self.engine.target_view(name, tensor)
                    if view is None:
                        continue
                    key = self.engine.param_key(name)
                    live = self.engine.parameter(key)
                    if live.is_floating_point() and not tensor.is_floating_point():
                        # as SGLang's loaders refuse a wrong shape: copy_ would cast int64 or bool silently
                        raise ValueError(
                            f"tensor {name!r} has dtype {tensor.dtype}, its parameter {live.dtype}: expected a "
                            "floating-point tensor"
                        )
                    offset = view.storage_offset() - live.storage_offset()
                    region = (offset, tuple(view.shape), tuple(view.stride()))
                    into = live if session.in_place else self._shadow(key)
                    checked.append((name, key, region, _region(into, *region), tensor))
            except ValueError as err:
                session.failed = str(err)
                raise WeightUpdateError(f"bucket refused, old weights kept: {err}") from err
            session.copying += 1  # the session cannot end (nor its shadows be committed) until these copies do
            if session.in_place:
                session.touched.update(key for _, key, *_ in checked)
        copied, refused = False, None
        try:
            for *_, target, tensor in checked:
                target.copy_(tensor)
            # checked after the copy, on what would be committed: a cast (bf16 -> fp16) can overflow to inf too
            refused = _non_finite([(name, target) for name, _, _, target, _ in checked])
            copied = refused is None
        finally:
            with self._lock:
                if isinstance(named_in, _Received):  # its views are copied: the buffer serves the next bucket
                    self._receive_buffers.append(named_in.buffer)
                if refused is not None:
                    session.failed = refused
                if copied:
                    for name, key, region, target, _ in checked:
                        session.written.setdefault(key, {})[region] = target.numel()
                        session.names.add(name)
                    if weight_version is not None:
                        session.version = str(weight_version)
                session.copying -= 1
                self._lock.notify_all()
        if refused is not None and session.in_place:
            raise WeightUpdateError(
                f"bucket refused: {refused}; it was written in place, so generation stays paused until an update "
                "that rewrites it commits"
            )
        if refused is not None:
            raise WeightUpdateError(f"bucket refused, old weights kept: {refused}")
        return len(checked)

    def fail(self, message: str) -> None:
        """Spoil the open session (a bucket that could not even be read): end_weight_update will commit nothing."""
        with self._lock:
            if self._session is not None:
                self._session.failed = message

    def discard(self) -> None:
        """Drop the open session, if any, without committing (its shadows stay, for the next session)."""
        with self._lock:
            self._end_session(committed=False)

    def take_commit(self) -> Commit:
        """Close the session (after its running copies end) and hand its shadows to the returned `Commit`;
        WeightUpdateError if the session had a refused bucket, none was open, or the weights were released and
        resumed meanwhile (the parameters no longer match their shadows)."""
        with self._lock:
            self._wait_for_copies()  # a bucket still copying may yet be refused
            session = self._session
            failed = session is not None and session.failed is not None
            self._end_session(committed=not failed)
            if session is None:
                raise WeightUpdateError(NO_SESSION)
            if failed and session.in_place and session.touched:
                raise WeightUpdateError(
                    f"a bucket of this session was refused ({session.failed}); {len(session.touched)} parameters "
                    "were already written in place: generation stays paused until an update that rewrites them "
                    "commits"
                )
            if failed:
                raise WeightUpdateError(f"a bucket of this session was refused ({session.failed}); nothing committed")
            if session.in_place:
                return Commit(self, session, {})
            shadows = {key: self._shadows.pop(key, None) for key in session.written}
            for key, shadow in shadows.items():
                live = self.engine.parameter(key)
                if shadow is None or (shadow.shape, shadow.stride()) != (live.shape, live.stride()):
                    raise WeightUpdateError(
                        f"{key!r} changed shape during the update session (weights released?); nothing committed"
                    )
            return Commit(self, session, shadows)

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


def _non_finite(named: NamedTensors) -> str | None:
    """A message naming the floating-point tensors that hold NaN or +-inf, or None when all are finite.

    One `aminmax` reduction per tensor (NaN propagates into both; an inf shows in one): a read of the bytes without
    a tensor-sized temporary (`isfinite(t).all()` allocates one and was 15x slower on CPU), and one host sync for
    the whole bucket."""
    floats = [(name, t) for name, t in named if t.is_floating_point() and t.numel()]
    if not floats:
        return None
    extremes = torch.stack([torch.stack(torch.aminmax(t)).float() for _, t in floats])  # [tensors, 2]
    bad = (~torch.isfinite(extremes)).any(dim=-1)
    if not bool(bad.any()):
        return None
    names = [name for (name, _), b in zip(floats, bad.tolist()) if b]
    return f"tensors {names[:5]} hold non-finite values (NaN or inf): refused, as a NaN weight samples garbage"


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


def read_safetensors_dir(path: str, timeout_s: float = DISK_READ_TIMEOUT_S) -> NamedTensors:
    """Every tensor of the `*.safetensors` files in `path` (for /update_weights_from_disk), read from regular files
    only, and for at most `timeout_s` seconds (checked between tensors).

    Each file is opened without blocking and checked with fstat (`S_ISREG`) before safetensors reads it through that
    very descriptor: safetensors opens its path while holding the GIL, so a FIFO named `model.safetensors` (whose
    open waits for a writer) froze every thread of the server, /health included; /dev/zero would be read forever.
    Every path that is not a model directory gets the same answer (`NOT_A_MODEL_DIRECTORY`)."""
    from safetensors import SafetensorError, safe_open

    deadline = time.monotonic() + timeout_s
    not_a_model = WeightUpdateError(
        f"model_path {path!r} {NOT_A_MODEL_DIRECTORY}: expected a directory holding regular *.safetensors files"
    )
    try:
        if not stat.S_ISDIR(os.stat(path).st_mode):
            raise not_a_model
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    except (OSError, ValueError):  # missing, unreadable, or a path with a NUL byte
        raise not_a_model from None
    if not files:
        raise not_a_model
    out = []
    for file in files:
        try:
            fd = os.open(os.path.join(path, file), os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, no writer
        except OSError:
            raise not_a_model from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise not_a_model
            # the descriptor checked above, not the path again (which could be swapped for a FIFO meanwhile)
            source = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else os.path.join(path, file)
            try:
                with safe_open(source, framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118
                        if time.monotonic() >= deadline:
                            raise WeightUpdateError(
                                f"reading model_path {path!r} took more than {timeout_s:g} s; nothing was staged"
                            )
                        out.append((name, handle.get_tensor(name)))
            except SafetensorError as err:
                raise WeightUpdateError(f"{file} in model_path {path!r} is not valid safetensors: {err}") from err
        finally:
            os.close(fd)
    return out
