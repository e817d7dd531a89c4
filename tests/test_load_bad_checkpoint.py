"""Loading an HF checkpoint into the Megatron actor: missing or unexpected tensors are named; the run exits non-zero.

A real transformers Qwen3-MoE checkpoint is written with save_pretrained, then damaged with safetensors itself.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ray_cluster import ray_address_override, train_env
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
        "rollout.max_new_tokens=2",  # the tiny checkpoint's 128 positions: the schema's 512 would not fit
        ray_address_override(),
    ]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=train_env())


@pytest.mark.long
@pytest.mark.slow
def test_missing_tensor_is_named_and_exits_nonzero(checkpoint, tmp_path):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    out = _train(_damaged(checkpoint, tmp_path / "ckpt", drop=name), tmp_path / "run")
    assert out.returncode != 0
    assert f"HF tensor '{name}' is missing" in out.stderr


@pytest.mark.long
@pytest.mark.slow
def test_unexpected_tensor_is_named_and_exits_nonzero(checkpoint, tmp_path):
    name = "model.layers.7.mlp.experts.0.gate_proj.weight"  # layer 7 does not exist in a 2-layer model
    out = _train(_damaged(checkpoint, tmp_path / "ckpt", add=name), tmp_path / "run")
    assert out.returncode != 0
    assert "unexpected tensors not in the qwen3_moe weight map" in out.stderr and name in out.stderr


@pytest.mark.long
@pytest.mark.slow
def test_intact_checkpoint_trains_one_step(checkpoint, tmp_path):
    out = _train(checkpoint, tmp_path / "run")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1


def _fp8_rank(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, ModelConfig

    actor = MegatronActor(rank, world, ModelConfig(path=path), ActorConfig(world_size=1, use_ref=False))
    actor.initialize(("127.0.0.1", 0))  # the harness already started torch.distributed
    from mcore_rl.resharding.weight_map import export_hf_weights

    exported = export_hf_weights(actor.chunks, actor.contexts, actor.weight_map, actor.pg.tp, actor.pg.expt_tp)
    return {name: t.clone() for name, t in exported}


def test_fp8_checkpoint_is_dequantized_on_load(checkpoint, tmp_path):
    import json

    from mcore_rl.kernels.fp8_blockwise import dequantize_blockwise, quantize_blockwise
    from mcore_rl.parallel.harness import run_on_ranks

    tensors = load_file(checkpoint / "model.safetensors")
    fp8, expected = {}, dict(tensors)
    for name, tensor in tensors.items():
        if name.endswith(("proj.weight",)):  # attention and expert projections, as DeepSeek's release quantises
            q, scale_inv = quantize_blockwise(tensor, (128, 128))
            fp8[name], fp8[name + "_scale_inv"] = q, scale_inv
            expected[name] = dequantize_blockwise(q, scale_inv, (128, 128), torch.float32)
        else:
            fp8[name] = tensor
    (tmp_path / "fp8").mkdir()
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    save_file(fp8, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})

    (exported,) = run_on_ranks(_fp8_rank, 1, (str(tmp_path / "fp8"),))
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert not torch.equal(expected[name], tensors[name]), "quantisation must change the weight"
    for name, value in expected.items():
        assert torch.equal(exported[name], value), name
