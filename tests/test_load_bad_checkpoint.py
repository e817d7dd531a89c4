"""Loading an HF checkpoint into the Megatron actor: missing or unexpected tensors are named; the run exits non-zero.

A real transformers Qwen3-MoE checkpoint is written with save_pretrained, then damaged with safetensors itself.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import tiny_qwen3_moe_transformers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import Qwen3MoeForCausalLM

    path = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(tiny_qwen3_moe_transformers(vocab_size=63, eos_token_id=2, pad_token_id=0)).save_pretrained(
        path
    )
    return path


def _damaged(src: Path, dst: Path, drop: str | None = None, add: str | None = None) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.zeros(3)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _train(path: Path, run_dir: Path) -> subprocess.CompletedProcess:
    args = [
        sys.executable,
        "-m",
        "mcore_rl.train",
        f"model.path={path}",
        "trainer.steps=1",
        f"trainer.run_dir={run_dir}",
        "data.batch_size=2",
        "rollout.n=2",
    ]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_missing_tensor_is_named_and_exits_nonzero(checkpoint, tmp_path):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    out = _train(_damaged(checkpoint, tmp_path / "ckpt", drop=name), tmp_path / "run")
    assert out.returncode != 0
    assert f"HF tensor '{name}' is missing" in out.stderr


@pytest.mark.slow
def test_unexpected_tensor_is_named_and_exits_nonzero(checkpoint, tmp_path):
    name = "model.layers.7.mlp.experts.0.gate_proj.weight"  # layer 7 does not exist in a 2-layer model
    out = _train(_damaged(checkpoint, tmp_path / "ckpt", add=name), tmp_path / "run")
    assert out.returncode != 0
    assert "unexpected tensors not in the qwen3_moe weight map" in out.stderr and name in out.stderr


@pytest.mark.slow
def test_intact_checkpoint_trains_one_step(checkpoint, tmp_path):
    out = _train(checkpoint, tmp_path / "run")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
