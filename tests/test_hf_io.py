"""Streaming safetensors I/O: round trips, sharding, atomic output directories, and errors that name the file.

.venv/bin/pytest -q tests/test_hf_io.py
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mcore_rl.resharding.hf_io import (
    INDEX_NAME,
    CheckpointError,
    HFCheckpointReader,
    HFCheckpointWriter,
    parse_size,
    prepare_output,
    publish,
    read_header,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(16, generator=g),
        "model.layers.0.w": torch.randn(40, 16, generator=g).to(torch.float8_e4m3fn),
        "model.layers.0.weight_scale_inv": torch.rand(1, 1, generator=g),
        "model.layers.0.flag": torch.tensor([True, False]),
        "model.layers.1.w": torch.randn(16, 40, generator=g).half(),
    }


def _write(out: Path, max_shard_bytes: int = 1000, **kw) -> Path:
    with HFCheckpointWriter(out, max_shard_bytes=max_shard_bytes, **kw) as writer:
        for name, t in _tensors().items():
            writer.add(name, t)
        writer.write_config({"model_type": "toy", "vocab_size": 64})
    return out


def test_writer_shards_and_reader_round_trip_bit_exact(tmp_path: Path) -> None:
    out = _write(tmp_path / "ckpt")
    index = json.loads((out / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _tensors().values())
    reader = HFCheckpointReader(out)
    assert reader.config["model_type"] == "toy"
    assert set(reader.names()) == set(_tensors())
    for name, t in _tensors().items():
        assert reader.shape(name) == tuple(t.shape) and reader.dtype(name) == t.dtype
        got = reader.read(name)
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    # The files are standard safetensors: the reference library reads them too.
    for file in files:
        with safe_open(str(out / file), "pt") as f:
            for name in f.keys():
                assert torch.equal(f.get_tensor(name).view(torch.uint8), _tensors()[name].view(torch.uint8))
    assert not list(tmp_path.glob("*.tmp-*"))


def test_reader_single_file_and_missing_name(tmp_path: Path) -> None:
    save_file({"a": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    reader = HFCheckpointReader(tmp_path)
    assert reader.names() == ["a"] and torch.equal(reader.read("a"), torch.ones(3))
    with pytest.raises(KeyError, match="missing_tensor"):
        reader.read("missing_tensor")


def test_truncated_and_corrupt_files_name_the_file(tmp_path: Path) -> None:
    out = _write(tmp_path / "ckpt", max_shard_bytes=10**9)
    shard = next(out.glob("model-*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=f"{shard.name}.*truncated"):
        HFCheckpointReader(out)
    shard.write_bytes(struct.pack("<Q", 10**12) + data[8:])
    with pytest.raises(CheckpointError, match=f"{shard.name}.*header length"):
        read_header(shard)
    shard.write_bytes(data[:8] + b"!" + data[9:])
    with pytest.raises(CheckpointError, match=f"{shard.name}.*not valid JSON"):
        HFCheckpointReader(out)
    shard.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="too short"):
        HFCheckpointReader(out)


def test_index_names_missing_from_file(tmp_path: Path) -> None:
    out = _write(tmp_path / "ckpt")
    index = json.loads((out / INDEX_NAME).read_text())
    first = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.ghost.weight"] = first
    (out / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.ghost\.weight.*listed in the index but not in the file"):
        HFCheckpointReader(out)
    index["weight_map"]["model.ghost.weight"] = "model-99999-of-99999.safetensors"
    (out / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-99999-of-99999.safetensors.*missing"):
        HFCheckpointReader(out)


def test_missing_config_or_weights(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        HFCheckpointReader(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="neither"):
        HFCheckpointReader(tmp_path)


def test_existing_output_refused_unless_overwrite(tmp_path: Path) -> None:
    out = _write(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="exists"):
        HFCheckpointWriter(out)
    (out / "stale.txt").write_text("old")
    _write(out, overwrite=True)
    assert not (out / "stale.txt").exists() and HFCheckpointReader(out).names()


def test_failed_write_leaves_no_output_directory(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with HFCheckpointWriter(out, max_shard_bytes=100) as writer:
            writer.add("a", torch.ones(100))
            writer.add("b", torch.ones(100))
            raise RuntimeError("killed")
    assert not out.exists() and not list(tmp_path.iterdir())


def test_side_files_are_copied(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "notes.md"):
        (src / name).write_text("{}")
    with HFCheckpointWriter(tmp_path / "out") as writer:
        writer.add("a", torch.ones(2))
        copied = writer.copy_side_files(src)
    assert copied == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("1024") == 1024
    assert parse_size("1.5MB") == 1_500_000
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size("five")


def test_several_writers_publish_one_checkpoint(tmp_path: Path) -> None:
    """Each rank writes its own parts into the shared temp dir; the coordinator numbers them and writes the index."""
    out = tmp_path / "ckpt"
    tmp = prepare_output(out)
    tensors = list(_tensors().items())
    parts = []
    for rank, chunk in enumerate((tensors[:3], tensors[3:])):
        writer = HFCheckpointWriter(out, max_shard_bytes=600, tmp_dir=tmp, part_prefix=f"rank{rank}-")
        for name, t in chunk:
            writer.add(name, t)
        parts += writer.finish()
    assert not out.exists()
    (tmp / "config.json").write_text("{}")
    publish(tmp, out, parts)
    reader = HFCheckpointReader(out)
    assert set(reader.names()) == set(_tensors()) and not tmp.exists()
    assert (
        sorted(p.name for p in out.glob("*.safetensors"))[-1]
        == f"model-{len(parts):05d}-of-{len(parts):05d}.safetensors"
    )


def test_reader_mappings_bounded_across_files(tmp_path: Path) -> None:
    """Mappings are dropped once `remap_bytes` were read through all files together, not per file."""
    out = _write(tmp_path / "ckpt", max_shard_bytes=300)
    reader = HFCheckpointReader(out, remap_bytes=1500)
    held = []
    for name in reader.names():
        held.append(reader.read(name))  # tensors outlive the handle that produced them
        assert reader._mapped_bytes < 1500
    assert len({str(reader.file_of(n)) for n in reader.names()}) > 2
    for name, t in zip(reader.names(), held):
        assert torch.equal(t.view(torch.uint8), _tensors()[name].view(torch.uint8))


def _layout() -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(name, t.dtype, tuple(t.shape)) for name, t in _tensors().items()]


def test_planned_layout_streams_the_same_files_as_buffered_writes(tmp_path: Path) -> None:
    """With the layout known up front nothing is buffered, and the files are byte-identical to buffered writing."""
    buffered = _write(tmp_path / "buffered")
    planned = tmp_path / "planned"
    with HFCheckpointWriter(planned, max_shard_bytes=1000, layout=_layout()) as writer:
        for name, t in _tensors().items():
            writer.add(name, t)
            assert not writer._pending  # streamed, not held
        writer.write_config({"model_type": "toy", "vocab_size": 64})
    files = sorted(p.name for p in buffered.iterdir())
    assert files == sorted(p.name for p in planned.iterdir()) and len(files) > 3
    for name in files:
        assert (buffered / name).read_bytes() == (planned / name).read_bytes(), name


def test_planned_layout_refuses_other_order_form_and_missing_tensors(tmp_path: Path) -> None:
    tensors = list(_tensors().items())
    writer = HFCheckpointWriter(tmp_path / "a", layout=_layout())
    with pytest.raises(CheckpointError, match="'model.norm.weight' added where the layout has 'model.embed"):
        writer.add(*tensors[1])
    writer.abort()
    writer = HFCheckpointWriter(tmp_path / "b", layout=_layout())
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight' is torch.float32 \(64, 16\), the layout"):
        writer.add(tensors[0][0], tensors[0][1].float())
    writer.abort()
    writer = HFCheckpointWriter(tmp_path / "c", layout=_layout())
    writer.add(*tensors[0])
    with pytest.raises(CheckpointError, match="5 tensor\\(s\\) of the layout never added, first 'model.norm.weight'"):
        writer.close()
    writer.abort()
    assert not any((tmp_path / name).exists() for name in "abc") and not list(tmp_path.iterdir())
