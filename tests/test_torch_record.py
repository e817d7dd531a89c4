"""torch.save records of single tensors built and read without torch.save / torch.load (resharding/torch_record.py).

    .venv/bin/pytest -q tests/test_torch_record.py

The converter writes every torch_dist chunk with `encode_tensor` and reads with `decode_tensor`; Megatron loads the
chunks with torch.load. So: the bytes equal torch.save's up to the serialization id (read by nothing), the archive is
a valid zip (CRCs right), torch.load reads it back, and decode reads torch.save's own records.
"""

from __future__ import annotations

import io
import struct
import zipfile

import pytest
import torch

from mcore_rl.resharding.torch_record import RecordError, decode_tensor, encode_tensor

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool]  # fmt: skip
SHAPES = [(), (1,), (5,), (3, 4), (1, 64, 24), (2, 3, 5, 7), (4097,)]


def _sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 50
    return values > 0 if dtype == torch.bool else values.to(dtype)


def _torch_save(t: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(t, buffer)
    return buffer.getvalue()


def _encoded(t: torch.Tensor) -> bytes:
    return b"".join(bytes(b) for b in encode_tensor(t))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encoded_record_is_torch_saves_bytes(dtype: torch.dtype) -> None:
    for shape in SHAPES:
        t = _sample(shape, dtype)
        ours, theirs = _encoded(t), _torch_save(t)
        assert len(ours) == len(theirs), shape
        ours_zip, theirs_zip = zipfile.ZipFile(io.BytesIO(ours)), zipfile.ZipFile(io.BytesIO(theirs))
        assert ours_zip.testzip() is None  # every CRC32 right
        names = [i.filename for i in theirs_zip.infolist()]
        assert [i.filename for i in ours_zip.infolist()] == names
        serial = theirs_zip.getinfo("archive/.data/serialization_id")
        # every byte before the serialization id record is torch.save's: headers, padding, pickle, data, CRCs
        assert ours[: serial.header_offset] == theirs[: serial.header_offset], shape
        for info in theirs_zip.infolist()[:-1]:
            mine = ours_zip.getinfo(info.filename)
            assert (mine.header_offset, mine.file_size, mine.CRC) == (info.header_offset, info.file_size, info.CRC)
        back = torch.load(io.BytesIO(ours), weights_only=True)
        assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_forms_torch_save_writes_differently_are_left_to_it() -> None:
    assert encode_tensor(torch.empty(0, 3)) is None  # no data record for an empty storage
    assert encode_tensor(torch.zeros(4, dtype=torch.float8_e4m3fn)) is None  # _rebuild_tensor_v3


def test_decode_reads_torch_saves_records_and_ours() -> None:
    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        for seed, shape in enumerate([(7, 3), (7, 3), (1, 64, 24), (2, 2, 2, 2)]):
            t = _sample(shape, dtype, seed)
            for record in (_torch_save(t), _encoded(t)):
                # first sight of a pickle goes through torch.load, later ones straight from the bytes: both paths
                for _ in range(2):
                    back = decode_tensor(bytearray(record))
                    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t), (dtype, shape)
    # views and non-contiguous tensors as torch.save writes them (the whole storage, an offset, strides)
    base = torch.arange(24, dtype=torch.float32)
    for view in (base[5:11], base.view(4, 6).t(), base.view(2, 3, 4)[:, 1]):
        assert torch.equal(decode_tensor(bytearray(_torch_save(view))), view)
        assert torch.equal(decode_tensor(bytearray(_torch_save(view))), view)
    # not a tensor: torch.load's answer (ShardedObjects are saved as one-element lists)
    assert decode_tensor(bytearray(_torch_save([None]))) == [None]


def test_decoded_tensor_owns_its_buffer() -> None:
    """The tensor is a view of the read buffer: the buffer must outlive the caller's reference to it."""
    t = _sample((64, 8), torch.float32)
    record = _encoded(t)
    decode_tensor(bytearray(record))  # learn the pickle
    back = decode_tensor(bytearray(record))
    junk = [bytearray(len(record)) for _ in range(50)]  # reuse of freed memory would show up as zeros
    assert torch.equal(back, t) and len(junk) == 50


def test_record_whose_data_size_disagrees_with_its_pickle_is_refused() -> None:
    t = _sample((8,), torch.float32)
    record = bytearray(_encoded(t))
    decode_tensor(bytearray(record))  # learn the pickle of an (8,) float32
    directory = zipfile.ZipFile(io.BytesIO(bytes(record)))
    info = directory.getinfo("archive/data/0")
    # patch the central directory entry's two size fields of data/0: 32 bytes -> 16
    entry = bytes(record).index(b"PK\x01\x02", bytes(record).index(b"PK\x01\x02") + 1)
    while bytes(record[entry + 46 : entry + 46 + len(info.filename)]) != info.filename.encode():
        entry = bytes(record).index(b"PK\x01\x02", entry + 1)
    struct.pack_into("<II", record, entry + 20, 16, 16)
    with pytest.raises(RecordError, match="data/0 holds 16 bytes, the tensor's storage 32"):
        decode_tensor(record)


def test_truncated_record_is_an_error() -> None:
    record = _encoded(_sample((16, 16), torch.bfloat16))
    with pytest.raises(Exception):  # noqa: B017, PT011 - torch.load's own error for a damaged zip
        decode_tensor(bytearray(record[:-30]))


def test_record_of_the_other_byte_order_is_read_as_torch_load_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pickle alone does not say the byte order: a record written on a big-endian machine must not take the
    fast path (torch.load swaps its bytes)."""
    import sys

    t = _sample((4, 5), torch.float32)
    decode_tensor(bytearray(_encoded(t)))  # the pickle of a (4, 5) float32 is known now
    other = "big" if sys.byteorder == "little" else "little"
    with monkeypatch.context() as patch:
        patch.setattr(sys, "byteorder", other)
        foreign = _encoded(t)
    assert b"archive/byteorder" in foreign and other.encode() in foreign
    expected = torch.load(io.BytesIO(foreign), weights_only=True)
    assert not torch.equal(expected, t)  # swapped: the same bytes read in the other order
    assert torch.equal(decode_tensor(bytearray(foreign)), expected)
