"""Per-step metrics: one printed line per step, appended to a jsonl file, and the run's closing summary line."""

from __future__ import annotations

import json
import os
import time


class StepTimer:
    """Wall-clock laps within one step: `lap("time/generate")` records the time since the previous lap."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> float:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now
        return self.laps[name]


class MetricsLogger:
    """Writes metrics to stdout and `path` (jsonl, one object per step, flushed every step)."""

    def __init__(self, path: str, history: list[float] | None = None) -> None:
        """`history`: reward/mean of the steps already done (a resumed run), appended to in place; the jsonl file is
        started afresh only when there is none."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.rewards: list[float] = history if history is not None else []
        if not self.rewards:
            open(path, "w").close()

    def timer(self) -> StepTimer:
        return StepTimer()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        self.rewards.append(float(metrics.get("reward/mean", float("nan"))))
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in record.items())
        print(shown, flush=True)

    def summary(self, seconds: float) -> dict[str, float]:
        """Prints `summary: reward_first=... reward_last=... steps=... seconds=...` (first/last: 3-step means)."""
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
