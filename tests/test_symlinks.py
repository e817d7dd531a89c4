"""Checkpoint, tokenizer and model directories that symlink out of their tree, as an adversary or a careless user
leaves them. A symlinked directory (an HF cache snapshot, a checkpoint on another disk) is followed, and so is a file
linked to a regular file elsewhere (the cache's blobs). A link to a FIFO, a device or a directory where a file belongs,
a dangling link and a loop are refused, naming the path and what was expected (exit 2 from the CLI, HTTP 400 from the
server), never read (a FIFO blocks, /dev/zero never ends). The checkpoint writer never writes through a link, and
resume never follows `latest` (or a step directory) out of the run's checkpoints.

Run: `.venv/bin/pytest tests/test_symlinks.py`
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mcore_rl.checkpoint import store
from mcore_rl.checkpoint.manager import check_resume
from mcore_rl.config import ConfigError, RLConfig
from mcore_rl.resharding.hf_io import CheckpointError, HFCheckpointReader
from mcore_rl.rollout.weight_receiver import NOT_A_MODEL_DIRECTORY, WeightUpdateError, read_safetensors_dir

REPO = Path(__file__).resolve().parents[1]
#: where a bad link points (made by `bad_target`), and the words the refusal uses for it
BAD_TARGETS = {
    "fifo": "is a FIFO; expected a regular file",
    "device": "is a character device; expected a regular file",
    "directory": "is a directory; expected a regular file",
    "dangling": "which is not there (No such file or directory); expected a regular file",
    "loop": "which is a loop of symbolic links; expected a regular file",
}


def bad_link(link: Path, kind: str, tmp_path: Path) -> None:
    """Make `link` (replacing a file there) a symbolic link of `kind` (BAD_TARGETS)."""
    link.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(tmp_path / "a_fifo")
        os.symlink(tmp_path / "a_fifo", link)
    elif kind == "device":
        os.symlink("/dev/zero", link)
    elif kind == "directory":
        os.symlink("/etc", link)
    elif kind == "dangling":
        os.symlink(tmp_path / "nothing_here", link)
    else:
        os.symlink(link.name, link)  # itself


def tiny_model_dir(path: Path) -> Path:
    """An HF-shaped directory (config.json, model.safetensors) light enough for the reader and the disk update."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    save_file({"lm_head.weight": torch.ones(2, 3)}, path / "model.safetensors")
    return path


# ------------------------------------------------------------------------------------------------ model.path
def test_a_symlinked_model_dir_and_files_linked_to_blobs_are_followed(tmp_path) -> None:
    """HF's cache: snapshots/<rev> -> files linked to ../../blobs/<hash>, and users link the snapshot elsewhere."""
    blobs = tiny_model_dir(tmp_path / "blobs")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.symlink(blobs / name, snapshot / name)
    os.symlink(snapshot, tmp_path / "my_model")
    with HFCheckpointReader(tmp_path / "my_model") as reader:
        assert reader.names() == ["lm_head.weight"]
    assert [name for name, _ in read_safetensors_dir(str(tmp_path / "my_model"))] == ["lm_head.weight"]


@pytest.mark.parametrize("kind", sorted(BAD_TARGETS))
def test_model_safetensors_linked_to_a_non_file_is_named(kind: str, tmp_path) -> None:
    model = tiny_model_dir(tmp_path / "model")
    bad_link(model / "model.safetensors", kind, tmp_path)
    with pytest.raises(CheckpointError) as err:
        HFCheckpointReader(model)
    assert str(err.value).startswith(f"{model / 'model.safetensors'}") and BAD_TARGETS[kind] in str(err.value)


def test_any_file_of_the_model_dir_linked_to_a_device_is_named(tmp_path) -> None:
    """generation_config.json -> /dev/zero passed pre-flight and the run started Ray."""
    model = tiny_model_dir(tmp_path / "model")
    os.symlink("/dev/zero", model / "generation_config.json")
    with pytest.raises(CheckpointError, match="generation_config.json .a symbolic link to '/dev/zero'. is a character"):
        HFCheckpointReader(model)


def _train(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mcore_rl.train", *overrides],
                          capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip


def test_cli_names_a_config_json_linked_to_dev_zero_exit_2(tmp_path) -> None:
    """It said `config.json does not exist`."""
    model = tiny_model_dir(tmp_path / "model")
    bad_link(model / "config.json", "device", tmp_path)
    res = _train(f"model.path={model}", f"trainer.run_dir={tmp_path}/run")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"{model / 'config.json'} (a symbolic link to '/dev/zero') is a character device" in res.stderr


def test_cli_names_model_safetensors_linked_to_a_fifo_exit_2(tmp_path) -> None:
    """It said `neither model.safetensors.index.json nor model.safetensors found`."""
    from tiny_models import tiny_qwen3_moe_transformers

    model = tiny_model_dir(tmp_path / "model")
    tiny_qwen3_moe_transformers(vocab_size=63, eos_token_id=2, pad_token_id=0).save_pretrained(model)  # config.json
    bad_link(model / "model.safetensors", "fifo", tmp_path)
    res = _train(f"model.path={model}", f"trainer.run_dir={tmp_path}/run")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"{model / 'model.safetensors'} (a symbolic link to " in res.stderr and "is a FIFO" in res.stderr


@pytest.mark.parametrize("kind", ["directory", "dangling", "loop", "device"])
def test_update_weights_from_disk_refuses_bad_links_with_its_one_answer(kind: str, tmp_path) -> None:
    """The server answers every path that is not a model directory alike (no oracle: test_server_input), a 400."""
    model = tiny_model_dir(tmp_path / "model")
    bad_link(model / "model.safetensors", kind, tmp_path)
    with pytest.raises(WeightUpdateError, match=NOT_A_MODEL_DIRECTORY):
        read_safetensors_dir(str(model))
    os.symlink(tmp_path / "nothing", tmp_path / "dangling_dir")
    with pytest.raises(WeightUpdateError, match=NOT_A_MODEL_DIRECTORY):
        read_safetensors_dir(str(tmp_path / "dangling_dir"))


# ------------------------------------------------------------------------------------------------ model.tokenizer
def _tokenizer_cfg(tokenizer: Path) -> RLConfig:
    cfg = RLConfig()
    cfg.model.tokenizer = str(tokenizer)
    return cfg


def test_a_symlinked_tokenizer_dir_is_followed(tmp_path) -> None:
    from mcore_rl.data.tokenizer import build_tiny_tokenizer
    from mcore_rl.preflight import check_tokenizer

    build_tiny_tokenizer(str(tmp_path / "tok"))
    os.symlink(tmp_path / "tok", tmp_path / "linked")
    check_tokenizer(_tokenizer_cfg(tmp_path / "linked"))  # raises on a problem


@pytest.mark.parametrize("kind", sorted(BAD_TARGETS))
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_files_linked_to_a_non_file_are_named(name: str, kind: str, tmp_path) -> None:
    """transformers' message was about slow tokenizers and sentencepiece; tokenizer_config.json -> a FIFO passed."""
    from mcore_rl.data.tokenizer import build_tiny_tokenizer
    from mcore_rl.preflight import check_tokenizer

    build_tiny_tokenizer(str(tmp_path / "tok"))
    bad_link(tmp_path / "tok" / name, kind, tmp_path)
    with pytest.raises(ConfigError) as err:
        check_tokenizer(_tokenizer_cfg(tmp_path / "tok"))
    assert f"model.tokenizer='{tmp_path / 'tok'}': {tmp_path / 'tok' / name}" in str(err.value)
    assert BAD_TARGETS[kind] in str(err.value)


def test_a_dangling_tokenizer_dir_link_is_named(tmp_path) -> None:
    from mcore_rl.preflight import check_tokenizer

    os.symlink(tmp_path / "gone", tmp_path / "tok")
    with pytest.raises(ConfigError, match=r"tok is a symbolic link to .*gone', which is not there .*expected a direc"):
        check_tokenizer(_tokenizer_cfg(tmp_path / "tok"))


# ------------------------------------------------------------------------------------------------ checkpoints
def _root(tmp_path: Path) -> Path:
    root = tmp_path / "run" / store.ROOT_NAME
    root.mkdir(parents=True)
    return root


def _other_runs_checkpoint(tmp_path: Path) -> Path:
    step = tmp_path / "other_run" / store.ROOT_NAME / "step_00000005"
    step.mkdir(parents=True)
    (step / store.META).write_text("{}")
    return step


def test_latest_linked_to_a_foreign_file_is_refused_without_showing_it(tmp_path) -> None:
    """`latest` -> /etc/passwd: the error quoted the whole file."""
    root = _root(tmp_path)
    os.symlink("/etc/passwd", root / store.LATEST)
    with pytest.raises(store.CheckpointError, match="latest is a symbolic link to '/etc/passwd'") as err:
        store.latest(root)
    assert "root:" not in str(err.value)


@pytest.mark.parametrize("kind", ["fifo", "device", "dangling", "loop"])
def test_latest_linked_to_a_non_file_is_refused_not_ignored(kind: str, tmp_path) -> None:
    """Such a `latest` was ignored: trainer.resume=auto said there was no checkpoint and started a new run."""
    root = _root(tmp_path)
    bad_link(root / store.LATEST, kind, tmp_path)
    with pytest.raises(store.CheckpointError, match="`latest` is a regular file a save writes"):
        store.latest(root)


def test_latest_naming_a_path_out_of_the_checkpoints_is_refused(tmp_path) -> None:
    root = _root(tmp_path)
    _other_runs_checkpoint(tmp_path)
    (root / store.LATEST).write_text("../../other_run/checkpoints/step_00000005\n")
    with pytest.raises(store.CheckpointError, match="expected a checkpoint name such as step_00000040"):
        store.latest(root)


@pytest.mark.parametrize("with_latest", [True, False])
def test_a_step_dir_linked_out_of_the_checkpoints_is_not_resumed(with_latest: bool, tmp_path) -> None:
    root = _root(tmp_path)
    os.symlink(_other_runs_checkpoint(tmp_path), root / "step_00000005")
    if with_latest:
        (root / store.LATEST).write_text("step_00000005\n")
    with pytest.raises(store.CheckpointError, match="step_00000005 is a symbolic link to .*resume does not follow"):
        store.latest(root)


def test_an_explicit_resume_dir_that_is_a_link_is_followed(tmp_path) -> None:
    step = _other_runs_checkpoint(tmp_path)
    os.symlink(step, tmp_path / "linked_step")
    os.symlink(step.parent, tmp_path / "linked_root")
    assert store.resolve(str(tmp_path / "linked_step"), _root(tmp_path)) == tmp_path / "linked_step"
    assert store.resolve(str(tmp_path / "linked_root"), tmp_path / "run" / "unused") == tmp_path / "linked_root" / (
        "step_00000005"
    )


@pytest.mark.parametrize("resume", ["auto", None])
def test_a_checkpoints_dir_linked_elsewhere_is_refused(resume: str | None, tmp_path) -> None:
    """A run dir copied with its links: resume=auto resumed another run, and the saves and pruning went into it."""
    _other_runs_checkpoint(tmp_path)
    (tmp_path / "run").mkdir()
    os.symlink(tmp_path / "other_run" / store.ROOT_NAME, tmp_path / "run" / store.ROOT_NAME)
    cfg = RLConfig()
    cfg.trainer.run_dir, cfg.trainer.resume, cfg.trainer.save_every = str(tmp_path / "run"), resume, 1
    with pytest.raises(store.CheckpointError, match="checkpoints is a symbolic link to .*in a directory of its own"):
        check_resume(cfg)


@pytest.mark.parametrize("kind", ["fifo", "device", "dangling", "loop"])
def test_a_checkpoint_file_linked_to_a_non_file_is_named_before_any_rank_reads_it(kind: str, tmp_path) -> None:
    step = _root(tmp_path) / "step_00000003"
    (step / "model").mkdir(parents=True)
    (step / store.META).write_text(json.dumps({"format": store.FORMAT, "version": store.VERSION}))
    bad_link(step / "model" / ".metadata", kind, tmp_path)
    with pytest.raises(store.CheckpointError) as err:
        store.read_meta(step)
    assert str(err.value).startswith(str(step / "model" / ".metadata")) and BAD_TARGETS[kind] in str(err.value)


def test_publish_never_writes_latest_through_a_link_left_in_its_place(tmp_path) -> None:
    """The new `latest` is written to .tmp-latest-<pid> first: a link there made the save truncate its target."""
    root = _root(tmp_path)
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    os.symlink(precious, root / f"{store.TMP_PREFIX}{store.LATEST}-{os.getpid()}")
    tmp = root / ".tmp-step_00000001-x"
    tmp.mkdir()
    (tmp / store.META).write_text("{}")
    store.publish(tmp, root, 1)
    assert precious.read_text() == "keep me\n"
    assert (root / store.LATEST).read_text() == "step_00000001\n" and not (root / store.LATEST).is_symlink()


def test_prune_never_removes_through_a_link(tmp_path) -> None:
    root = _root(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "keep").mkdir(parents=True)
    os.symlink(elsewhere, root / ".tmp-step_00000002-y")
    (root / "step_00000003").mkdir()
    assert store.prune(root, keep_last=1, keep=root / "step_00000003") == []
    assert (elsewhere / "keep").is_dir()
