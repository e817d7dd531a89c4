"""Per-step metrics to every backend of `trainer.loggers` (metrics/backends.py), a progress bar, the closing summary.

    log = MetricsLogger(os.path.join(run_dir, "metrics.jsonl"), history=state.rewards, loggers=["console", "jsonl"],
                        total_steps=cfg.trainer.steps, first_step=state.step + 1)
    timer = log.timer(); ...; timer.lap("gen")          # phase laps -> timing_s/gen (metrics/compute.py)
    log.write(step, metrics)                            # console line + jsonl + TensorBoard + wandb
    log.summary(seconds)                 # prints `summary: reward_first=... reward_last=... steps=... seconds=...`

A loss (`*_loss`) or grad norm (`*/grad_norm`) that is not finite on more than `max_nonfinite_steps` steps in a row
stops the run (errors.TrainingDiverged, exit 1) naming the step and the metric, after that step's line is written:
a run that trains on NaN must not end as a success. A NaN grad norm alone is not counted: the actor reports NaN when
it computes none (clip_grad=0); NaN weights show in the next step's loss.

The console prints one line per step with the headline metrics (every metric goes to the files); on a terminal a
tqdm bar below the lines shows steps done, ETA, seconds per step and the latest score and response length.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

from mcore_rl.metrics.backends import BACKENDS

SCORE = "critic/score/mean"
"""The metric the closing summary is computed from (verl's name for the mean sequence reward)."""
#: Console lines leave out what only a plot makes readable: extremes, per-token timings, per-phase rates ...
_CONSOLE_HIDDEN = ("/max", "/min", "timing_per_token_ms/", "perf/tokens_per_s/", "prompt_length/", "critic/advantages/",
                   "actor/ratio_", "actor/update_ok", "actor/approx_kl", "perf/total_num_tokens", "perf/time_per_step",
                   "val-aux/")  # fmt: skip


class StepTimer:
    """Wall-clock laps within one step: `lap("gen")` records the time since the previous lap (metric timing_s/gen)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> float:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._last
        self._last = now
        return self.laps[name]

    def lap_split(self, name: str, first: str, first_seconds: float) -> None:
        """A lap that held two phases, the first timed elsewhere (e.g. inside the actor's ranks): `first` gets
        `first_seconds` of the time since the previous lap, `name` the rest."""
        total = time.perf_counter() - self._last
        self.laps[first] = self.laps.get(first, 0.0) + min(first_seconds, total)
        self.lap(name)
        self.laps[name] -= min(first_seconds, total)


class MetricsLogger:
    """Writes each step's metrics to the console and the backends named in `loggers`."""

    def __init__(
        self,
        path: str,
        history: list[float] | None = None,
        loggers: list[str] | tuple[str, ...] = ("console", "jsonl"),
        total_steps: int | None = None,
        first_step: int = 1,
        wandb: dict[str, Any] | None = None,
        max_nonfinite_steps: int = 0,
    ) -> None:
        """`path`: the jsonl file (its folder is the run dir, where tensorboard/ and wandb/ go). `history`: the
        summary metric of the steps already done (a resumed run), appended to in place; the jsonl file is started
        afresh only when there is none. `wandb`: project, name, mode and config for the wandb backend.
        `max_nonfinite_steps` (trainer.max_nonfinite_steps): steps in a row with a non-finite loss or grad norm that
        are tolerated (see the module docstring)."""
        self.max_nonfinite_steps = max_nonfinite_steps
        self._nonfinite_run = 0
        run_dir = os.path.dirname(os.path.abspath(path))
        os.makedirs(run_dir, exist_ok=True)
        self.path = path
        self.rewards: list[float] = history if history is not None else []
        self.console = "console" in loggers
        self.backends = []
        for name in loggers:
            cls = BACKENDS[name][0]
            if cls is not None:
                kwargs = dict(wandb or {}) if name == "wandb" else {}
                self.backends.append(cls(run_dir, resume=bool(self.rewards), **kwargs))
        self.bar = None
        self._redirect = None
        if self.console and total_steps and sys.stderr.isatty():
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total_steps, initial=first_step - 1, unit="step", dynamic_ncols=True, leave=True)
            self._redirect = logging_redirect_tqdm()  # log lines (e.g. weight pushes) print above the bar
            self._redirect.__enter__()

    def timer(self) -> StepTimer:
        return StepTimer()

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """One step's metrics (or a validation-only record, e.g. step 0 of val_before_train) to every backend."""
        if SCORE in metrics:
            self.rewards.append(float(metrics[SCORE]))
        for backend in self.backends:
            backend.write(step, metrics)
        if self.console:
            shown = {k: v for k, v in metrics.items() if not any(h in k for h in _CONSOLE_HIDDEN)}
            line = " ".join(f"{k}={_fmt(v)}" for k, v in {"step": step, **shown}.items())
            if self.bar is not None:
                self.bar.write(line)
                if SCORE in metrics:
                    self.bar.set_postfix(
                        score=f"{metrics[SCORE]:.3f}",
                        resp_len=f"{metrics.get('response_length/mean', 0):.1f}",
                        refresh=False,
                    )
                    self.bar.update(1)
            else:
                print(line, flush=True)
        self._check_finite(step, metrics)

    def _check_finite(self, step: int, metrics: dict[str, Any]) -> None:
        """Count a step whose loss or grad norm is not finite; raise once more than max_nonfinite_steps are in a row."""
        bad = [
            f"{key}={value}"
            for key, value in metrics.items()
            if isinstance(value, float) and not math.isfinite(value)
            and (key.endswith("_loss") or (key.endswith("/grad_norm") and not math.isnan(value)))
        ]  # fmt: skip
        if not bad:
            self._nonfinite_run = 0
            return
        self._nonfinite_run += 1
        if self._nonfinite_run > self.max_nonfinite_steps:
            from mcore_rl.errors import TrainingDiverged

            self.close()
            raise TrainingDiverged(
                f"training diverged at step {step}: {', '.join(bad)} (not finite on {self._nonfinite_run} step(s) in "
                f"a row, trainer.max_nonfinite_steps={self.max_nonfinite_steps}); expected finite values: lower "
                f"actor.optim.lr, check the rewards and data, or raise trainer.max_nonfinite_steps to tolerate it"
            )

    def close(self) -> None:
        """Flush and close every backend and the bar (idempotent)."""
        for backend in self.backends:
            backend.close()
        self.backends = []
        if self.bar is not None:
            self.bar.close()
            self._redirect.__exit__(None, None, None)
            self.bar = None

    def summary(self, seconds: float) -> dict[str, float]:
        """Closes the logger and prints `summary: reward_first=... reward_last=... steps=... seconds=...`
        (first/last: means of the first and last 3 steps' critic/score/mean)."""
        self.close()
        first = self.rewards[:3]
        last = self.rewards[-3:]
        out = {
            "reward_first": sum(first) / max(len(first), 1),
            "reward_last": sum(last) / max(len(last), 1),
            "steps": len(self.rewards),
            "seconds": round(seconds, 1),
        }
        print(
            f"summary: reward_first={out['reward_first']:.3f} reward_last={out['reward_last']:.3f} "
            f"steps={out['steps']} seconds={out['seconds']:.1f}",
            flush=True,
        )
        return out


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
