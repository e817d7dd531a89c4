"""Megatron `torch_dist` checkpoints written and read tensor by tensor, without building the model.

Megatron's dist_checkpointing saves through PyTorch Distributed Checkpoint (DCP). A checkpoint directory holds:

    .metadata          pickled torch.distributed.checkpoint.metadata.Metadata: per key the global shape, dtype and
                       the chunks stored (offset and sizes in the global tensor); per chunk the file, byte offset
                       and length
    __<w>_0.distcp     chunks, each one `torch.save` record; ShardedObjects (`_extra_state`) as raw bytes
    metadata.json      {"sharded_backend": "torch_dist", ...}: what Megatron checks before loading
    common.pt          the non-sharded rest of the state dict (empty for a model)

Keys are global (absolute layer and expert indices; a TP shard is a region of one global tensor), which is why one
checkpoint loads under any layout. Saving through Megatron needs the whole model built and filled, then spends about
a millisecond per chunk in planning and copies every GLU fc1 on the way (measured: 53 s for 46k tensors, 7.5 GB,
4 GiB RSS per process). This module writes and reads the same format directly:

    plan = plan_checkpoint(spec, pg, build)  # the model built on the meta device with tp=pp=ep=1 (one layer per
                                             # kind, repeated): for every parameter, the chunks Megatron would
                                             # save and where each lies in it
    with ChunkWriter(tmp, part) as writer:   # per worker process, its own .distcp file
        writer.write(entry, value)           # value: the parameter, computed from HF tensors by the weight map;
                                             # each chunk torch.save's bytes, built by torch_record.py
    finish_checkpoint(tmp, plan, records)    # .metadata, metadata.json, common.pt
    reader = ChunkReader(directory)          # any torch_dist checkpoint (ours, or Megatron's under any layout)
    value = reader.read(entry)               # the chunks overlapping the parameter's regions, assembled
                                             # (records decoded by torch_record.py, torch.load once per shape)

The chunks are exactly those Megatron writes for a model with tp=pp=ep=1 (one per parameter; a GLU fc1 as two,
gate rows and up rows; experts along a leading expert axis), so Megatron loads them with its usual read pattern. Only
the padded vocabulary depends on the layout (a multiple of make_vocab_size_divisible_by x tp), as in Megatron.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import json
import math
import pickle
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mcore_rl.resharding.hf_io import CheckpointError
from mcore_rl.resharding.torch_record import decode_tensor, encode_tensor

METADATA_NAME = ".metadata"
CONFIG_NAME = "metadata.json"
COMMON_NAME = "common.pt"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}  # fmt: skip
#: Megatron model keys; other keys (optimizer state, RNG) in a training checkpoint are not part of the model
MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
#: what hf-to-mcore and training checkpoints write beside a model's torch_dist files (the dtype, vocabulary padding
#: and layout; the HF config and tokenizer under hf/), so that mcore-to-hf needs no --hf-config
CONVERT_META_NAME, HF_SUBDIR = "mcore_rl_convert.json", "hf"


@dataclass(frozen=True)
class Piece:
    """One chunk of a parameter: a region of the global tensor `key`, and where its values sit in the parameter."""

    key: str
    global_shape: tuple[int, ...]
    #: offset in the global tensor, Megatron's prepended axes (e.g. the expert index) included
    offset: tuple[int, ...]
    #: chunk sizes, prepended axes (size 1) included
    sizes: tuple[int, ...]
    #: (size, stride, storage offset) of the chunk's values inside the contiguous parameter
    view: tuple[tuple[int, ...], tuple[int, ...], int]


@dataclass(frozen=True)
class Entry:
    """One parameter or buffer of the tp=pp=ep=1 model, by its Megatron state-dict name."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class CheckpointPlan:
    """Everything a checkpoint of one model holds, in model order."""

    entries: list[Entry]
    dtype: torch.dtype
    #: ShardedObject unique key -> its data (None for layers without extra state)
    objects: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(e.numel for e in self.entries) * self.dtype.itemsize

    def split(self, parts: int) -> list[list[Entry]]:
        """Contiguous runs of entries with about equal bytes (model order kept, so each worker reads nearby files)."""
        total, runs, current, done = self.nbytes, [[] for _ in range(parts)], 0, 0
        for entry in self.entries:
            runs[current].append(entry)
            done += entry.numel * self.dtype.itemsize
            if current < parts - 1 and done >= total * (current + 1) / parts:
                current += 1
        return runs


def load_model_chunks(chunks: list[torch.nn.Module], pg_collection: Any, directory: str | Path) -> None:
    """Load a torch_dist checkpoint into a built Megatron model (any layout) through Megatron's own loader.

    Megatron-LM's convention for the state dict: "model" for one chunk, "model0", "model1", ... under virtual
    pipelining; tensor keys inside are global, so the checkpoint may have been saved under any other layout.
    """
    from megatron.core import dist_checkpointing

    check_metadata_is_data(directory)
    metadata = {"dp_cp_group": pg_collection.dp_cp}
    names = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    sharded = {name: c.sharded_state_dict(metadata=metadata) for name, c in zip(names, chunks)}
    state = dist_checkpointing.load(sharded, str(directory))
    for name, chunk in zip(names, chunks):
        chunk.load_state_dict(state[name], strict=True)


# ---------------------------------------------------------------------------------------------------- planning
def plan_checkpoint(
    spec: Any, pg_collection: Any, build_chunks: Callable[..., Any], fold_layers: bool = True
) -> CheckpointPlan:
    """The chunks of `spec`'s model as Megatron saves them, from the model built on the meta device.

    `spec.layout` must be tp=pp=ep=1 (one chunk holding every layer) and torch.distributed must be up (world 1 is
    enough). `build_chunks(spec, pg_collection, meta=True)` builds the model (`models/builder.py: build_gpt_chunks`,
    passed in so that resharding/ imports no model code). Factories (GLU fc1 halves) are built; each chunk is
    located inside its parameter by its view geometry.

    `fold_layers`: build one decoder layer of each kind (dense, MoE) instead of all of them and repeat its entries for
    the other layers of that kind (the keys of a layer differ from its twin's only by the layer index; torch_dist
    keeps no layer axis). Megatron's module construction costs ~0.5 ms per expert, so DeepSeek-V3's 61 x 256 experts
    take ~8 s to build and ~4 s to shard; folded, the plan takes well under a second. `fold_layers=False` builds
    everything (tests compare the two).
    """
    config = spec.transformer_config()
    kinds = layer_kinds(config)
    keep = representative_layers(kinds)
    if not fold_layers or len(keep) == len(kinds) or not _keys_carry_layer_index(config):
        return _plan_built(spec, pg_collection, build_chunks)
    overrides = dict(spec.config_overrides, num_layers=len(keep), moe_layer_freq=[kinds[i] for i in keep])
    small = _plan_built(dataclasses.replace(spec, config_overrides=overrides), pg_collection, build_chunks)
    return _unfold(small, kinds, keep)


def layer_kinds(config: Any) -> list[int]:
    """1 for an MoE decoder layer, 0 for a dense one (Megatron's reading of moe_layer_freq)."""
    if not config.num_moe_experts:
        return [0] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(config.num_layers)]
    return [int(k) for k in freq]


def _keys_carry_layer_index(config: Any) -> bool:
    """Whether Megatron keys decoder layers by their index (`decoder.layers.7.mlp...`), as it does for models whose
    layers differ (TransformerBlock.sharded_state_dict's `non_homogeneous_layers`: MoE or linear-attention layers
    interleaved with others). Models of identical layers are saved stacked along a leading layer axis instead; those
    are dense models, cheap to build whole, so they are not folded."""

    def interleaved(freq: Any) -> bool:
        return isinstance(freq, list) or (isinstance(freq, int) and freq > 1)

    return bool(
        interleaved(config.moe_layer_freq)
        or interleaved(getattr(config, "linear_attention_freq", None))
        or getattr(config, "hetereogenous_dist_checkpoint", False)
        or getattr(config, "heterogeneous_block_specs", False)
    )


def representative_layers(kinds: list[int]) -> list[int]:
    """Layers to build: the first of each kind, in order, and the last layer's kind last (MTP layers copy the spec
    of the decoder's last layer)."""
    keep = sorted({kind: i for i, kind in reversed(list(enumerate(kinds)))}.values())
    if kinds[keep[-1]] != kinds[-1]:
        keep.append(len(kinds) - 1)
    return keep


def _unfold(small: CheckpointPlan, kinds: list[int], keep: list[int]) -> CheckpointPlan:
    """The full plan from the plan of the representative layers: each layer gets its kind's entries, renamed."""
    prefix = "decoder.layers."
    layered = [i for i, e in enumerate(small.entries) if e.name.startswith(prefix)]
    first, last = layered[0], layered[-1]
    if layered != list(range(first, last + 1)):
        raise ValueError("decoder layer entries are not contiguous in the model's state dict")
    by_layer: dict[int, list[Entry]] = {}
    for entry in small.entries[first : last + 1]:
        by_layer.setdefault(int(entry.name[len(prefix) :].split(".", 1)[0]), []).append(entry)
    template = {kinds[original]: small_index for small_index, original in enumerate(keep)}

    def renamed(text: str, src: int, dst: int) -> str:
        head = f"{prefix}{src}."
        return f"{prefix}{dst}." + text[len(head) :] if text.startswith(head) else text

    entries = list(small.entries[:first])
    for layer, kind in enumerate(kinds):
        src = template[kind]
        for e in by_layer[src]:
            if not all(p.key.startswith(f"{prefix}{src}.") for p in e.pieces):
                raise ValueError(f"{e.name}: chunk keys without the layer index cannot be folded")
            pieces = tuple(dataclasses.replace(p, key=renamed(p.key, src, layer)) for p in e.pieces)
            entries.append(Entry(renamed(e.name, src, layer), e.shape, pieces))
    entries += small.entries[last + 1 :]
    objects = {}
    for key, data in small.objects.items():
        if not key.startswith(prefix):
            objects[key] = data
            continue
        src = int(key[len(prefix) :].split(".", 1)[0])
        for layer, kind in enumerate(kinds):
            if template[kind] == src:
                objects[renamed(key, src, layer)] = data
    return CheckpointPlan(entries, small.dtype, objects)


def _plan_built(spec: Any, pg_collection: Any, build_chunks: Callable[..., Any]) -> CheckpointPlan:
    """The plan from the whole model built on the meta device."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    layout = spec.layout
    if (layout.tp, layout.pp, layout.ep, layout.expert_tp, layout.virtual_stages) != (1, 1, 1, 1, 1):
        raise ValueError(f"plan_checkpoint needs the layout tp=pp=ep=etp=1, got {layout.describe()}")
    chunks, _ = build_chunks(spec, pg_collection, meta=True)
    model = chunks[0]
    tensors = {
        name: t
        for name, t in model.state_dict(keep_vars=True).items()
        if t is not None and not name.endswith("_extra_state")
    }
    sharded = model.sharded_state_dict()
    entries, objects = [], {}
    for name, value in sharded.items():
        if isinstance(value, ShardedObject):
            objects[value.unique_key] = value.data
            continue
        if name not in tensors:
            raise ValueError(f"Megatron saves {name!r}, which is not in the model's state dict")
        param = tensors.pop(name)
        if not param.is_contiguous():
            raise ValueError(f"{name}: parameter is not contiguous; cannot locate its chunks")
        built = value.build() if isinstance(value, ShardedTensorFactory) else value
        parts = built if isinstance(built, list) else list(built.values()) if isinstance(built, dict) else [built]
        pieces = []
        for st in parts:
            if not isinstance(st, ShardedTensor) or st.flattened_range is not None:
                raise ValueError(f"{name}: unsupported sharded entry {type(st).__name__}")
            data = st.data
            pieces.append(
                Piece(
                    key=st.key,
                    global_shape=tuple(st.global_shape),
                    offset=tuple(st.global_offset),
                    sizes=(1,) * st.prepend_axis_num + tuple(st.local_shape),
                    view=(tuple(data.shape), tuple(data.stride()), data.storage_offset() - param.storage_offset()),
                )
            )
        if sum(math.prod(p.sizes) for p in pieces) != param.numel():
            raise ValueError(f"{name}: its chunks do not cover the parameter exactly")
        entries.append(Entry(name, tuple(param.shape), tuple(pieces)))
    if tensors:
        raise ValueError(f"Megatron's sharded state dict lacks {sorted(tensors)[:5]}")
    return CheckpointPlan(entries, spec.dtype, objects)


# ----------------------------------------------------------------------------------------------------- writing
def _standalone(t: torch.Tensor) -> torch.Tensor:
    """`t` with a storage of exactly its own bytes (torch.save writes a view's whole storage)."""
    exact = t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.itemsize
    return t if exact else t.clone(memory_format=torch.contiguous_format)


class ChunkWriter:
    """Appends chunks to one `.distcp` file and records where each landed (one writer per worker process)."""

    def __init__(self, directory: str | Path, file_name: str) -> None:
        self.file_name = file_name
        self._file = open(Path(directory) / file_name, "wb")  # noqa: SIM115 - closed in close()
        #: (key, chunk offset or None for an object, byte offset, byte length)
        self.records: list[tuple[str, tuple[int, ...] | None, int, int]] = []
        self.bytes_written = 0
        self._position = 0
        self._none_record: bytes | None = None

    def write(self, entry: Entry, value: torch.Tensor) -> None:
        """Store every chunk of `entry`, cut from its full value (shape `entry.shape`, the checkpoint's dtype)."""
        value = value.contiguous()
        for piece in entry.pieces:
            chunk = value.as_strided(*piece.view).reshape(piece.sizes).contiguous()
            start = self._position
            buffers = encode_tensor(chunk)  # torch.save's bytes, built without torch.save (torch_record.py)
            if buffers is None:
                torch.save(_standalone(chunk), self._file)
                self._position = self._file.tell()
            else:
                for buffer in buffers:
                    self._position += self._file.write(buffer)
            self.records.append((piece.key, piece.offset, start, self._position - start))
        self.bytes_written += value.numel() * value.itemsize

    def write_object(self, key: str, data: Any) -> None:
        """A ShardedObject, serialised as Megatron does (torch.save of a one-element list; the bytes of `None`, the
        extra state of every non-TE layer, are made once)."""
        record = self._none_record if data is None else None
        if record is None:
            buffer = io.BytesIO()
            torch.save([data], buffer)
            record = buffer.getvalue()
            if data is None:
                self._none_record = record
        start = self._position
        self._position += self._file.write(record)
        self.records.append((key, None, start, self._position - start))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def finish_checkpoint(directory: str | Path, plan: CheckpointPlan, parts: list[tuple[str, list[tuple]]]) -> None:
    """Write `.metadata`, `metadata.json` and `common.pt` for chunks written by ChunkWriters.

    `parts` is [(file name, writer.records)] from every writer; every chunk and object of the plan must be in one.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    directory = Path(directory)
    state: dict[str, Any] = {}
    for entry in plan.entries:
        for p in entry.pieces:
            md = state.get(p.key)
            if md is None:
                properties = TensorProperties(dtype=plan.dtype)
                md = state[p.key] = TensorStorageMetadata(properties, torch.Size(p.global_shape), [])
            md.chunks.append(ChunkStorageMetadata(torch.Size(p.offset), torch.Size(p.sizes)))
    for md in state.values():
        md.chunks.sort(key=lambda c: tuple(c.offsets))
    for key in plan.objects:
        state[key] = BytesStorageMetadata()
    storage = {}
    for file_name, records in parts:
        for key, offset, start, length in records:
            index = MetadataIndex(key, None if offset is None else torch.Size(offset))
            storage[index] = _StorageInfo(file_name, start, length)
    expected = sum(len(e.pieces) for e in plan.entries) + len(plan.objects)
    if len(storage) != expected:
        raise RuntimeError(f"{directory}: {len(storage)} chunks written, the plan has {expected}")
    metadata = Metadata(state_dict_metadata=state, storage_data=storage, version="1.0.0")
    metadata.storage_meta = StorageMeta(checkpoint_id=str(directory), save_id=str(uuid.uuid4()))
    with open(directory / METADATA_NAME, "wb") as f:
        pickle.dump(metadata, f)
    torch.save({}, directory / COMMON_NAME)
    (directory / CONFIG_NAME).write_text(json.dumps(BACKEND))


# ----------------------------------------------------------------------------------------------------- reading
class UnsafeMetadata(pickle.UnpicklingError):
    """A `.metadata` file names a global that torch's checkpoint metadata never holds."""


class MetadataUnpickler(pickle.Unpickler):
    """Reads a torch_dist `.metadata` (a pickle torch's FileSystemWriter writes) admitting only the exact classes
    that file holds: torch.distributed.checkpoint's metadata dataclasses, sizes, dtypes and paths. A checkpoint
    handed to the converter is data; a plain `pickle.load` would run whatever callable a replaced file names."""

    _CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")  # fmt: skip
    _PLANNER = ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")
    _BUILTINS = ("dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool", "slice")
    ALLOWED = frozenset(
        {("torch.distributed.checkpoint.metadata", n) for n in _CLASSES}
        | {("builtins", n) for n in _BUILTINS}
        # Megatron's saves also keep the save plans (its cached-metadata path); enums and dataclasses of plain data
        | {("torch.distributed.checkpoint.planner", n) for n in _PLANNER}
        | {
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("torch.serialization", "_get_layout"),
            ("torch", "Size"),
            ("pathlib", "PosixPath"),
            ("collections", "OrderedDict"),
            ("copyreg", "__newobj__"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeMetadata(f"names {module}.{name}, which torch_dist metadata does not hold")


def read_metadata(directory: str | Path) -> Any:
    """A torch_dist checkpoint's `.metadata`, through `MetadataUnpickler`; CheckpointError naming the file if it is
    missing, corrupt, or names anything but torch's metadata classes."""
    path = Path(directory) / METADATA_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (not a torch_dist checkpoint)")
    try:
        with open(path, "rb") as f:
            return MetadataUnpickler(f).load()
    except UnsafeMetadata as err:
        raise CheckpointError(f"{path}: {err}; not loaded (unpickling it could run code)") from None
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a corrupt file
        raise CheckpointError(f"{path}: cannot be read ({type(err).__name__}: {err})") from None


def check_metadata_is_data(directory: str | Path) -> None:
    """Refuse a torch_dist checkpoint whose `.metadata` names anything but torch's metadata classes, before Megatron's
    loader reads it: torch's FileSystemReader unpickles that file without restriction, so a replaced one would run
    code. (A file swapped between this check and the load is outside what a check can stop: the checkpoint
    directory itself must be trusted, as in Megatron.)"""
    read_metadata(directory)


class ChunkReader:
    """Reads regions of a torch_dist checkpoint's tensors, assembling whatever chunks cover them."""

    def __init__(self, directory: str | Path) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.dir = Path(directory)
        metadata = read_metadata(self.dir)
        self.tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self._storage = {
            (index.fqn, None if index.offset is None else tuple(index.offset)): info
            for index, info in metadata.storage_data.items()
        }
        self._chunks: dict[str, tuple[list[tuple[int, ...]], list[Any], int]] = {}
        self._files: dict[str, Any] = {}
        self._last: tuple[tuple[str, tuple[int, ...]], torch.Tensor] | None = None
        self.bytes_read = 0

    def model_keys(self) -> set[str]:
        return {k for k in self.tensors if k.startswith(MODEL_KEY_PREFIXES)}

    def read(self, entry: Entry) -> torch.Tensor:
        """The full value of `entry` (contiguous, shape `entry.shape`, the checkpoint's dtype)."""
        pieces = entry.pieces
        dtype = self._metadata(pieces[0]).properties.dtype
        value = torch.empty(entry.shape, dtype=dtype)
        for piece in pieces:
            value.as_strided(*piece.view).copy_(self.read_region(piece).reshape(piece.view[0]))
        return value

    def _metadata(self, piece: Piece) -> Any:
        md = self.tensors.get(piece.key)
        if md is None:
            raise CheckpointError(f"{self.dir}: no tensor {piece.key!r} in the checkpoint")
        if tuple(md.size) != piece.global_shape:
            raise CheckpointError(
                f"{self.dir}: tensor {piece.key!r} has shape {tuple(md.size)} in the checkpoint, the model "
                f"(config.json) expects {piece.global_shape}"
            )
        return md

    def read_region(self, piece: Piece) -> torch.Tensor:
        """The region `piece.offset` + `piece.sizes` of the global tensor `piece.key`."""
        md = self._metadata(piece)
        lo, hi = piece.offset, tuple(o + s for o, s in zip(piece.offset, piece.sizes))
        out, covered = None, 0
        for chunk in self._overlapping(piece.key, md, lo[0], hi[0]):
            c_lo = tuple(chunk.offsets)
            c_hi = tuple(o + s for o, s in zip(chunk.offsets, chunk.sizes))
            a, b = tuple(map(max, lo, c_lo)), tuple(map(min, hi, c_hi))
            if any(x >= y for x, y in zip(a, b)):
                continue
            data = self._load(piece.key, c_lo, tuple(chunk.sizes))
            src = data[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, c_lo))]
            if a == lo and b == hi:
                return src  # the common case: the region is one whole chunk or inside one
            if out is None:
                out = torch.empty(piece.sizes, dtype=md.properties.dtype)
            out[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, lo))].copy_(src)
            covered += math.prod(y - x for x, y in zip(a, b))
        if covered != math.prod(piece.sizes):
            raise CheckpointError(f"{self.dir}: tensor {piece.key!r}: region at {lo} of {piece.sizes} is not stored")
        return out

    def _overlapping(self, key: str, md: Any, lo0: int, hi0: int) -> list[Any]:
        """Chunks of `key` whose first-axis range meets [lo0, hi0), via starts sorted once per key."""
        index = self._chunks.get(key)
        if index is None:
            chunks = sorted(md.chunks, key=lambda c: tuple(c.offsets))
            index = ([c.offsets[0] for c in chunks], chunks, max(c.sizes[0] for c in chunks))
            self._chunks[key] = index
        starts, chunks, longest = index
        first = bisect.bisect_left(starts, lo0 - longest + 1)
        last = bisect.bisect_left(starts, hi0)
        return chunks[first:last]

    def _load(self, key: str, offset: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        if self._last is not None and self._last[0] == (key, offset):
            return self._last[1]
        info = self._storage.get((key, offset))
        if info is None:
            raise CheckpointError(f"{self.dir}: chunk {offset} of {key!r} is listed but has no storage entry")
        f = self._files.get(info.relative_path)
        if f is None:
            path = self.dir / info.relative_path
            if not path.is_file():
                raise CheckpointError(f"{path}: missing (holds {key!r})")
            f = self._files[info.relative_path] = open(path, "rb")  # noqa: SIM115 - closed in close()
        f.seek(info.offset)
        data = bytearray(info.length)
        if f.readinto(data) != info.length:
            raise CheckpointError(f"{self.dir / info.relative_path}: truncated (chunk of {key!r} ends past the file)")
        try:
            tensor = decode_tensor(data)  # a view of `data` (torch.load only for the first record of each shape)
        except Exception as err:  # noqa: BLE001 - a damaged record
            raise CheckpointError(f"{self.dir / info.relative_path}: chunk of {key!r} is corrupt ({err})") from None
        if tuple(tensor.shape) != sizes:
            raise CheckpointError(f"{self.dir / info.relative_path}: chunk of {key!r} has shape {tuple(tensor.shape)}, "
                                  f"the metadata says {sizes}")  # fmt: skip
        self.bytes_read += info.length
        self._last = ((key, offset), tensor)
        return tensor

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._last = None

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
