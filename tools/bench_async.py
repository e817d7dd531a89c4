"""Benchmark generation ahead of training (rollout.max_staleness = k) against the synchronous loop (k = 0), in the
embedded engine's GPU-latency model and in the real CPU mode, all in one invocation.

    python tools/bench_async.py                          # k = 0, 1, 2, 4 (partial rollouts on and off), both modes
    python tools/bench_async.py --steps 10 --ks 0,2 --modes latency -- data.batch_size=4   # extra overrides
    python tools/bench_async.py --quick --ks 0,1         # a smoke run: 2 steps, tiny responses (figures meaningless)

Runs `python -m mcore_rl.train` once per row, one after the other (never overlapping), with the same seeds and
overrides: per mode, k = 0 once (partial rollouts mean nothing there) and every other k with
rollout.partial_rollout=true and =false.

Modes:
  latency: rollout.latency_model_s_per_token=S (--s-per-token): a MODEL of a GPU engine. Each decode step of the
           running batch (and each prefill) sleeps S seconds instead of running the model, so generation costs wall
           time but no CPU, as a GPU engine looks to a CPU trainer. Its tokens are uniform draws (logprob -log V), so
           they disagree with the actor's logprobs (actor.first_step_logprob_tolerance=null) and rewards mean nothing.
  cpu:     the embedded engine runs the model on the same cores as training: the real figure on a CPU machine,
           where generation and training contend for the cores.

Per row: steps/s (steps over the loop's own seconds, summary.json: start-up excluded), tokens/s (response tokens
trained per second: metrics.jsonl perf/total_num_tokens split by the prompt and response length means, over the
loop's seconds), mean staleness (async/staleness_mean), partial requests per step (async/partial_requests), the
final reward (reward_last: the mean of the last three steps) and steps/s over k = 0 of the same mode. Prints a
markdown table, then a last line:

    k2_latency_ratio=<r> (k=2 partial=<p> over k=0, latency model)

(the best k = 2 row of the latency model; "-" where the run did not include it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

#: the job: the default task with responses long enough that a push lands mid-request (partial rollouts matter),
#: and 32 prompts x 8 samples, so a step takes about a second on a 2-core VM (the default's 16 x 8: half that)
JOB = ("rollout.max_new_tokens=24", "data.batch_size=32")
#: a smoke run: tiny responses
QUICK_JOB = ("rollout.max_new_tokens=6",)
#: seconds per decode step in the latency model: the job's training (old_log_prob + update_actor + update_weights)
#: took 0.541 s per step on a 2-core VM, and one step's generation is about 25 forwards (24 decode steps and a
#: prefill), so 0.541 / 25 makes generation in the model about as long as training (docs/benchmarks.md, Generation
#: ahead of training); measure again on other hardware and pass --s-per-token
DEFAULT_S_PER_TOKEN = 0.022


def mode_overrides(mode: str, s_per_token: float) -> list[str]:
    """What a mode adds to the job."""
    if mode == "latency":
        # uniform tokens are far from the actor's logprobs: the first step's tolerance check would end the run
        return [f"rollout.latency_model_s_per_token={s_per_token}", "actor.first_step_logprob_tolerance=null"]
    return []


def run_job(run_dir: str, steps: int, overrides: list[str]) -> dict:
    """One training run: its figures from summary.json and metrics.jsonl."""
    cmd = [sys.executable, "-m", "mcore_rl.train", f"trainer.steps={steps}", f"trainer.run_dir={run_dir}", *overrides]
    began = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in rows if "perf/total_num_tokens" in r]  # training steps (not a validation-only row)

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in rows) / max(len(rows), 1)

    response_tokens = 0.0
    for r in rows:  # total = samples x (prompt mean + response mean): the response share of it
        prompt, response = r.get("prompt_length/mean", 0.0), r.get("response_length/mean", 0.0)
        if prompt + response > 0:
            response_tokens += r["perf/total_num_tokens"] * response / (prompt + response)
    seconds = summary["seconds"]
    return {
        "steps_per_s": summary["steps"] / seconds,
        "tokens_per_s": response_tokens / seconds,
        "staleness": mean("async/staleness_mean"),
        "partial": mean("async/partial_requests"),
        "reward": summary["reward_last"],
        "loop_s": seconds,
        "wall_s": time.time() - began,
    }


def plan(modes: list[str], ks: list[int]) -> list[tuple[str, int, bool | None]]:
    """(mode, k, partial) per row: k = 0 once (partial None), every other k with partial rollouts on and off."""
    rows = []
    for mode in modes:
        for k in ks:
            rows += [(mode, 0, None)] if k == 0 else [(mode, k, True), (mode, k, False)]
    return rows


def table(results: list[tuple[str, int, bool | None, dict]]) -> list[str]:
    """The markdown table, with each row's steps/s over k = 0 of its mode."""
    base = {mode: r["steps_per_s"] for mode, k, _, r in results if k == 0}
    lines = [
        "| mode | k | partial | steps/s | tokens/s | mean staleness | partial requests/step | reward | vs k=0 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, k, partial, r in results:
        ratio = f"{r['steps_per_s'] / base[mode]:.2f}x" if mode in base else "-"
        lines.append(
            f"| {mode} | {k} | {'-' if partial is None else str(partial).lower()} | {r['steps_per_s']:.3f} | "
            f"{r['tokens_per_s']:.1f} | {r['staleness']:.2f} | {r['partial']:.1f} | {r['reward']:.3f} | {ratio} |"
        )
    return lines


def k2_line(results: list[tuple[str, int, bool | None, dict]]) -> str:
    """The last line: the best k = 2 latency-model row over k = 0 of the latency model."""
    base = [r["steps_per_s"] for mode, k, _, r in results if mode == "latency" and k == 0]
    k2 = [(r["steps_per_s"], p) for mode, k, p, r in results if mode == "latency" and k == 2]
    if not base or not k2:
        return "k2_latency_ratio=- (the run had no latency-model k=0 and k=2 rows)"
    best, partial = max(k2)
    return f"k2_latency_ratio={best / base[0]:.2f} (k=2 partial={str(partial).lower()} over k=0, latency model)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="RL steps per run")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 steps, tiny responses")
    parser.add_argument("--modes", default="latency,cpu", help="comma-separated: latency, cpu")
    parser.add_argument("--ks", default="0,1,2,4", help="comma-separated rollout.max_staleness values")
    parser.add_argument("--s-per-token", type=float, default=DEFAULT_S_PER_TOKEN, help="latency model: s per step")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run (after --)")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        if mode not in ("latency", "cpu"):
            parser.error(f"--modes: {mode!r} is not one of latency, cpu")
    ks = [int(k) for k in args.ks.split(",") if k]
    if any(k < 0 for k in ks):
        parser.error("--ks: each k must be an integer >= 0")
    steps = 2 if args.quick else args.steps
    job = list(QUICK_JOB if args.quick else JOB)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for i, (mode, k, partial) in enumerate(plan(modes, ks)):
            overrides = [*job, *mode_overrides(mode, args.s_per_token), f"rollout.max_staleness={k}"]
            if partial is not None:
                overrides.append(f"rollout.partial_rollout={str(partial).lower()}")
            r = run_job(os.path.join(tmp, f"run{i}"), steps, [*overrides, *args.overrides])
            print(f"{mode} k={k} partial={partial}: {r['steps_per_s']:.3f} steps/s ({r['wall_s']:.0f} s)", flush=True)
            results.append((mode, k, partial, r))
    print("\n".join(table(results)))
    print(k2_line(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
