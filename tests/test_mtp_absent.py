"""A DeepSeek-V3 checkpoint whose config.json asks for MTP layers but holds none (what transformers' save_pretrained
writes: it keeps num_nextn_predict_layers and drops the layer) converts, loads into the actor and exports back with
MTP off, said once; a checkpoint holding part of an MTP layer is still refused, naming the missing tensors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _parity import DEEPSEEK_TINY
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
CONVERT = str(REPO / "tools" / "convert_checkpoint.py")


@pytest.fixture(scope="module")
def no_mtp(tmp_path_factory) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = tmp_path_factory.mktemp("dsv3")
    torch.manual_seed(0)
    config = DeepseekV3Config(**{**DEEPSEEK_TINY, "num_nextn_predict_layers": 1})
    DeepseekV3ForCausalLM(config).save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    return path


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CONVERT, *args, "--nproc", "1"], capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def test_resolve_mtp_modes() -> None:
    from mcore_rl.models.deepseek_v3 import resolve_mtp

    config = {**DEEPSEEK_TINY, "model_type": "deepseek_v3", "num_nextn_predict_layers": 1}
    layers = DEEPSEEK_TINY["num_hidden_layers"]
    none, some = {"model.embed_tokens.weight"}, {f"model.layers.{layers}.enorm.weight"}
    off, note, unread = resolve_mtp(config, none, "auto")
    assert off["num_nextn_predict_layers"] == 0 and "holds none of their weights" in note and unread
    assert resolve_mtp(config, some, "auto") == (config, None, ())  # on: the loaders name what is missing
    assert resolve_mtp(config, none, "on") == (config, None, ())
    assert resolve_mtp(config, some, "off")[0]["num_nextn_predict_layers"] == 0


@pytest.mark.long
@pytest.mark.slow
def test_mtp_less_checkpoint_converts_and_exports_back(no_mtp, tmp_path) -> None:
    res = _convert("hf-to-mcore", "--hf", str(no_mtp), "--out", str(tmp_path / "mcore"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert (res.stdout + res.stderr).count("MTP off") == 1
    back = _convert("mcore-to-hf", "--mcore", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf"))
    assert back.returncode == 0, back.stderr[-3000:]
    original, exported = _tensors(no_mtp), _tensors(tmp_path / "hf")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_partial_mtp_layer_is_refused_naming_the_missing_tensors(no_mtp, tmp_path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((no_mtp / "config.json").read_text())
    tensors = _tensors(no_mtp)
    hidden, layers = DEEPSEEK_TINY["hidden_size"], DEEPSEEK_TINY["num_hidden_layers"]
    tensors[f"model.layers.{layers}.enorm.weight"] = torch.ones(hidden)
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    res = _convert("hf-to-mcore", "--hf", str(partial), "--out", str(tmp_path / "out"))
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"model.layers.{layers}.hnorm.weight" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()

    from mcore_rl.config import ConfigError
    from mcore_rl.preflight import check_checkpoint

    with pytest.raises(ConfigError, match=f"HF tensor 'model.layers.{layers}.eh_proj.weight' is missing"):
        check_checkpoint(str(partial), 64)


def _actor_export(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, ModelConfig
    from mcore_rl.resharding.weight_map import export_hf_weights

    actor = MegatronActor(rank, world, ModelConfig(path=path), ActorConfig(world_size=1, use_ref=False))
    actor.initialize(("127.0.0.1", 0))  # the harness already started torch.distributed
    exported = export_hf_weights(actor.chunks, actor.contexts, actor.weight_map, actor.pg.tp, actor.pg.expt_tp)
    return {name: t.clone() for name, t in exported}


@pytest.mark.long
@pytest.mark.slow
def test_mtp_less_checkpoint_loads_into_the_actor(no_mtp, capfd) -> None:
    from mcore_rl.parallel.harness import run_on_ranks
    from mcore_rl.preflight import check_checkpoint

    check_checkpoint(str(no_mtp), 64)  # the driver's pre-flight accepts it and says so once
    assert capfd.readouterr().out.count("MTP off") == 1
    (exported,) = run_on_ranks(_actor_export, 1, (str(no_mtp),))
    original = _tensors(no_mtp)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
