"""Start-up of a run, from the command to its first step, by phase: written to `<run_dir>/startup.json` and said in
one console line before step 1.

    clock = StartupClock()            # its origin is this process's own start (the interpreter, not this call)
    ...; clock.lap("pre-flight")      # each lap is the time since the previous one
    clock.detail("ranks", {...})      # what ran beside the laps (the ranks build while the engines start)
    clock.finish(run_dir)             # startup.json + "start-up: 41.2 s to the first step (...)"

The laps add up to the total; the details overlap them and are there to say where a lap's time went.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def process_start() -> float:
    """The wall-clock time this process started (Linux: /proc, 10 ms resolution); now, where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name: field 3 (state) is index 0
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in clock ticks after boot
    except (OSError, StopIteration, ValueError, IndexError):
        return time.time()


class StartupClock:
    """Laps from the process's start; see the module docstring."""

    def __init__(self, origin: float | None = None) -> None:
        self.origin = process_start() if origin is None else origin
        self.last = self.origin
        self.laps: dict[str, float] = {}
        self.details: dict[str, dict[str, float]] = {}

    def lap(self, name: str) -> None:
        """`name` took the time since the previous lap (laps of one name add up)."""
        now = time.time()
        self.laps[name] = self.laps.get(name, 0.0) + (now - self.last)
        self.last = now

    def detail(self, name: str, seconds: dict[str, float]) -> None:
        """A breakdown of work that overlapped the laps (e.g. one actor rank's own start-up phases)."""
        self.details[name] = {k: round(v, 3) for k, v in seconds.items()}

    @property
    def total(self) -> float:
        return self.last - self.origin

    def line(self) -> str:
        laps = ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.laps.items())
        return f"start-up: {self.total:.1f} s to the first step ({laps})"

    def record(self) -> dict[str, Any]:
        return {
            "total_s": round(self.total, 3),
            "laps_s": {k: round(v, 3) for k, v in self.laps.items()},
            "details_s": self.details,
        }

    def finish(self, run_dir: str) -> None:
        """Write `<run_dir>/startup.json` and print the console line."""
        path = os.path.join(run_dir, "startup.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.record(), f, indent=1)
        os.replace(path + ".tmp", path)
        print(self.line(), flush=True)
