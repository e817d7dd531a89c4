"""The checkpoint pre-flight remembers a checkpoint it passed (mcore_rl/preflight_cache.py): the same checkpoint is not
checked again by a child process, and anything that could change the answer (a rewritten file, another argument, a
refusal) runs the child again, which refuses with its message as before."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_qwen3_moe_checkpoint

from mcore_rl import preflight, preflight_cache
from mcore_rl.config import ConfigError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_qwen3_moe_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(preflight_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "checkpoint_check"


@pytest.fixture
def children(monkeypatch) -> list:
    """The checkpoint children pre-flight starts."""
    started = []
    real_start = preflight.start_checkpoint_check
    monkeypatch.setattr(preflight, "start_checkpoint_check", lambda *a: started.append(real_start(*a)) or started[-1])
    return started


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def test_a_checkpoint_that_passed_is_not_checked_again(checkpoint, tmp_path, cache, children) -> None:
    ckpt = _copy(checkpoint, tmp_path / "ckpt")
    preflight.check_checkpoint(str(ckpt), 64)
    assert len(children) == 1 and len(list(cache.glob("*.json"))) == 1
    preflight.check_checkpoint(str(ckpt), 64)
    assert len(children) == 1  # remembered: no second child


# long: a child per check (about 8 s each under CI's load); the CI tier keeps the divisor in the key through
# test_the_key_covers_headers_json_and_entries_and_refuses_odd_files, and a second child through the rewritten test
@pytest.mark.long
def test_another_divisor_is_checked_again(checkpoint, tmp_path, cache, children) -> None:
    ckpt = _copy(checkpoint, tmp_path / "ckpt")
    preflight.check_checkpoint(str(ckpt), 64)
    preflight.check_checkpoint(str(ckpt), 32)
    assert len(children) == 2


def test_a_checkpoint_rewritten_after_it_passed_is_checked_and_refused(checkpoint, tmp_path, cache, children) -> None:
    ckpt = _copy(checkpoint, tmp_path / "ckpt")
    preflight.check_checkpoint(str(ckpt), 64)
    wrong = "model.layers.0.self_attn.o_proj.weight"
    tensors = load_file(ckpt / "model.safetensors")
    tensors[wrong] = torch.zeros(3, 5)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"tensor {wrong} has shape \\[3, 5\\]"):
        preflight.check_checkpoint(str(ckpt), 64)
    assert len(children) == 2


# The long tier: two child checks (about 17 s in CI); the refusal path is also the CI tier's rewritten-checkpoint test
# above, and the record writer is reached only on a pass (preflight.finish_checkpoint_check).
@pytest.mark.long
def test_a_refusal_is_not_remembered(checkpoint, tmp_path, cache, children) -> None:
    ckpt = _copy(checkpoint, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "hidden_size": str(config["hidden_size"])}))
    for _ in range(2):
        with pytest.raises(ConfigError, match="config.json cannot be built"):
            preflight.check_checkpoint(str(ckpt), 64)
    assert len(children) == 2 and not list(cache.glob("*.json"))


def test_the_key_covers_headers_json_and_entries_and_refuses_odd_files(checkpoint, tmp_path, cache) -> None:
    """No child here: the key alone (the cheap part), for each kind of change."""
    ckpt = _copy(checkpoint, tmp_path / "ckpt")
    key = preflight_cache.checkpoint_key(str(ckpt), 64, "auto")
    assert key is not None and key == preflight_cache.checkpoint_key(str(ckpt), 64, "auto")
    assert key != preflight_cache.checkpoint_key(str(ckpt), 64, "off")
    assert key != preflight_cache.checkpoint_key(str(ckpt), 32, "auto")  # the divisor pads the vocabulary's shape
    config = ckpt / "config.json"
    config.write_text(config.read_text() + " ")
    assert preflight_cache.checkpoint_key(str(ckpt), 64, "auto") not in (None, key)
    key = preflight_cache.checkpoint_key(str(ckpt), 64, "auto")
    (ckpt / "extra.safetensors").write_bytes(b"\x01")  # too short to hold a header length
    assert preflight_cache.checkpoint_key(str(ckpt), 64, "auto") is None
    (ckpt / "extra.safetensors").unlink()
    (ckpt / "notes.txt").write_text("x")
    assert preflight_cache.checkpoint_key(str(ckpt), 64, "auto") not in (None, key)


# long: two children; the CI tier keeps an unusable record skipped through test_a_damaged_record_is_a_miss
@pytest.mark.long
def test_a_cache_that_cannot_be_written_is_skipped(checkpoint, tmp_path, monkeypatch, children) -> None:
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv(preflight_cache.CACHE_DIR_ENV, str(tmp_path / "file"))
    preflight.check_checkpoint(str(checkpoint), 64)  # passes; nothing remembered, no error
    preflight.check_checkpoint(str(checkpoint), 64)
    assert len(children) == 2


def test_a_damaged_record_is_a_miss(tmp_path, cache) -> None:
    cache.mkdir(parents=True)
    (cache / "abc.json").write_text("{not json")
    assert preflight_cache.passed("abc") is preflight_cache.MISS
    (cache / "abc.json").write_text(json.dumps({"key": "other", "note": None}))
    assert preflight_cache.passed("abc") is preflight_cache.MISS
    source = tmp_path / "weight_map.py"
    source.write_text("A = 1\n")
    preflight_cache.remember("abc", "MTP off", [str(source)])
    assert preflight_cache.passed("abc") == "MTP off"


def test_a_record_whose_code_changed_is_a_miss(tmp_path, cache) -> None:
    """The record keeps the sha256 of the mcore_rl files the child ran (mapped folders such as parallel/ included)."""
    source = tmp_path / "weight_map.py"
    source.write_text("A = 1\n")
    preflight_cache.remember("abc", None, [str(source)])
    assert preflight_cache.passed("abc") is None
    source.write_text("A = 2\n")
    assert preflight_cache.passed("abc") is preflight_cache.MISS
    source.unlink()
    assert preflight_cache.passed("abc") is preflight_cache.MISS


def test_the_child_names_the_code_it_ran(checkpoint, tmp_path, cache) -> None:
    ckpt = _copy(checkpoint, tmp_path / "ckpt")
    preflight.check_checkpoint(str(ckpt), 64)
    (record,) = [json.loads(p.read_text()) for p in cache.glob("*.json")]
    names = {Path(f).name for f in record["sources"]}
    assert {"preflight.py", "groups.py", "builder.py"} <= names, sorted(names)


def test_only_the_newest_records_are_kept(tmp_path, cache, monkeypatch) -> None:
    monkeypatch.setattr(preflight_cache, "MAX_RECORDS", 3)
    for i in range(5):
        preflight_cache.remember(f"k{i}", None, [])
        os.utime(cache / f"k{i}.json", ns=(i * 10**9, i * 10**9))  # distinct times even on a coarse clock
    preflight_cache.remember("k5", None, [])
    assert sorted(p.stem for p in cache.glob("*.json")) == ["k3", "k4", "k5"]
