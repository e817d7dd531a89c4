"""Learning curves of finished runs side by side, from their metrics.jsonl: the reward per step (means over windows
of steps), the first step whose window mean is `--gain` above the first window's, the engine-vs-actor logprob gap and
the step time.

    python tools/compare_curves.py runs/smollm2_embedded runs/smollm2_vllm --window 5 --gain 0.3

Prints one table (markdown) to paste into docs/benchmarks.md; exit 2 when a run dir holds no metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

REWARD = "critic/score/mean"
GAP = "rollout/logprob_abs_diff"
STEP_TIME = "timing_s/step"


def read(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"error: {path} does not exist: expected a finished run's directory")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if REWARD in r]
    if not rows:
        raise SystemExit(f"error: {path} holds no {REWARD}: expected the metrics of a training run")
    return rows


def windows(values: list[float], size: int) -> list[float]:
    return [statistics.fmean(values[i : i + size]) for i in range(0, len(values), size)]


def summary(rows: list[dict], size: int, gain: float) -> dict:
    reward = [float(r[REWARD]) for r in rows]
    means = windows(reward, size)
    reached = None
    for end in range(size, len(reward) + 1):  # the first step whose trailing window is `gain` above the first
        if statistics.fmean(reward[end - size : end]) >= means[0] + gain:
            reached = end
            break
    gaps = [float(r[GAP]) for r in rows if GAP in r]
    times = [float(r[STEP_TIME]) for r in rows if STEP_TIME in r]
    return {
        "steps": len(rows), "windows": means, "reached": reached,
        "gap_first": gaps[0] if gaps else None, "gap_median": statistics.median(gaps) if gaps else None,
        "step_s": statistics.median(times) if times else None,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--window", type=int, default=5, help="steps per mean (default 5)")
    parser.add_argument("--gain", type=float, default=0.3, help="reward gain over the first window (default 0.3)")
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error(f"--window={args.window}: expected an integer >= 1")
    try:
        runs = {d: summary(read(d), args.window, args.gain) for d in args.run_dirs}
    except SystemExit as err:
        print(err, file=sys.stderr)
        return 2
    width = max(len(s["windows"]) for s in runs.values())
    heads = [f"steps {i * args.window + 1}-{(i + 1) * args.window}" for i in range(width)]
    print("| run | " + " | ".join(heads) + f" | step reaching +{args.gain} | logprob gap (step 1 / median) | step s |")
    print("|---" * (len(heads) + 4) + "|")
    for run_dir, s in runs.items():
        cells = [f"{m:.3f}" for m in s["windows"]] + [""] * (width - len(s["windows"]))
        gap = "n/a" if s["gap_first"] is None else f"{s['gap_first']:.2g} / {s['gap_median']:.2g}"
        step = "n/a" if s["step_s"] is None else f"{s['step_s']:.1f}"
        reached = "not reached" if s["reached"] is None else str(s["reached"])
        print(f"| {run_dir} | " + " | ".join(cells) + f" | {reached} | {gap} | {step} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
