"""What a resume checks before anything starts: a torch_dist shard cut short, a loop_state.json
cut short, and a data position saved under another data.seed, data.shuffle or data files, each named with the file
and refused with exit 2 before Ray and the ranks start.

The shard and loop-state checks run on a real torch.distributed.checkpoint written by this process (no process
group: DCP's single-process mode); the end-to-end refusals start the real CLI on a checkpoint of a one-step run.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mcore_rl.checkpoint import store

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def dcp_dir(tmp_path) -> Path:
    folder = tmp_path / "optimizer"
    dcp.save({"exp_avg": torch.arange(4096.0), "step": torch.tensor(3)}, checkpoint_id=str(folder), no_dist=True)
    return folder


def test_an_intact_torch_dist_checkpoint_passes(dcp_dir) -> None:
    store.check_shard_sizes(dcp_dir / ".metadata")


def test_a_truncated_shard_is_named_before_start(dcp_dir) -> None:
    shard = max(dcp_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(store.CheckpointError, match=f"{shard}: .* bytes, but .* places data up to byte .* truncated"):
        store.check_shard_sizes(dcp_dir / ".metadata")
    shard.unlink()
    with pytest.raises(store.CheckpointError, match=f"{shard}: missing"):
        store.check_shard_sizes(dcp_dir / ".metadata")


def test_the_size_check_runs_no_code_from_the_index(dcp_dir, tmp_path) -> None:
    """The index is unpickled with an exact allow-list: a gadget is refused, naming the file, and never run."""
    marker = tmp_path / "ran"

    class Gadget:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (dcp_dir / ".metadata").write_bytes(pickle.dumps(Gadget()))
    with pytest.raises(store.CheckpointError, match="could run code"):
        store.check_shard_sizes(dcp_dir / ".metadata")
    assert not marker.exists()
    (dcp_dir / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(store.CheckpointError, match="cannot be read"):
        store.check_shard_sizes(dcp_dir / ".metadata")


@pytest.mark.parametrize("text", ['{"step": 2, "loader": {"epoch": 0, "ind', "[]", '{"step": 2}'])
def test_a_cut_or_foreign_loop_state_is_named(tmp_path, text) -> None:
    (tmp_path / store.LOOP_STATE).write_text(text)
    with pytest.raises(store.CheckpointError, match=f"{tmp_path / store.LOOP_STATE}: "):
        store.read_loop_state(tmp_path)


# ------------------------------------------------------------------------------------------------ real CLI
def train(*overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mcore_rl.train", "data.batch_size=2", "rollout.n=2",
                           "actor.mini_batches=1", *overrides], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """A one-step run on a data file, checkpointed: (run dir, the data file)."""
    from mcore_rl.data.synthetic import write_synthetic_dataset

    root = tmp_path_factory.mktemp("saved")
    data = Path(write_synthetic_dataset(str(root / "d.parquet"), 16, seed=0))
    res = train("trainer.steps=1", "trainer.save_every=1", f"data.train_files=[{data}]", f"trainer.run_dir={root}/run")
    assert res.returncode == 0, res.stderr[-3000:]
    return root / "run", data


def _damaged_copy(saved: tuple[Path, Path], tmp_path: Path, damage) -> Path:  # noqa: ANN001
    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    damage(run / "checkpoints" / "step_00000001")
    return run


def _cut(path: Path, nbytes: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:-nbytes])


def _assert_refused_before_ray(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "Started a local Ray instance" not in res.stdout + res.stderr
    for needle in needles:
        assert needle in res.stderr, (needle, res.stderr[-3000:])


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    ["optimizer-shard", "loop-state", "seed", "shuffle", "other-data"],
)
def test_bad_resume_inputs_are_refused_in_preflight(saved, tmp_path, case) -> None:
    data = saved[1]
    extra: list[str] = []
    if case == "optimizer-shard":
        run = _damaged_copy(saved, tmp_path, lambda ck: _cut(sorted((ck / "optimizer").glob("*.distcp"))[0]))
        needles = ["optimizer/__", "the file is truncated"]
    elif case == "loop-state":
        run = _damaged_copy(saved, tmp_path, lambda ck: _cut(ck / store.LOOP_STATE, 50))
        needles = ["loop_state.json: not valid JSON"]
    else:
        run = _damaged_copy(saved, tmp_path, lambda ck: None)
        if case == "seed":
            extra, needles = ["data.seed=1"], ["data.seed=1, but the checkpoint's data position was saved with seed=0"]
        elif case == "shuffle":
            extra, needles = ["data.shuffle=false"], ["data.shuffle=False, but"]
        else:
            from mcore_rl.data.synthetic import write_synthetic_dataset

            data = Path(write_synthetic_dataset(str(tmp_path / "other.parquet"), 16, seed=5))  # the same size
            needles = ["data.train_files: loader state was saved for other data files"]
    res = train("trainer.steps=2", "trainer.save_every=1", "trainer.resume=auto", f"data.train_files=[{data}]",
                f"trainer.run_dir={run}", *extra, timeout=300)  # fmt: skip
    _assert_refused_before_ray(res, *needles)
