"""`torch.save` records of single tensors, written and read without torch.save / torch.load.

A torch_dist chunk is one `torch.save(tensor, stream)` record: a zip archive (stored, no compression) of

    archive/data.pkl                  pickle protocol 2: _rebuild_tensor_v2(storage '0', offset, size, stride, ...)
    archive/.format_version           "1"
    archive/.storage_alignment        "64"
    archive/byteorder                 "little"
    archive/data/0                    the storage bytes, 64-byte aligned inside the record
    archive/version                   "3\\n"
    archive/.data/serialization_id    40 digits
    central directory, zip64 end-of-central-directory record and locator, end-of-central-directory record

torch.save spends ~80 us of Python and pickling per record and computes its CRC32 at ~1.5 GB/s; torch.load spends
~100-140 us per record. A checkpoint of DeepSeek-V3's structure has ~46k chunks, so this module builds the same bytes
with `struct` (the pickle once per shape and dtype, zlib's CRC32 at ~4 GB/s) and reads the tensor straight out of
the record's buffer once the pickle of that shape has been seen by torch.load. `encode_tensor` matches torch.save byte
for byte except the serialization id (torch's is a hash of record names and CRCs, read by nothing; ours is zlib CRCs
of the same); tests compare, and torch.load reads what is written here.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import zlib
from functools import lru_cache
from typing import Any

import torch

ALIGNMENT = 64
PREFIX = "archive/"
#: records above this use torch.save (zip64 sizes and offsets in the local headers: not worth a second code path)
MAX_FAST_BYTES = 0xFFFFFFFF - (1 << 20)
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # signature ... file name length, extra length
_DESCRIPTOR = struct.Struct("<IIII")  # signature, crc32, compressed size, size
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_FLAGS = 0x0808  # data descriptor follows the data; UTF-8 names (what torch's miniz writer sets)


class RecordError(ValueError):
    """The bytes are not a torch.save record of one tensor."""


class _Storage:
    """Stands for storage "0" in the pickle (torch pickles storages by persistent id)."""

    def __init__(self, dtype: torch.dtype, numel: int) -> None:
        self.dtype, self.numel = dtype, numel


class _Tensor:
    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.storage = _Storage(dtype, _numel(shape))
        self.shape, self.stride = shape, _contiguous_stride(shape)

    def __reduce_ex__(self, protocol: int) -> tuple:
        args = (self.storage, 0, self.shape, self.stride, False, collections.OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return "storage", _storage_class(obj.dtype), "0", "cpu", obj.numel
        return None


#: dtypes torch pickles through a legacy typed-storage class (torch.BFloat16Storage, ...); others (float8) take
#: torch.save's _rebuild_tensor_v3 form and are left to torch.save
_LEGACY_STORAGE = torch.storage._dtype_to_storage_type_map()


def _storage_class(dtype: torch.dtype) -> Any:
    return getattr(torch, _LEGACY_STORAGE[dtype])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for s in reversed(shape):
        stride.append(step)
        step *= max(s, 1)
    return tuple(reversed(stride))


@lru_cache(maxsize=4096)
def _tensor_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(_Tensor(dtype, shape))
    return buffer.getvalue()


def _local_header(name: bytes, cursor: int) -> bytes:
    start = cursor + _LOCAL.size + len(name) + 4
    pad = -start % ALIGNMENT
    extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return _LOCAL.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra


def encode_tensor(tensor: torch.Tensor) -> list[Any] | None:
    """The buffers whose concatenation is `torch.save(tensor)` (a contiguous CPU tensor), or None where torch.save
    writes another form (empty tensors: no data record; float8: _rebuild_tensor_v3; records needing zip64 sizes):
    the caller then uses torch.save."""
    if tensor.dtype not in _LEGACY_STORAGE or not tensor.numel() or tensor.numel() * tensor.itemsize > MAX_FAST_BYTES:
        return None
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    records = [
        ("data.pkl", _tensor_pickle(tensor.dtype, tuple(tensor.shape))),
        (".format_version", b"1"),
        (".storage_alignment", b"64"),
        ("byteorder", sys.byteorder.encode()),
        ("data/0", data),
        ("version", b"3\n"),
    ]
    crcs = [zlib.crc32(payload) for _, payload in records]
    serial = f"{zlib.crc32(b''.join(PREFIX.encode() + n.encode() for n, _ in records)):020d}{crcs[4]:020d}".encode()
    records.append((".data/serialization_id", serial))
    crcs.append(zlib.crc32(serial))
    out: list[Any] = []
    central = []
    cursor = 0
    for (name, payload), crc in zip(records, crcs):
        full = (PREFIX + name).encode()
        header = _local_header(full, cursor)
        size = len(payload) if not isinstance(payload, memoryview) else payload.nbytes
        central.append(
            _CENTRAL.pack(0x02014B50, 0, 0, _FLAGS, 0, 0, 0, crc, size, size, len(full), 0, 0, 0, 0, 0, cursor) + full
        )
        out += [header, payload, _DESCRIPTOR.pack(0x08074B50, crc, size, size)]
        cursor += len(header) + size + _DESCRIPTOR.size
    directory = b"".join(central)
    n = len(records)
    tail = (
        directory
        + _ZIP64_END.pack(0x06064B50, _ZIP64_END.size - 12, 0x031E, 0x2D, 0, 0, n, n, len(directory), cursor)
        + _ZIP64_LOCATOR.pack(0x07064B50, 0, cursor + len(directory), 1)
        + _END.pack(0x06054B50, 0, 0, n, n, len(directory), cursor, 0)
    )
    out.append(tail)
    return out


def _entries(buf: memoryview) -> dict[bytes, tuple[int, int]]:
    """File name -> (data offset, size) from the record's central directory."""
    end = len(buf) - _END.size
    if end < 0 or struct.unpack_from("<I", buf, end)[0] != 0x06054B50:
        raise RecordError("no end-of-central-directory record")
    _, _, _, _, count, dir_size, dir_offset, _ = _END.unpack_from(buf, end)
    if dir_offset == 0xFFFFFFFF or count == 0xFFFF or dir_size == 0xFFFFFFFF:
        locator = end - _ZIP64_LOCATOR.size
        (_, _, zip64_end, _) = _ZIP64_LOCATOR.unpack_from(buf, locator)
        fields = _ZIP64_END.unpack_from(buf, zip64_end)
        count, dir_size, dir_offset = fields[7], fields[8], fields[9]
    out, pos = {}, dir_offset
    for _ in range(count):
        fields = _CENTRAL.unpack_from(buf, pos)
        if fields[0] != 0x02014B50 or fields[4] != 0:
            raise RecordError("unexpected central directory entry (compressed or damaged)")
        size, name_len, extra_len, comment_len, local = fields[9], fields[10], fields[11], fields[12], fields[16]
        name = bytes(buf[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len])
        if size == 0xFFFFFFFF or local == 0xFFFFFFFF:
            raise RecordError("zip64 entry")
        head = _LOCAL.unpack_from(buf, local)
        out[name] = (local + _LOCAL.size + head[9] + head[10], size)
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return out


#: data.pkl bytes -> (dtype, size, stride, storage offset, storage bytes), learnt from torch.load's reading of it
_KNOWN: dict[bytes, tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int, int]] = {}


def decode_tensor(buf: bytearray | memoryview) -> torch.Tensor:
    """The tensor of one torch.save record in `buf` (a view of `buf`: keep the buffer alive).

    The pickle of each new shape is read by torch.load (weights_only); later records with the same pickle take the
    tensor straight from their data/0 bytes. Records of anything but one tensor go to torch.load."""
    view = memoryview(buf)
    try:
        entries = _entries(view)
    except (RecordError, struct.error):
        entries = {}
    pkl = next((v for k, v in entries.items() if k.endswith(b"/data.pkl")), None)
    data = next((v for k, v in entries.items() if k.endswith(b"/data/0")), None)
    storages = sum(1 for k in entries if b"/data/" in k and not k.endswith(b"serialization_id"))
    order = next((v for k, v in entries.items() if k.endswith(b"/byteorder")), None)
    foreign = order is not None and bytes(view[order[0] : order[0] + order[1]]) != sys.byteorder.encode()
    if pkl is None or data is None or storages != 1 or foreign:  # torch.load byte-swaps a foreign byte order
        return torch.load(io.BytesIO(view), map_location="cpu", weights_only=True)
    key = bytes(view[pkl[0] : pkl[0] + pkl[1]])
    known = _KNOWN.get(key)
    if known is None:
        tensor = torch.load(io.BytesIO(view), map_location="cpu", weights_only=True)
        if not isinstance(tensor, torch.Tensor):
            return tensor
        storage_bytes = tensor.untyped_storage().nbytes()
        known = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), storage_bytes)
        if len(_KNOWN) < 4096:
            _KNOWN[key] = known
        if storage_bytes != data[1]:
            raise RecordError(f"data/0 holds {data[1]} bytes, the tensor's storage {storage_bytes}")
        return tensor
    dtype, shape, stride, offset, storage_bytes = known
    if storage_bytes != data[1]:
        raise RecordError(f"data/0 holds {data[1]} bytes, the tensor's storage {storage_bytes}")
    if data[0] + data[1] > len(view):
        raise RecordError("data/0 ends past the record")
    if storage_bytes == 0:
        return torch.empty(shape, dtype=dtype)
    storage = torch.frombuffer(view, dtype=torch.uint8, count=data[1], offset=data[0])
    return storage.view(dtype).as_strided(shape, stride, offset)
