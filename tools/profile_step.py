"""Where a training step's time goes: runs the real loop (mcore_rl.train.run) under several configs, one after the
other in this process, and prints the median seconds of every phase (timing_s/*) side by side.

    python tools/profile_step.py                          # before vs after: the default job, 60 steps each
    python tools/profile_step.py --steps 150 --skip 10    # more steps; the first --skip steps (warm-up) are left out
    python tools/profile_step.py --variant ref=actor.use_ref=true --variant mb8=actor.micro_batch_size=8

Variants (name=override,override,...; the default job's config under each):
    before   what the default job ran before issue 12 item 8: a reference model and a reference pass every step
             (actor.use_ref=true, though kl_loss_coef is 0), 16-sample micro-batches in the logprob passes and the update
    after    the default job as configured now (configs/default.yaml)
The phases are the loop's laps: gen (engines), reward, old_log_prob (policy, and reference when one runs: one call),
adv, update_actor, update_weights (sync to the engines), and step = their sum. The machine's load average is printed
with the figures: on a shared machine medians over many steps are the only meaningful ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

DEFAULT_VARIANTS = {
    "before": "actor.use_ref=true,actor.micro_batch_size=16,actor.logprob_micro_batch_size=16",
    "after": "",
}
PHASES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights", "step")


def run_variant(overrides: list[str], steps: int, run_dir: str) -> list[dict]:
    """Run the default job with `overrides` for `steps` steps; returns the metrics.jsonl records."""
    from hydra import compose, initialize_config_module

    from mcore_rl.config import register_schema, to_config
    from mcore_rl.train import run

    register_schema()
    with initialize_config_module("mcore_rl.configs", version_base=None):
        dcfg = compose("default", overrides=[f"trainer.steps={steps}", f"trainer.run_dir={run_dir}", *overrides])
    cfg = to_config(dcfg)
    try:
        run(cfg)
    finally:
        import ray

        ray.shutdown()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def medians(records: list[dict], skip: int) -> dict[str, float]:
    """Median seconds per phase over the steps after the first `skip`."""
    kept = [r for r in records if r.get("step", 0) > skip]
    out = {}
    for phase in PHASES:
        values = [r[f"timing_s/{phase}"] for r in kept if f"timing_s/{phase}" in r]
        if values:
            out[phase] = statistics.median(values)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per variant")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the medians")
    parser.add_argument("--variant", action="append", default=[], help="name=override,override,... (repeatable)")
    args = parser.parse_args(argv)
    variants = dict(DEFAULT_VARIANTS)
    if args.variant:
        variants = {}
        for spec in args.variant:
            name, _, overrides = spec.partition("=")
            variants[name] = overrides
    results = {}
    load = []
    for name, spec in variants.items():
        overrides = [o for o in spec.split(",") if o]
        with tempfile.TemporaryDirectory(prefix=f"profile_{name}_") as run_dir:
            load.append(os.getloadavg()[0])
            results[name] = medians(run_variant(overrides, args.steps, run_dir), args.skip)
            load.append(os.getloadavg()[0])
    names = list(results)
    print(f"\nmedian seconds per phase, steps {args.skip + 1}..{args.steps} ({os.cpu_count()} CPUs, 1-min load average "
          f"{min(load):.1f}..{max(load):.1f} during the runs)")  # fmt: skip
    print(f"{'phase':<16}" + "".join(f"{n:>12}" for n in names))
    for phase in PHASES:
        print(f"{phase:<16}" + "".join(f"{results[n].get(phase, float('nan')):>12.4f}" for n in names))
    for name, spec in variants.items():
        print(f"  {name}: {spec or '(configs/default.yaml as is)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
