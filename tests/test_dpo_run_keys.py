"""The DPO loop honours the run's keys as the RL loop does: loggers (TensorBoard), checkpoints every
trainer.save_every steps, an exact resume, validation through the engines, and pre-flight; the keys it cannot honour
(colocated placement, async rollouts, a critic) are refused naming the key, before anything starts.

Each run is `python -m mcore_rl.train --config-name dpo` on real Megatron ranks, joining the test session's Ray cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _ray_cluster import ray_address_override, train_env

TRAIN = [sys.executable, "-m", "mcore_rl.train", "--config-name", "dpo"]


def _run(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TRAIN, f"trainer.run_dir={run_dir}", "rollout.n=2", ray_address_override(), *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        env=train_env(),
    )


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """Four DPO steps in one go, with TensorBoard, a checkpoint every 2 steps and validation every 2."""
    run_dir = tmp_path_factory.mktemp("dpo") / "straight"
    out = _run(
        run_dir,
        "trainer.steps=4",
        "trainer.save_every=2",
        "trainer.val_every=2",
        "trainer.loggers=[console,jsonl,tensorboard]",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, out


@pytest.mark.long
@pytest.mark.slow
def test_dpo_writes_tensorboard_events_and_checkpoints(straight: tuple[Path, subprocess.CompletedProcess]):
    run_dir, _ = straight
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard event file"
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved == ["step_00000002", "step_00000004"], saved


@pytest.mark.long
@pytest.mark.slow
def test_dpo_validates_through_the_engines(straight: tuple[Path, subprocess.CompletedProcess]):
    rows = _rows(straight[0])
    validated = [r["step"] for r in rows if any(k.startswith("val-core/") for k in r)]
    assert validated == [2, 4], validated


@pytest.mark.long
@pytest.mark.slow
def test_dpo_resume_continues_the_run_exactly(tmp_path: Path, straight: tuple[Path, subprocess.CompletedProcess]):
    run_dir = tmp_path / "resumed"
    first = _run(run_dir, "trainer.steps=2", "trainer.save_every=2", "trainer.val_every=2")
    assert first.returncode == 0, first.stderr[-3000:]
    second = _run(run_dir, "trainer.steps=4", "trainer.save_every=2", "trainer.val_every=2", "trainer.resume=auto")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "checkpoint: resumed" in second.stdout, second.stdout[-2000:]
    resumed, whole = _rows(run_dir), _rows(straight[0])
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("dpo/loss", "dpo/rewards_margin", "weight_version"):
        assert [r[key] for r in resumed] == [r[key] for r in whole], key  # bit for bit: model, optimizer, data, RNG


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.placement=colocated", "trainer.placement"),
        ("rollout.max_staleness=1", "rollout.max_staleness"),
    ],
)
def test_dpo_refuses_the_keys_it_cannot_honour(tmp_path: Path, override: str, key: str):
    out = subprocess.run([*TRAIN, override, f"trainer.run_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert key in out.stderr and "trainer.mode=dpo" in out.stderr, out.stderr[-2000:]


@pytest.mark.long
@pytest.mark.slow
def test_dpo_runs_pre_flight_before_anything_starts(straight: tuple[Path, subprocess.CompletedProcess]):
    """A new run whose saves would overwrite an earlier run's checkpoints is refused by pre-flight (exit 2), as in the
    RL loop; the earlier run's metrics stay as they were. (Last in the file: it reuses the straight run's directory.)"""
    run_dir, _ = straight
    before = (run_dir / "metrics.jsonl").read_text()
    out = _run(run_dir, "trainer.steps=2", "trainer.save_every=2")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "holds checkpoints of an earlier run" in out.stderr, out.stderr[-2000:]
    assert (run_dir / "metrics.jsonl").read_text() == before
