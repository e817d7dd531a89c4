"""The `tensor` transport into SGLang's own deserializer in a second process, with buffers reused as the executor
reuses them (two, bucket k packed into the buffer of bucket k - 2), every byte checked.

The receiver is tests/_sglang_receiver.py: SGLang 0.5.23's normalize + `MultiprocessingSerializer.deserialize` after
`monkey_patch_torch_reductions`, and `FlattenedTensorBucket`, extracted from the wheel by `make setup`.
CPU payloads are shared-memory segments; the `gpu` tests send CUDA IPC handles (one payload per engine rank, device
written as the GPU's UUID) and check that a receiver that answers before it copies (as SGLang does) still reads the
bucket it was sent, not a later one packed into the same reused buffer.

Run: `.venv/bin/pytest tests/test_sglang_tensor_transport.py`
"""

from __future__ import annotations

import base64
import types
from pathlib import Path

import pytest
import requests
import torch
from _sglang_code import sglang_receiver_process
from safetensors.torch import load_file

from mcore_rl.resharding.sync.transports.tensor import TensorTransport
from mcore_rl.rollout.engines.receivers import SGLangReceiver

SHAPES = [(16, 8), (3, 7), (5,)]  # float32, int32, bfloat16: each offset a multiple of its item size, no padding
DTYPES = ["float32", "int32", "bfloat16"]


def _bucket(k: int) -> tuple[types.SimpleNamespace, dict[str, torch.Tensor]]:
    """Bucket k (the fields TensorTransport reads) and the tensors it carries, distinct for every k."""
    entries, tensors, offset = [], {}, 0
    for i, (shape, dtype) in enumerate(zip(SHAPES, DTYPES)):
        numel = torch.Size(shape).numel()
        tensor = (torch.arange(numel) * (k + 1) + 1000 * k + i).to(getattr(torch, dtype)).reshape(shape)
        nbytes = tensor.numel() * tensor.element_size()
        name = f"bucket{k}.tensor{i}"
        entries.append(types.SimpleNamespace(name=name, shape=shape, dtype=dtype, offset=offset, nbytes=nbytes))
        tensors[name] = tensor
        offset += nbytes
    return types.SimpleNamespace(index=k, nbytes=offset, entries=tuple(entries)), tensors


def _push(urls: list[str], device: str, buckets: int, ranks_per_engine: int = 1) -> dict[str, torch.Tensor]:
    """Send `buckets` buckets through two reused buffers, as resharding/sync/execute.py does; what was sent."""
    transport = TensorTransport(
        urls, api_key=None, weight_version="1", receiver=SGLangReceiver(), ranks_per_engine=ranks_per_engine,
        timeout_s=60, device=device,
    )  # fmt: skip
    stream = types.SimpleNamespace(name="pp0-dense", index=0)
    sent: dict[str, torch.Tensor] = {}
    try:
        buffers = [transport.allocate(_bucket(0)[0].nbytes) for _ in range(2)]
        for k in range(buckets):
            bucket, tensors = _bucket(k)
            buffer = buffers[k % 2][: bucket.nbytes]
            for e in bucket.entries:  # pack
                buffer[e.offset : e.offset + e.nbytes].copy_(tensors[e.name].reshape(-1).view(torch.uint8))
            transport.send(stream, bucket, buffer)
            sent.update(tensors)
        transport.wait()
    finally:
        transport.close()
    return sent


def _received(url: str, tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    path = tmp_path / f"received-{url.rsplit(':', 1)[1]}.safetensors"
    answer = requests.post(url + "/dump_received", json={"path": str(path)}, timeout=120).json()
    return load_file(path), answer["arrivals"]


def _check(got: dict[str, torch.Tensor], arrivals: dict[str, int], sent: dict[str, torch.Tensor]) -> None:
    assert arrivals == {name: 1 for name in sent}
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_cpu_payloads_open_with_sglang_deserializer_every_byte(tmp_path) -> None:
    with sglang_receiver_process() as url:
        sent = _push([url], "cpu", buckets=4)
        _check(*_received(url, tmp_path), sent)


def test_rank_devices_must_name_one_device_per_engine_rank() -> None:
    with pytest.raises(ValueError, match="rank_devices names 1 devices for 2 engine ranks"):
        TensorTransport([], api_key=None, weight_version="1", receiver=SGLangReceiver(), ranks_per_engine=2,
                        rank_devices=["cpu"])  # fmt: skip


@pytest.mark.gpu
def test_cuda_ipc_one_payload_per_engine_rank_with_the_gpu_uuid(tmp_path) -> None:
    """Two engine TP ranks (two processes) each open their own element of the list with SGLang's code."""
    from mcore_rl.resharding.sync.transports.tensor import encode_cuda

    uuid = str(torch.cuda.get_device_properties(0).uuid)
    payload = encode_cuda({"flattened_tensor": torch.zeros(8, dtype=torch.uint8, device="cuda:0"), "metadata": []})
    assert uuid.encode() in base64.b64decode(payload)  # the device travels as the GPU's UUID, as SGLang writes it
    with sglang_receiver_process(tp_rank=0) as rank0, sglang_receiver_process(tp_rank=1) as rank1:
        # each URL stands for one rank of the same engine: rank r reads element r of serialized_named_tensors
        sent = _push([rank0, rank1], "cuda:0", buckets=4, ranks_per_engine=2)
        for url in (rank0, rank1):
            _check(*_received(url, tmp_path), {n: t for n, t in sent.items()})


@pytest.mark.gpu
def test_cuda_ipc_buffer_is_not_repacked_while_the_engine_may_read_it(tmp_path) -> None:
    """The receiver answers first and copies 2 s later, after bucket k + 2 was packed into bucket k's buffer: it must
    still read bucket k (the transport shares a private copy that torch keeps until the receiver releases it)."""
    with sglang_receiver_process(defer_copy_s=2.0) as url:
        sent = _push([url], "cuda:0", buckets=6)
        _check(*_received(url, tmp_path), sent)
