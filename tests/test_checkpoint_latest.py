"""Which checkpoint a resume finds, whatever point of a save a kill interrupted, and which new runs are refused
because they would write over an earlier run's checkpoints or metrics (mcore_rl/checkpoint/store.py, manager.py).

A save writes `.tmp-step_<n>-<id>/` (meta.json last), renames it to `step_<n>/`, then replaces `latest` through
`.tmp-latest-<pid>`. A kill between the rename and the replace left a complete `step_<n>/` that `latest` did not name
(or, on the first save, no `latest` at all): `trainer.resume=auto` then started a new run over it. The end-to-end kills
are in tests/test_checkpoint_resume.py; these check the rule on directories laid out as each kill leaves them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_rl.checkpoint import store
from mcore_rl.checkpoint.manager import check_resume
from mcore_rl.config import RLConfig


def _complete(root: Path, step: int) -> Path:
    """A published step directory as far as finding it goes (meta.json is written last, before the rename)."""
    path = root / store.step_name(step)
    path.mkdir(parents=True)
    (path / store.META).write_text(json.dumps({"step": step}))
    return path


def _half(root: Path, step: int) -> Path:
    path = root / f"{store.TMP_PREFIX}{store.step_name(step)}-deadbeef"
    path.mkdir(parents=True)
    return path


def test_a_complete_step_directory_is_found_without_latest(tmp_path) -> None:
    """Killed during the first save's `latest`: step_4 complete, `.tmp-latest-<pid>` beside it, no `latest`."""
    root = tmp_path / "checkpoints"
    step4 = _complete(root, 4)
    (root / f"{store.TMP_PREFIX}{store.LATEST}-123").write_text("step_00000004\n")
    assert store.latest(root) == step4
    assert store.resolve("auto", root) == step4


def test_a_complete_step_newer_than_latest_wins(tmp_path) -> None:
    """Killed between the rename of step_4 and the move of `latest` (still naming step_2)."""
    root = tmp_path / "checkpoints"
    _complete(root, 2)
    step4 = _complete(root, 4)
    (root / store.LATEST).write_text("step_00000002\n")
    _half(root, 6)
    assert store.latest(root) == step4


def test_a_half_written_save_is_never_found(tmp_path) -> None:
    root = tmp_path / "checkpoints"
    step2 = _complete(root, 2)
    (root / store.LATEST).write_text("step_00000002\n")
    _half(root, 4)
    (root / store.step_name(6)).mkdir()  # a step_ name without meta.json: not a checkpoint of ours
    assert store.latest(root) == step2
    assert store.latest(tmp_path / "none") is None


def _cfg(run_dir: Path, **trainer) -> RLConfig:
    cfg = RLConfig()
    cfg.trainer.run_dir = str(run_dir)
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


def test_a_new_run_over_checkpoints_without_latest_is_refused(tmp_path) -> None:
    _complete(tmp_path / "checkpoints", 4)
    with pytest.raises(store.CheckpointError, match="holds checkpoints of an earlier run"):
        check_resume(_cfg(tmp_path, save_every=2, resume=None))


def test_a_new_run_over_an_earlier_runs_metrics_and_checkpoints_is_refused(tmp_path) -> None:
    """Without trainer.save_every it saves no checkpoint, but it would rewrite metrics.jsonl under the earlier run's
    checkpoints, whose resume reads that history."""
    _complete(tmp_path / "checkpoints", 4)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(store.CheckpointError, match=r"metrics.jsonl.*earlier run"):
        check_resume(_cfg(tmp_path, save_every=0, resume=None))


def test_a_new_run_in_a_run_dir_without_checkpoints_may_start_over(tmp_path) -> None:
    """`make run` twice in runs/latest (no checkpoints): the second run replaces the first's metrics, as before."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert check_resume(_cfg(tmp_path, save_every=0, resume=None)) is None
    assert check_resume(_cfg(tmp_path, save_every=2, resume="auto")) is None
