"""Does every algorithm learn the default task? One training run per algorithm, one table.

    .venv/bin/python tools/bench_algorithms.py                      # all of them, one after the other
    .venv/bin/python tools/bench_algorithms.py --only gae,dapo      # a subset
    .venv/bin/python tools/bench_algorithms.py --steps-scale 0.2    # short runs while developing (will not learn)

Each row runs `python -m mcore_rl.train` on the default CPU job (configs/default.yaml: "repeat: 7" -> "7" on a tiny
Qwen3-MoE, EP=2 on 2 gloo ranks, a real engine behind sglang-router) with the algorithm's keys and its step budget,
and reports the mean reward of the first 3 and the last 3 steps, their difference (the bar: >= 0.3) and the seconds
the run took (start-up included). DAPO's row reads `critic/score/unfiltered_mean`, the mean over every generated sample:
its training batch keeps only groups with mixed rewards, whose own mean says little about the policy. Its overlong
shaping stays off here: the default task's answer ("7" + end token) is all of rollout.max_new_tokens=2, so any buffer
would punish correct answers (tests/test_algorithms_e2e.py runs it with 3 tokens). DPO runs its own
config (`--config-name dpo`: offline pairs; its reward is the rule reward of the policy's samples, scored each step).

Step budgets and learning rates are per algorithm and written below, so the table says what each needed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Algorithm:
    """One row: the train overrides and the step budget."""

    overrides: list[str]
    steps: int
    config_name: str | None = None  #: --config-name (DPO); None = the default job
    reward_key: str = "critic/score/mean"
    notes: list[str] = field(default_factory=list)


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm([], steps=100),
    "gae": Algorithm(
        [
            "algorithm.adv_estimator=gae",
            "critic.enable=true",
            "critic.optim.lr=1e-2",
            "critic.warmup_steps=2",
            "algorithm.lam=0.95",
        ],
        steps=100,
    ),
    "rloo": Algorithm(["algorithm.adv_estimator=rloo"], steps=100),
    "remax": Algorithm(["algorithm.adv_estimator=remax"], steps=100),
    "reinforce_plus_plus": Algorithm(["algorithm.adv_estimator=reinforce_plus_plus"], steps=100),
    "gspo": Algorithm(
        [
            "actor.policy_loss=gspo",
            "actor.clip_ratio_low=3e-4",
            "actor.clip_ratio_high=4e-4",
            "actor.loss_agg_mode=seq-mean-token-mean",
        ],
        steps=100,
    ),
    "dapo": Algorithm(
        [
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.max_num_gen_batches=6",
            "algorithm.filter_groups.on_unfilled=shrink",
            "actor.clip_ratio_high=0.28",
            "actor.loss_agg_mode=token-mean",
        ],
        steps=100,
        reward_key="critic/score/unfiltered_mean",
    ),
    "dpo": Algorithm([], steps=100, config_name="dpo"),
}


def command(name: str, algo: Algorithm, run_dir: str, steps: int) -> list[str]:
    """The train command line of one row."""
    head = [sys.executable, "-m", "mcore_rl.train"]
    if algo.config_name:
        head += ["--config-name", algo.config_name]
    return [*head, f"trainer.steps={steps}", f"trainer.run_dir={run_dir}", *algo.overrides]


def run_one(name: str, algo: Algorithm, run_dir: str, steps: int, timeout_s: float) -> dict:
    """Run one algorithm; its reward first-3 / last-3 from metrics.jsonl, and the wall-clock seconds."""
    cmd = command(name, algo, run_dir, steps)
    start = time.time()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    seconds = time.time() - start
    shown = [c for c in cmd[1:] if not c.startswith("trainer.run_dir=")]  # the run dir is a temporary one
    row = {"name": name, "steps": steps, "seconds": round(seconds, 1), "command": "python " + " ".join(shown)}
    if out.returncode != 0:
        return {**row, "error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    rewards = [r.get(algo.reward_key, r.get("critic/score/mean")) for r in records]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    return {**row, "reward_first": first, "reward_last": last, "delta": last - first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated algorithm names (default: all)")
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply every step budget (development)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(ALGORITHMS)
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        parser.error(f"--only: unknown {unknown}; known: {', '.join(ALGORITHMS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_algorithms_") as tmp:
        for name in names:
            algo = ALGORITHMS[name]
            steps = max(3, round(algo.steps * args.steps_scale))
            row = run_one(name, algo, os.path.join(tmp, name), steps, args.timeout)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(f"{'algorithm':<20} {'steps':>5} {'first-3':>8} {'last-3':>8} {'delta':>7} {'learns':>6} {'seconds':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['name']:<20} {row['steps']:>5} failed: {row['error']}")
        else:
            learns = "yes" if row["delta"] >= 0.3 else "NO"
            print(
                f"{row['name']:<20} {row['steps']:>5} {row['reward_first']:>8.3f} {row['reward_last']:>8.3f} "
                f"{row['delta']:>7.3f} {learns:>6} {row['seconds']:>8.1f}"
            )
    print()
    for row in rows:
        print(f"{row['name']}: {row['command']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
