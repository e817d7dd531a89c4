"""tools/convert_checkpoint.py refuses bad input with exit status 2, names the file or tensor, and leaves no output.

    .venv/bin/pytest -q tests/test_convert_errors.py

Most checks run in the parent before any worker starts (config, inventory, dtypes, layout, output directory); a
missing or misshapen tensor, a truncated chunk file or a checkpoint that disagrees with config.json is found by the
worker that reads it and reported the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _parity import hf_state

from mcore_rl.resharding.hf_io import HFCheckpointWriter

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import convert_checkpoint  # noqa: E402


@pytest.fixture()
def llama(tmp_path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    path = tmp_path / "llama"
    LlamaForCausalLM(config).float().save_pretrained(path)
    return path


def _rewrite(path: Path, change) -> None:
    """Rewrite the checkpoint's tensors through `change(state)` (one shard, config kept)."""
    state, config = hf_state(path), json.loads((path / "config.json").read_text())
    change(state)
    with HFCheckpointWriter(path, overwrite=True) as writer:
        for name, t in state.items():
            writer.add(name, t)
        writer.write_config(config)


def _fails(capsys: pytest.CaptureFixture, *argv, match: str) -> None:
    assert convert_checkpoint.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert match in err, err


def test_unsupported_model_type_lists_supported(llama: Path, tmp_path: Path, capsys) -> None:
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps(dict(config, model_type="gpt_bigcode")))
    _fails(capsys, "hf-to-mcore", "--hf", llama, "--out", tmp_path / "o", match="supported: deepseek_v3, llama, qwen2")


def test_existing_output_directory_refused(llama: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "o").mkdir()
    _fails(capsys, "hf-to-mcore", "--hf", llama, "--out", tmp_path / "o", match="exists")


@pytest.mark.parametrize("target", ["dir", "missing"])
def test_symlinked_output_refused_up_front_even_with_overwrite(llama: Path, tmp_path: Path, target: str) -> None:
    """A symlinked --out used to be written in full, then fail in the rename ("Cannot call rmtree on a symbolic link")
    and leave <out>.old-<pid> beside the link: refused before anything is written, the link and its target kept."""
    real = tmp_path / "real"
    if target == "dir":
        real.mkdir()
        (real / "keep.txt").write_text("kept")
    link = tmp_path / "link_out"
    link.symlink_to(real)
    before = sorted(p.name for p in tmp_path.iterdir())
    done = subprocess.run(
        [sys.executable, str(TOOLS / "convert_checkpoint.py"), "hf-to-mcore", "--hf", str(llama), "--out", str(link),
         "--overwrite", "--nproc", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"--out {link} is a symbolic link" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no <out>.old-<pid>, no <out>.tmp-<pid>
    assert link.is_symlink() and (target == "missing" or (real / "keep.txt").read_text() == "kept")
    assert target == "dir" or not real.exists()


def test_truncated_file_named(llama: Path, tmp_path: Path, capsys) -> None:
    shard = llama / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    _fails(capsys, "hf-to-mcore", "--hf", llama, "--out", tmp_path / "o", match="model.safetensors: tensor")


def test_unexpected_tensor_named(llama: Path, tmp_path: Path, capsys) -> None:
    _rewrite(llama, lambda s: s.__setitem__("model.layers.7.mlp.gate_proj.weight", torch.zeros(2, 2)))
    _fails(capsys, "hf-to-mcore", "--hf", llama, "--out", tmp_path / "o", match="model.layers.7.mlp.gate_proj.weight")


def test_dtype_disagreeing_with_config_named(llama: Path, tmp_path: Path, capsys) -> None:
    _rewrite(llama, lambda s: s.__setitem__("model.norm.weight", s["model.norm.weight"].half()))
    _fails(capsys, "hf-to-mcore", "--hf", llama, "--out", tmp_path / "o", match="model.norm.weight")


def test_layout_that_does_not_divide_the_model(llama: Path, tmp_path: Path, capsys) -> None:
    _fails(capsys, "hf-to-mcore", "--hf", llama, "--out", tmp_path / "o", "--tp", 3, match="not divisible by tp=3")
    _fails(capsys, "hf-to-mcore", "--hf", llama, "--out", tmp_path / "o", "--ep", 2, match="no experts")


def test_not_an_mcore_checkpoint(llama: Path, tmp_path: Path, capsys) -> None:
    _fails(capsys, "mcore-to-hf", "--mcore", llama, "--out", tmp_path / "o", match="metadata.json: missing")


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_missing_and_misshapen_tensors_found_by_ranks_leave_no_output(llama: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "o"
    _rewrite(llama, lambda s: s.pop("model.layers.1.mlp.down_proj.weight"))
    _fails(capsys, "hf-to-mcore", "--hf", llama, "--out", out, match="'model.layers.1.mlp.down_proj.weight' is missing")
    assert not out.exists() and not list(tmp_path.glob("o.tmp-*"))
    _rewrite(llama, lambda s: s.__setitem__("model.layers.1.mlp.down_proj.weight", torch.zeros(16, 16)))
    _fails(capsys, "hf-to-mcore", "--hf", llama, "--out", out, match="model.layers.1.mlp.down_proj.weight")
    assert not out.exists() and not list(tmp_path.glob("o.tmp-*"))


def test_cli_help_and_exit_status(llama: Path, tmp_path: Path) -> None:
    script = str(TOOLS / "convert_checkpoint.py")
    done = subprocess.run([sys.executable, script, "hf-to-mcore", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--ep" in done.stdout and "--nproc" in done.stdout
    (tmp_path / "o").mkdir()
    done = subprocess.run(
        [sys.executable, script, "hf-to-mcore", "--hf", str(llama), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "exists" in done.stderr


@pytest.fixture()
def llama_mcore(llama: Path, tmp_path: Path) -> Path:
    out = tmp_path / "llama-mcore"
    assert convert_checkpoint.main(["hf-to-mcore", "--hf", str(llama), "--out", str(out), "--nproc", "2"]) == 0
    return out


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_truncated_chunk_file_named(llama_mcore: Path, tmp_path: Path, capsys) -> None:
    part = sorted(llama_mcore.glob("__*_0.distcp"))[-1]
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    _fails(capsys, "mcore-to-hf", "--mcore", llama_mcore, "--out", tmp_path / "o", match=f"{part}: truncated")
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("o.tmp-*"))


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_missing_torch_dist_metadata_named(llama_mcore: Path, tmp_path: Path, capsys) -> None:
    (llama_mcore / ".metadata").unlink()
    _fails(capsys, "mcore-to-hf", "--mcore", llama_mcore, "--out", tmp_path / "o", match=".metadata: missing")


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_checkpoint_disagreeing_with_config_named(llama_mcore: Path, tmp_path: Path, capsys) -> None:
    config_path = llama_mcore / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config["intermediate_size"] = 48
    config_path.write_text(json.dumps(config))
    _fails(capsys, "mcore-to-hf", "--mcore", llama_mcore, "--out", tmp_path / "o", match="(config.json) expects")
    config["intermediate_size"], config["num_hidden_layers"] = 32, 1
    config_path.write_text(json.dumps(config))
    # Megatron stacks the layers of a homogeneous decoder along a leading axis: 2 layers saved, 1 expected
    out = tmp_path / "o"
    # (which stacked tensor is named first is not fixed: any of them shows the 2-vs-1 layer axis)
    _fails(capsys, "mcore-to-hf", "--mcore", llama_mcore, "--out", out, match="has shape (2, 16")


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_killed_conversion_leaves_no_output_directory(llama: Path, tmp_path: Path) -> None:
    """SIGKILL while the workers run: the output path never appears (only <out>.tmp-<pid> is left behind)."""
    import os
    import signal
    import time

    out = tmp_path / "o"
    proc = subprocess.Popen(
        [sys.executable, str(TOOLS / "convert_checkpoint.py"), "hf-to-mcore", "--hf", str(llama), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("o.tmp-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert list(tmp_path.glob("o.tmp-*")), "the conversion never created its temporary directory"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()


def test_uneven_pipeline_stages_checked_against_the_model(llama: Path, tmp_path: Path, capsys) -> None:
    """--first-stage-layers / --last-stage-layers are validated like Megatron's (2 layers: 1 + 1 fits pp=2)."""
    _fails(capsys, "hf-to-mcore", "--hf", llama, "--out", tmp_path / "o", "--pp", 2, "--first-stage-layers", 2,
           match="first_stage_layers=2")  # fmt: skip
    out = tmp_path / "ok"
    assert convert_checkpoint.main(["hf-to-mcore", "--hf", str(llama), "--out", str(out), "--pp", "2",
                                    "--first-stage-layers", "1", "--nproc", "1"]) == 0  # fmt: skip
    assert json.loads((out / convert_checkpoint.LAYOUT_FILE).read_text())["layout"]["first_stage_layers"] == 1


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_checkpoint_without_its_hf_config_needs_hf_config(llama: Path, llama_mcore: Path, tmp_path: Path, capsys):
    """A torch_dist checkpoint hf-to-mcore did not write (no hf/, no layout file) is refused with a pointer to
    --hf-config; with it, and the HF directory of another vocabulary, the embedding's rows are named."""
    import shutil

    shutil.rmtree(llama_mcore / "hf")
    (llama_mcore / convert_checkpoint.LAYOUT_FILE).unlink()
    _fails(capsys, "mcore-to-hf", "--mcore", llama_mcore, "--out", tmp_path / "o", match="--hf-config")
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((llama / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, vocab_size=1000)))
    argv = ("mcore-to-hf", "--mcore", llama_mcore, "--out", tmp_path / "o", "--hf-config", other)
    _fails(capsys, *argv, match="the embedding has 128 rows")
    _fails(capsys, *argv[:-1], tmp_path / "nowhere", match="nowhere/config.json: missing")
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("o.tmp-*"))


def test_unreadable_iteration_tracker_named(tmp_path: Path, capsys) -> None:
    save = tmp_path / "save"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("soon\n")
    _fails(capsys, "mcore-to-hf", "--mcore", save, "--out", tmp_path / "o", match="expected an iteration number")
