"""Files read from a checkpoint are data: a replaced file is refused, never run.

A training checkpoint's RNG records (`rng/rank_*.pt`) are read with `torch.load(weights_only=True)`, and the
converter's torch_dist metadata reader admits only torch's metadata classes. Each test plants a file that would
create a marker if unpickled freely.

Run: `.venv/bin/pytest tests/test_checkpoint_trust.py`
"""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mcore_rl.checkpoint.rank_io import _rng_states, _set_rng_states, read_rng_record
from mcore_rl.resharding.dist_ckpt import CheckpointError, ChunkReader


class _Runs:
    """Unpickles to os.system(cmd): what a tampered file would carry."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def test_tampered_rng_record_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker, path = tmp_path / "ran", tmp_path / "rank_00000.pt"
    torch.save({"layout": "x", "world_size": 1, "states": _Runs(f"touch {marker}")}, path)
    with pytest.raises(ValueError, match="rank_00000.pt"):
        read_rng_record(path)
    assert not marker.exists()


def test_rng_record_round_trips_through_weights_only(tmp_path: Path) -> None:
    """What save_rank writes is exactly what resume restores: the next draws of python, numpy and torch repeat."""
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = tmp_path / "rank_00000.pt"
    torch.save({"states": _rng_states(SimpleNamespace(runtime="cpu"))}, path)
    expected = (random.random(), np.random.rand(), torch.rand(2))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    _set_rng_states(read_rng_record(path)["states"])
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_missing_rng_record_reads_as_empty(tmp_path: Path) -> None:
    assert read_rng_record(tmp_path / "absent.pt") == {}


def test_tampered_torch_dist_metadata_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Runs(f"touch {marker}")))
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        ChunkReader(tmp_path)
    assert not marker.exists()


def test_real_torch_dist_metadata_still_reads(tmp_path: Path) -> None:
    """A checkpoint torch itself wrote (in a child process: DCP's single-process save) opens with the strict reader."""
    code = (
        "import torch, torch.distributed.checkpoint as dcp, sys\n"
        "dcp.save({'w': torch.arange(12.).reshape(3, 4), 'b': torch.zeros(2, dtype=torch.bfloat16)},"
        " checkpoint_id=sys.argv[1], no_dist=True)\n"
    )
    subprocess.run([sys.executable, "-W", "ignore", "-c", code, str(tmp_path)], check=True)
    reader = ChunkReader(tmp_path)
    assert set(reader.tensors) == {"w", "b"}


def test_megatron_load_is_preceded_by_the_metadata_check(tmp_path: Path) -> None:
    """Megatron's loader (torch's FileSystemReader) unpickles .metadata freely: the actor's load checks it first."""
    from mcore_rl.resharding.dist_ckpt import load_model_chunks

    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Runs(f"touch {marker}")))
    with pytest.raises(CheckpointError, match="could run code"):
        load_model_chunks([], SimpleNamespace(dp_cp=None), tmp_path)
    assert not marker.exists()
