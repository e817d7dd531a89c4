"""Where a run's metrics go, chosen by `trainer.loggers` (verl: trainer.logger): this registry is the list of choices.

    console       one line per step (headline metrics), above a progress bar with ETA when the terminal is a TTY
    jsonl         <run_dir>/metrics.jsonl, one object per step, every metric, flushed every step
    tensorboard   <run_dir>/tensorboard/events.out.tfevents.*  (the `tensorboard` package: pip install tensorboard)
    wandb         Weights & Biases, offline by default (trainer.wandb_mode): <run_dir>/wandb, no network needed;
                  `wandb sync <run_dir>/wandb/offline-run-*` uploads it later (pip install wandb)

Each backend takes (step, metrics) and is closed at the end of the run. The optional packages are imported when the
backend is built, and `missing_packages` lets the config refuse a logger whose package is absent before any process
starts.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any


class JsonlBackend:
    """Appends one JSON object per step; the file is started afresh unless the run resumes."""

    def __init__(self, run_dir: str, resume: bool = False, **_: Any) -> None:
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if os.path.islink(self.path):  # refused by name, not followed: its target would be truncated or appended to
            raise ValueError(
                f"{self.path} is a symbolic link; the run writes only regular files in trainer.run_dir: remove it, "
                "or choose another trainer.run_dir"
            )
        if not resume:
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one line whole or not at all: a failed write (a full disk) cuts the file back to where it was, as
        a cut line would make the whole file unreadable as JSON lines; the OSError then names the file."""
        line = (json.dumps({"step": step, **metrics}) + "\n").encode()
        try:  # O_NOFOLLOW: a metrics.jsonl replaced by a symlink mid-run fails (ELOOP) instead of writing elsewhere
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            raise OSError(err.errno, err.strerror, self.path) from None
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            view = memoryview(line)
            try:
                while view:  # a nearly full disk takes part of a write, then refuses the rest
                    view = view[os.write(fd, view) :]
            except OSError as err:
                os.ftruncate(fd, start)
                raise OSError(err.errno, err.strerror, self.path) from None
        finally:
            os.close(fd)

    def close(self) -> None:
        pass


class TensorBoardBackend:
    """Scalar summaries in TensorBoard's event-file format, via torch's SummaryWriter (needs `tensorboard`)."""

    def __init__(self, run_dir: str, **_: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(run_dir, "tensorboard")
        self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=10)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """Weights & Biases; `mode` offline keeps everything in <run_dir>/wandb (no account, no network)."""

    def __init__(
        self, run_dir: str, project: str = "mcore_rl", name: str | None = None, mode: str = "offline",
        config: dict[str, Any] | None = None, **_: Any,
    ) -> None:  # fmt: skip
        import wandb

        self.run = wandb.init(project=project, name=name, mode=mode, dir=run_dir, config=config or {})

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        self.run.finish()


#: trainer.loggers choices -> (backend class or None for the console, which MetricsLogger drives itself, package)
BACKENDS: dict[str, tuple[type | None, str | None]] = {
    "console": (None, None),
    "jsonl": (JsonlBackend, None),
    "tensorboard": (TensorBoardBackend, "tensorboard"),
    "wandb": (WandbBackend, "wandb"),
}


def missing_packages(loggers: list[str]) -> dict[str, str]:
    """logger -> the package it needs that is not installed here."""
    out = {}
    for name in loggers:
        package = BACKENDS[name][1] if name in BACKENDS else None
        if package and importlib.util.find_spec(package) is None:
            out[name] = package
    return out
