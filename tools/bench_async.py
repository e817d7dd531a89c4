"""Benchmark one-step-off-policy generation (trainer.async_rollout) against the synchronous loop on the same job.

    python tools/bench_async.py                         # the default job, 40 steps each way
    python tools/bench_async.py --steps 20 -- rollout.max_new_tokens=8 data.batch_size=8   # extra overrides
    python tools/bench_async.py --quick                 # 4 steps: a smoke run (figures meaningless)

Runs `python -m mcore_rl.train` twice, one after the other (never overlapping), with the same seeds and overrides:
`trainer.async_rollout=false` then `=true` (split placement). Steps/s is steps over the loop's own seconds
(summary.json: start-up of Ray, ranks and engines excluded); reward is the run's `reward_last` (the mean of its last
three steps). Per phase it prints the mean seconds per step from metrics.jsonl: timing_s/gen (in async: the wait
for a batch already being generated), logprobs, update, sync, and for async the generation thread's own
generate/reward seconds (async/generate_s, async/reward_s). Last line:

    async: sync_steps_per_s=<a> async_steps_per_s=<b> ratio=<r> sync_reward=<x> async_reward=<y>

The overlap can only win where generation and training have hardware of their own: on a 2-core machine the engine
and the two actor ranks share the cores, so the gain is bounded by CPU contention (the per-phase times show it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

PHASES = (
    "timing_s/gen",
    "timing_s/old_log_prob",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "async/generate_s",
    "async/reward_s",
)


def run_job(run_dir: str, steps: int, async_rollout: bool, overrides: list[str]) -> dict:
    """One training run; its summary and per-phase mean seconds."""
    cmd = [
        sys.executable, "-m", "mcore_rl.train", f"trainer.steps={steps}", f"trainer.run_dir={run_dir}",
        f"trainer.async_rollout={str(async_rollout).lower()}", *overrides,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    phases = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in PHASES if any(k in r for r in rows)}
    return {
        "steps_per_s": summary["steps"] / summary["seconds"],
        "reward": summary["reward_last"],
        "phases": phases,
        "stale_frac": sum(r.get("async/stale_frac", 0.0) for r in rows) / len(rows),
        "two_version_frac": sum(r.get("async/two_version_frac", 0.0) for r in rows) / len(rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="4 steps (smoke run)")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs (after --)")
    args = parser.parse_args(argv)
    steps = 4 if args.quick else args.steps
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        sync = run_job(os.path.join(tmp, "sync"), steps, False, args.overrides)
        asyn = run_job(os.path.join(tmp, "async"), steps, True, args.overrides)
    print(f"{'phase (s/step)':<20}{'sync':>10}{'async':>10}")
    for key in PHASES:
        a, b = sync["phases"].get(key), asyn["phases"].get(key)
        print(f"{key:<20}{'-' if a is None else f'{a:.3f}':>10}{'-' if b is None else f'{b:.3f}':>10}")
    print(f"async: stale sample share {asyn['stale_frac']:.2f}, two-version share {asyn['two_version_frac']:.2f}")
    ratio = asyn["steps_per_s"] / sync["steps_per_s"]
    print(
        f"async: sync_steps_per_s={sync['steps_per_s']:.3f} async_steps_per_s={asyn['steps_per_s']:.3f} "
        f"ratio={ratio:.2f} sync_reward={sync['reward']:.3f} async_reward={asyn['reward']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
