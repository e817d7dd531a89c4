"""The tensor payload's wire format (resharding/sync/wire.py): what the sender encodes, the receiver decodes bit for
bit, for every load_format; and both ends use the one module's functions.

Run: `.venv/bin/pytest tests/test_wire_format.py`
"""

from __future__ import annotations

import base64
import types

import pytest
import torch

import mcore_rl.resharding.sync.transports as transports
import mcore_rl.resharding.sync.transports.tensor as tensor_transport
import mcore_rl.rollout.weight_receiver as weight_receiver
from mcore_rl.resharding.sync import wire
from mcore_rl.rollout.safe_pickle import safe_loads


def _bucket() -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and shapes, odd sizes first so later tensors need padding, a 0-d and an empty tensor."""
    g = torch.Generator().manual_seed(0)
    named = [
        ("int8.odd", torch.randint(-128, 127, (3,), dtype=torch.int8, generator=g)),
        ("bf16.matrix", torch.randn(5, 7, generator=g).to(torch.bfloat16)),
        ("bool.flags", torch.rand(3, generator=g) > 0.5),
        ("f32.scalar", torch.tensor(3.25)),  # 0-d
        ("f16.cube", torch.randn(2, 3, 4, generator=g).half()),
        ("i64.row", torch.randint(-(2**40), 2**40, (1, 5), dtype=torch.int64, generator=g)),
        ("f32.empty", torch.empty(0, 4)),
        ("f64.col", torch.randn(4, 1, generator=g, dtype=torch.float64)),
        ("bf16.scalar", torch.tensor(-1.5, dtype=torch.bfloat16)),  # 0-d bf16 after an 8-byte dtype
    ]
    # bit patterns no arithmetic makes: a NaN payload and a negative zero survive only a byte-exact path
    named.append(("f32.bits", torch.tensor([0x7FC00123, -2147483648, 1], dtype=torch.int32).view(torch.float32)))
    return named


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_bit_exact(out: list[tuple[str, torch.Tensor]], named: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in out] == [n for n, _ in named]
    for (name, got), (_, sent) in zip(out, named):
        assert got.dtype == sent.dtype, name
        assert got.shape == sent.shape, name
        assert _bits(got) == _bits(sent), name


@pytest.mark.parametrize("load_format", ["flattened_bucket", None, "auto"])
def test_every_dtype_and_shape_round_trips_bit_exact(load_format: str | None) -> None:
    """encode_payload -> decode_payload gives the same names, dtypes, shapes and bytes, through the wire module with
    the server's allow-list and through the embedded server's own decoder."""
    named = _bucket()
    payload = wire.encode_payload(named, load_format)
    _assert_bit_exact(wire.decode_payload(payload, load_format, safe_loads), named)
    _assert_bit_exact(weight_receiver.decode_payload(payload, load_format), named)
    _assert_bit_exact(weight_receiver.decode_payload(base64.b64decode(payload), load_format), named)  # raw bytes


def test_flattened_layout_is_the_documented_one() -> None:
    """The byte layout the module docstring states: tensors back to back in bucket order, each at a multiple of its
    item size with zero padding before it, records with the byte range (numel = its byte count)."""
    named = [("a", torch.tensor([1, 2, 3], dtype=torch.int8)), ("b", torch.tensor([1.0, -2.0])), ("c", torch.tensor(7))]
    flat, metadata = wire.flatten(named)
    assert flat.dtype == torch.uint8
    expected = _bits(named[0][1]) + b"\0" + _bits(named[1][1]) + b"\0" * 4 + _bits(named[2][1])
    assert flat.numpy().tobytes() == expected
    assert [(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel) for m in metadata] == [
        ("a", torch.Size([3]), torch.int8, 0, 3, 3),
        ("b", torch.Size([2]), torch.float32, 4, 12, 8),
        ("c", torch.Size([]), torch.int64, 16, 24, 8),
    ]
    assert all(type(m) is types.SimpleNamespace for m in metadata)  # what SGLang's SafeUnpickler admits
    obj = safe_loads(base64.b64decode(wire.encode_payload(named), validate=True))
    assert set(obj) == {"flattened_tensor", "metadata"}
    assert obj["flattened_tensor"].numpy().tobytes() == expected
    assert [vars(m) for m in obj["metadata"]] == [vars(m) for m in metadata]
    listed = safe_loads(base64.b64decode(wire.encode_payload(named, None), validate=True))
    assert [n for n, _ in listed] == ["a", "b", "c"] and all(isinstance(t, torch.Tensor) for _, t in listed)


def test_sender_and_receiver_use_the_same_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    """One format module: the transports, the package exports and the embedded server's receiver name the wire
    module's functions themselves, and the receiver decodes through wire.decode_payload."""
    assert transports.encode_payload is tensor_transport.encode_payload is wire.encode_payload
    assert weight_receiver.encode_payload is wire.encode_payload
    assert transports.flatten is tensor_transport.flatten is weight_receiver.flatten is wire.flatten
    assert tensor_transport.encode is wire.encode and tensor_transport.encode_cuda is wire.encode_cuda
    assert tensor_transport.record is wire.record
    assert weight_receiver.wire is wire
    calls = []
    decode = wire.decode_payload
    monkeypatch.setattr(wire, "decode_payload", lambda *args: calls.append(args) or decode(*args))
    weight_receiver.decode_payload(wire.encode_payload(_bucket()), "flattened_bucket")
    assert len(calls) == 1 and calls[0][1] == "flattened_bucket"


def test_a_misaligned_record_is_refused_as_a_wire_error() -> None:
    flat, metadata = wire.flatten([("pad", torch.zeros(1, dtype=torch.int8)), ("w", torch.ones(2))])
    metadata[1].start_idx, metadata[1].end_idx = 1, 9
    with pytest.raises(wire.WireFormatError, match="not a multiple of its torch.float32 item size 4"):
        wire.unflatten({"flattened_tensor": flat, "metadata": metadata})
    payload = wire.encode({"flattened_tensor": flat, "metadata": metadata})
    with pytest.raises(weight_receiver.WeightUpdateError, match="not a multiple"):
        weight_receiver.decode_payload(payload, "flattened_bucket")
