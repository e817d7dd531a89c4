"""Streaming HF safetensors I/O: read a checkpoint tensor by tensor, write one shard at a time.

    reader = HFCheckpointReader("Qwen3-30B-A3B/")         # validates every file's header up front
    w = reader.read("model.embed_tokens.weight")            # memory-mapped; KeyError if absent
    with HFCheckpointWriter("out/", max_shard_bytes=5 << 30) as writer:
        writer.add(name, tensor)                            # buffered until the shard is full
        writer.write_config(config_dict)
        writer.copy_side_files("Qwen3-30B-A3B/")            # generation config, tokenizer files
    # out/ appears only here, renamed from out.tmp-<pid>; an exception or a kill leaves no out/

Memory: the reader maps files through `safetensors.safe_open` (zero-copy views) and drops every mapping once
`remap_bytes` have been read through them (all files together), so resident file pages stay bounded while the
converter walks a 700 GB checkpoint in whatever order its weight map asks. The writer holds at most one shard's
tensors and serialises them itself (header, then each tensor's bytes straight from its storage), which avoids the
second in-memory copy that `safetensors.torch.save_file` makes.

The safetensors format: 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data region.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: files copied next to the weights: generation config, tokenizers, chat templates, remote code
SIDE_FILE_PATTERNS = (
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template*",
    "*.tiktoken",
    "*.py",
)

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file or directory is unusable; the message names the file (and tensor)."""


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '1.5GiB' / '1024' -> bytes (decimal units for KB/MB/GB, binary for KiB/MiB/GiB)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units |= {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
    s = text.strip().upper()
    number = s.rstrip("KMGTIB")
    unit = s[len(number) :]
    try:
        value = float(number) * units[unit]
    except (KeyError, ValueError):
        raise ValueError(f"cannot read size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count") from None
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return int(value)


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)

#: names with these endings are files a loader opens (weights, configs, tokenizer files, templates, remote code)
_FILE_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt", ".model", ".tiktoken", ".py", ".bin", ".pt")


def not_readable_as(path: str | Path, want_dir: bool = False) -> str | None:
    """Why `path` cannot be read as a regular file (a directory with `want_dir`), or None when it can or does not
    exist at all (the caller names a missing file in its own words). Symbolic links are followed wherever they point,
    as HF's cache links a snapshot's files to its blobs; a link to a FIFO, a device or a socket (whose reading would
    block or never end), a dangling link and a loop are named, with the link's target."""
    path = str(path)
    expected = "a directory" if want_dir else "a regular file"
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        if not os.path.islink(path):
            return None
        what = "a loop of symbolic links" if err.errno == errno.ELOOP else f"not there ({err.strerror})"
        return f"{path} is a symbolic link to {os.readlink(path)!r}, which is {what}; expected {expected}"
    if stat.S_ISDIR(mode) if want_dir else stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    via = f" (a symbolic link to {os.readlink(path)!r})" if os.path.islink(path) else ""
    return f"{path}{via} is {kind}; expected {expected}"


def unreadable_entry(directory: str | Path) -> str | None:
    """The first entry of `directory` (a model, tokenizer or checkpoint directory; hidden entries aside) that a loader
    could not read: not_readable_as for each file (a name with a loader's file suffix is a file, even where it is a
    directory), each other sub-directory must be one. None when all are readable."""
    directory = str(directory)
    for name in sorted(os.listdir(directory)):
        if name.startswith("."):
            continue
        path = os.path.join(directory, name)
        folder = os.path.isdir(path) and not name.endswith(_FILE_SUFFIXES)
        problem = not_readable_as(path, want_dir=folder)
        if problem is not None:
            return problem
    return None


def read_header(path: str | Path) -> dict[str, dict[str, Any]]:
    """Parse and validate a safetensors header against the file size; {name: {dtype, shape, data_offsets}}.

    Catches truncated files (data offsets past the end), corrupt headers (bad length or JSON), and tensors whose
    byte range disagrees with their dtype and shape, before any tensor is read.
    """
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: {size} bytes is too short to be a safetensors file (truncated?)")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8 or header_len > 100 << 20:
            raise CheckpointError(
                f"{path}: header length {header_len} exceeds the file size {size} (truncated or not safetensors)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: header is not valid JSON ({err}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object; the file is corrupt")
    header.pop("__metadata__", None)
    data_len = size - 8 - header_len
    end_max = 0
    for name, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        expected = numel * dtype.itemsize
        if end > data_len:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {end} of the data region, but the file holds only "
                f"{data_len} data bytes (truncated file)"
            )
        if begin < 0 or end - begin != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r} spans bytes [{begin}, {end}) but {info['dtype']}{shape} needs {expected}"
            )
        end_max = max(end_max, end)
    if end_max != data_len:
        raise CheckpointError(f"{path}: data region is {data_len} bytes but tensors cover {end_max} (corrupt file)")
    return header


class HFCheckpointReader:
    """Read-only view of an HF checkpoint directory (config.json + sharded or single safetensors)."""

    def __init__(self, path: str | Path, remap_bytes: int = 512 << 20) -> None:
        self.dir = Path(path)
        if not self.dir.is_dir():
            raise CheckpointError(not_readable_as(self.dir, want_dir=True) or f"{self.dir}: not a directory")
        problem = unreadable_entry(self.dir)
        if problem is not None:
            raise CheckpointError(problem)
        config_path = self.dir / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path}: missing (an HF checkpoint needs config.json)")
        try:
            self.config: dict[str, Any] = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{config_path}: not valid JSON ({err})") from None
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{config_path}: holds {type(self.config).__name__}, expected a JSON object")
        self.remap_bytes = remap_bytes
        self._file_of: dict[str, str] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._handles: dict[str, Any] = {}
        self._mapped_bytes = 0
        index_path = self.dir / INDEX_NAME
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index_path}: not a valid index ({err!r})") from None
            files = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE_NAME).is_file():
            weight_map, files = None, [SINGLE_NAME]
        else:
            raise CheckpointError(f"{self.dir}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
        for file in files:
            if not (self.dir / file).is_file():
                raise CheckpointError(f"{self.dir / file}: listed in {INDEX_NAME} but missing")
            header = read_header(self.dir / file)
            for name, info in header.items():
                if weight_map is not None and weight_map.get(name) != file:
                    raise CheckpointError(
                        f"{self.dir / file}: tensor {name!r} is not listed for this file in the index"
                    )
                self._file_of[name] = file
                self._info[name] = info
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in self._info:
                    raise CheckpointError(
                        f"{self.dir / file}: tensor {name!r} is listed in the index but not in the file"
                    )

    def names(self) -> list[str]:
        """Every tensor name, in file order then header order."""
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def file_of(self, name: str) -> Path:
        """The file holding `name` (KeyError if absent)."""
        return self.dir / self._file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the header, without reading data."""
        return tuple(self._info[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """Dtype from the header, without reading data."""
        return DTYPES[self._info[name]["dtype"]]

    def nbytes(self, name: str) -> int:
        begin, end = self._info[name]["data_offsets"]
        return end - begin

    def total_bytes(self) -> int:
        """Bytes of tensor data in the checkpoint."""
        return sum(self.nbytes(n) for n in self._info)

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name`: a zero-copy view of the file mapping (KeyError names the checkpoint if absent)."""
        file = self._file_of.get(name)
        if file is None:
            raise KeyError(f"{name} (not in {self.dir})")
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(str(self.dir / file), framework="pt", device="cpu")
        tensor = handle.get_tensor(name)
        self._mapped_bytes += self.nbytes(name)
        if self._mapped_bytes >= self.remap_bytes:
            # Dropping the handles unmaps the files once the tensors viewing them die, which returns the touched
            # pages. The budget is global: a converter reading every layer's experts touches every file, and a
            # window per file would let resident pages grow with the number of files.
            self._handles.clear()
            self._mapped_bytes = 0
        return tensor

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every tensor, in file order."""
        for name in self.names():
            yield name, self.read(name)

    def side_files(self) -> list[Path]:
        """Generation config, tokenizer and remote-code files present next to the weights."""
        found: dict[str, Path] = {}
        for pattern in SIDE_FILE_PATTERNS:
            for p in self.dir.glob(pattern):
                if p.is_file():
                    found[p.name] = p
        return [found[k] for k in sorted(found)]

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> HFCheckpointReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy when it is already contiguous."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B") if flat.numel() else memoryview(b"")


def write_safetensors(
    path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> int:
    """Serialise `tensors` to `path` in safetensors format, streaming each tensor's bytes; returns bytes written."""
    layout = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    header = _header_bytes(list(tensors), layout, Path(path), metadata)
    with open(path, "wb") as f:
        f.write(header)
        for t in tensors.values():
            f.write(_tensor_bytes(t.cpu()))
    return len(header) + sum(t.numel() * t.element_size() for t in tensors.values())


def _header_bytes(
    names: list[str],
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    path: Path,
    metadata: dict[str, str] | None = None,
) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding `names` (in that order) of `layout`."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name in names:
        dtype, shape = layout[name]
        if dtype not in DTYPE_NAMES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}, which safetensors cannot store")
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors itself writes
    return struct.pack("<Q", len(raw)) + raw


def prepare_output(out_dir: str | Path, overwrite: bool = False) -> Path:
    """Refuse an existing `out_dir` (unless overwrite) and create the empty `<out>.tmp-<pid>` to write into."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out}: output directory exists (pass overwrite / --overwrite to replace it)")
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except OSError as err:
        raise CheckpointError(f"{out}: cannot create the output directory here ({err.strerror or err})") from None
    return tmp


def move_into_place(tmp: Path, out: Path) -> Path:
    """Rename the finished `tmp` to `out`, replacing an existing `out` (the caller checked overwrite)."""
    old = None
    if out.exists():
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)
    return out


def publish(tmp: Path, out: Path, parts: list[tuple[str, list[str], int]]) -> Path:
    """Name the shard files model-0000X-of-0000N in `parts` order, write the index, move `tmp` to `out`.

    `parts` are (file in tmp, tensor names, bytes), possibly from several writers (one per rank).
    """
    total = len(parts)
    weight_map: dict[str, str] = {}
    for i, (file, names, _) in enumerate(parts, start=1):
        final = f"model-{i:05d}-of-{total:05d}.safetensors"
        (tmp / file).rename(tmp / final)
        for name in names:
            if name in weight_map:
                raise CheckpointError(f"{out}: tensor {name!r} written twice")
            weight_map[name] = final
    index = {"metadata": {"total_size": sum(p[2] for p in parts)}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return move_into_place(tmp, out)


class HFCheckpointWriter:
    """Writes an HF checkpoint shard by shard into `<out>.tmp-<pid>`, renamed to `<out>` by `close()`.

    At most one shard's tensors are held. Shards are named model-0000X-of-0000N.safetensors at close, when N is known.
    With `tmp_dir` the writer is one of several (one per rank) filling a directory a coordinator prepared: `finish()`
    returns its parts, and the coordinator calls `publish` with every writer's parts.

    With `layout` ([(name, dtype, shape)] in the order the tensors will be added) the shards are cut up front and
    every tensor goes straight to its file as it is added: nothing is held, so memory no longer grows with the shard
    size (a 5 GB shard otherwise costs 5 GB of RSS). Tensors must then arrive in exactly that order and form.
    """

    def __init__(
        self,
        out_dir: str | Path,
        max_shard_bytes: int = 5 * 10**9,
        overwrite: bool = False,
        *,
        tmp_dir: str | Path | None = None,
        part_prefix: str = "part-",
        layout: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = None,
    ) -> None:
        self.out = Path(out_dir)
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.tmp = prepare_output(self.out, overwrite) if tmp_dir is None else Path(tmp_dir)
        self.max_shard_bytes = max_shard_bytes
        self.part_prefix = part_prefix
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._parts: list[tuple[str, list[str], int]] = []
        self._seen: set[str] = set()
        self.total_bytes = 0
        self._closed = False
        self._layout = None if layout is None else {name: (dtype, tuple(shape)) for name, dtype, shape in layout}
        self._order = [] if layout is None else [name for name, _, _ in layout]
        self._next = 0
        self._file: Any = None
        self._file_left: list[str] = []
        if layout is not None:
            if len(self._layout) != len(layout):
                raise CheckpointError(f"{self.out}: the layout names a tensor twice")
            shards: list[list[str]] = []
            size = 0
            for name, dtype, shape in layout:
                n = math.prod(shape) * dtype.itemsize
                if not shards or (shards[-1] and size + n > max_shard_bytes):
                    shards.append([])
                    size = 0
                shards[-1].append(name)
                size += n
            self._planned_shards = shards

    def _add_planned(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._order[self._next] if self._next < len(self._order) else None
        if name != expected:
            raise CheckpointError(f"{self.out}: tensor {name!r} added where the layout has {expected!r}")
        dtype, shape = self._layout[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{self.out}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, the layout says {dtype} {shape}"
            )
        if self._file is None:
            names = self._planned_shards[len(self._parts)]
            file = f"{self.part_prefix}{len(self._parts) + 1:05d}.safetensors"
            self._file = open(self.tmp / file, "wb")  # noqa: SIM115 - closed when its last tensor is written
            self._file.write(_header_bytes(names, self._layout, self.tmp / file))
            self._file_left = list(names)
            nbytes = sum(math.prod(self._layout[n][1]) * self._layout[n][0].itemsize for n in names)
            self._parts.append((file, list(names), nbytes))
        self._file.write(_tensor_bytes(tensor))
        self._file_left.pop(0)
        self._next += 1
        self.total_bytes += tensor.numel() * tensor.element_size()
        if not self._file_left:
            self._file.close()
            self._file = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue a tensor; the current shard is written first when `tensor` would overflow it."""
        if self._layout is not None:
            self._add_planned(name, tensor)
            return
        if name in self._seen:
            raise CheckpointError(f"{self.out}: tensor {name!r} written twice")
        self._seen.add(name)
        n = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + n > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += n
        self.total_bytes += n

    def _flush(self) -> None:
        if not self._pending:
            return
        file = f"{self.part_prefix}{len(self._parts) + 1:05d}.safetensors"
        write_safetensors(self.tmp / file, self._pending)
        self._parts.append((file, list(self._pending), self._pending_bytes))
        self._pending, self._pending_bytes = {}, 0

    def write_config(self, config: dict[str, Any], name: str = "config.json") -> None:
        """Write a JSON file (config.json by default) into the output."""
        (self.tmp / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    def copy_side_files(self, src_dir: str | Path, files: list[Path] | None = None) -> list[str]:
        """Copy generation config / tokenizer / remote-code files from `src_dir`; returns the names copied."""
        return copy_side_files(src_dir, self.tmp, files)

    def finish(self) -> list[tuple[str, list[str], int]]:
        """Write the last shard; return this writer's parts (file, tensor names, bytes) for `publish`."""
        if self._layout is not None and self._next != len(self._order):
            raise CheckpointError(
                f"{self.out}: {len(self._order) - self._next} tensor(s) of the layout never added, "
                f"first {self._order[self._next]!r}"
            )
        self._flush()
        return list(self._parts)

    def close(self) -> Path:
        """Write the last shard and the index, rename shards to their final names, move the directory into place."""
        if not self._closed:
            publish(self.tmp, self.out, self.finish())
            self._closed = True
        return self.out

    def abort(self) -> None:
        """Discard everything written so far (the output directory is never created)."""
        self._pending.clear()
        if self._file is not None:
            self._file.close()
            self._file = None
        self._closed = True
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> HFCheckpointWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def copy_side_files(src_dir: str | Path, dst_dir: str | Path, files: list[Path] | None = None) -> list[str]:
    """Copy generation config / tokenizer / remote-code files from `src_dir` into `dst_dir`; returns the names."""
    src, dst = Path(src_dir), Path(dst_dir)
    if files is None:
        files = [p for pattern in SIDE_FILE_PATTERNS for p in src.glob(pattern) if p.is_file()]
    copied = []
    for p in files:
        if p.name in ("config.json", INDEX_NAME) or p.name.endswith(".safetensors"):
            continue
        shutil.copy2(p, dst / p.name)
        copied.append(p.name)
    return sorted(set(copied))


#: DeepSeek-V3's FP8 block (quantization_config.weight_block_size)
FP8_BLOCK = (128, 128)


def fp8_block_size(config: dict[str, Any]) -> tuple[int, int] | None:
    """The FP8 weight block of a checkpoint's config.json (None when it is not quantised); refuses other schemes."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"quantization_config {quant} is not supported (only DeepSeek-style blockwise fp8 e4m3)")
    return tuple(quant.get("weight_block_size", FP8_BLOCK))


def fp8_aware_reader(
    reader: HFCheckpointReader,
    block: tuple[int, int] | None = None,
    progress: Any = None,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """`read(name)` for load_hf_weights: FP8 weights come back dequantised (fp32 math: q * weight_scale_inv, rounded
    once to `dtype`; a caller that stores bf16 gets the same bits as rounding the fp32 result itself, one pass sooner).

    `block` defaults to the checkpoint's own quantization_config; `progress` (a tqdm bar) advances by bytes read.
    """
    from mcore_rl.kernels.fp8_blockwise import dequantize_blockwise

    block = block if block is not None else fp8_block_size(reader.config)

    def read(name: str) -> torch.Tensor:
        tensor = reader.read(name)
        if progress is not None:
            progress.update(reader.nbytes(name))
        if tensor.dtype == torch.float8_e4m3fn:
            scale_name = name + "_scale_inv"
            if block is None or scale_name not in reader:
                raise CheckpointError(f"{reader.file_of(name)}: FP8 tensor {name!r} has no {scale_name!r}")
            return dequantize_blockwise(tensor, reader.read(scale_name), block, dtype)
        return tensor

    return read
