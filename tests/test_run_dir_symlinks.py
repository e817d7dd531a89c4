"""Files a run writes into trainer.run_dir are never written through a symbolic link: a symlinked metrics.jsonl or
tokenizer/ is refused (a ValueError naming the path: exit 2 in a run), and its target is left as it was.

Run: `.venv/bin/pytest tests/test_run_dir_symlinks.py`
"""

from __future__ import annotations

import os

import pytest

from mcore_rl.data.tokenizer import build_tiny_tokenizer
from mcore_rl.metrics.backends import JsonlBackend


def test_symlinked_metrics_jsonl_is_refused_and_its_target_kept(tmp_path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink(target, run_dir / "metrics.jsonl")
    with pytest.raises(ValueError, match=r"metrics.jsonl is a symbolic link; the run writes only regular files"):
        JsonlBackend(str(run_dir))
    assert target.read_text() == "keep me\n"


def test_metrics_jsonl_replaced_by_a_symlink_mid_run_is_not_followed(tmp_path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    backend = JsonlBackend(str(run_dir))
    backend.write(1, {"reward": 0.5})
    os.remove(run_dir / "metrics.jsonl")
    os.symlink(target, run_dir / "metrics.jsonl")
    with pytest.raises(OSError, match=r"metrics.jsonl"):
        backend.write(2, {"reward": 0.5})
    assert target.read_text() == "keep me\n"


def test_symlinked_tokenizer_dir_is_refused_and_its_target_kept(tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "tokenizer.json").write_text("precious")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink(elsewhere, run_dir / "tokenizer")
    with pytest.raises(ValueError, match=r"tokenizer is a symbolic link; the run writes only into directories"):
        build_tiny_tokenizer(str(run_dir / "tokenizer"))
    assert (elsewhere / "tokenizer.json").read_text() == "precious"
    assert sorted(os.listdir(elsewhere)) == ["tokenizer.json"]
