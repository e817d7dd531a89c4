"""Where a training step's time goes: runs the real loop (mcore_rl.train.run) under several configs, one after the
other in this process, and prints the median seconds of every phase (timing_s/*) side by side.

    python tools/profile_step.py                          # before vs after: the default job, 60 steps each
    python tools/profile_step.py --steps 150 --skip 10    # more steps; the first --skip steps (warm-up) are left out
    python tools/profile_step.py --variant ref=actor.use_ref=true --variant mb8=actor.micro_batch_size=8
    python tools/profile_step.py --baseline               # adds a column: the same job as one plain PyTorch process

Variants (name=override,override,...; the default job's config under each):
    before   the default job's old settings: a reference model and a reference pass every step
             (actor.use_ref=true, though kl_loss_coef is 0), 16-sample micro-batches in the logprob passes and the
             update
    after    the default job as configured now (configs/default.yaml)
    python tools/profile_step.py --calls 20               # the actor's two calls alone, before and after alternating

`--calls N` times the actor's calls on a batch shaped like the default job's (16 prompts x 8 samples), alternating
the before and after settings call by call in one Ray session, so that a busy machine slows both alike: logprobs
(before: policy and reference passes in 16-sample micro-batches; after: the policy pass only, 64 per rank) and the
update (16- vs 32-sample micro-batches). It is the figure to trust on a shared machine.
`--baseline` adds tools/single_process_grpo.py's run of the default job (same model shape, task, reward, advantages,
loss and optimizer settings; no Ray, HTTP engine, Megatron ranks or weight sync) as a last column, and the ratio of
each variant's step to it: what the distributed machinery costs on a model this small.
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
import time

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


def _timed_actor_cls():  # noqa: ANN202
    from mcore_rl.actor.megatron_actor import MegatronActor

    class TimedActor(MegatronActor):
        """The production actor plus one method that runs another method under other micro-batch sizes."""

        def timed(self, method: str, micro: int, logprob_micro: int, *args, **kwargs):  # noqa: ANN202
            import time

            self.cfg.micro_batch_size, self.cfg.logprob_micro_batch_size = micro, logprob_micro
            start = time.perf_counter()
            result = getattr(self, method)(*args, **kwargs)
            return time.perf_counter() - start, result

    return TimedActor


def time_calls(calls: int) -> None:
    """Median seconds of the actor's calls, before vs after, alternating (see the module docstring)."""
    import ray
    import torch
    from hydra import compose, initialize_config_module

    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.config import register_schema, to_config
    from mcore_rl.controller.actor_group import ActorGroup

    register_schema()
    with initialize_config_module("mcore_rl.configs", version_base=None):
        cfg = to_config(compose("default", overrides=["actor.use_ref=true"]))
    from mcore_rl._quiet import ray_init_kwargs

    ray.init(address="local", num_cpus=cfg.actor.world_size + 1, include_dashboard=False, **ray_init_kwargs())
    try:
        world = cfg.actor.world_size
        remote = ray.remote(_timed_actor_cls()).options(num_cpus=1)
        handles = [remote.remote(r, world, cfg.model, cfg.actor, "cpu", 0) for r in range(world)]
        address = ray.get(handles[0].rendezvous_address.remote())
        ray.get([h.initialize.remote(address) for h in handles])
        n = cfg.data.batch_size * cfg.rollout.n
        gen = torch.Generator().manual_seed(0)
        batch = TrainBatch(
            [torch.randint(3, 60, (6,), generator=gen).tolist() for _ in range(n)],
            torch.randint(3, 60, (n, 2), generator=gen),
            torch.ones(n, 2),
            {"rollout_logprobs": torch.zeros(n, 2), "advantages": torch.randn(n, 2, generator=gen)},
        )

        def call(method: str, micro: int, logprob_micro: int, *args) -> float:
            ref = [ray.put(a) for a in args]
            out = ray.get([h.timed.remote(method, micro, logprob_micro, *ref) for h in handles])
            return max(seconds for seconds, _ in out), out

        _, out = call("logprobs", 16, 64, batch)
        batch.tensors["old_logprobs"] = ActorGroup.gather_dp([r for _, r in out])
        plan = {
            "logprobs before (old + ref, 16/mb)": [("logprobs", 16, 16, batch), ("logprobs_ref", 16, 16, batch)],
            "logprobs after (old, 64/mb)": [("logprobs", 32, 64, batch)],
            "update before (16/mb)": [("update", 16, 16, batch)],
            "update after (32/mb)": [("update", 32, 64, batch)],
        }
        times: dict[str, list[float]] = {name: [] for name in plan}
        for _ in range(calls):
            for name, steps in plan.items():
                total = 0.0
                for method, micro, logprob_micro, arg in steps:
                    if method == "logprobs_ref":
                        ref = ray.put(arg)
                        start = time.perf_counter()
                        ray.get([h.timed.remote("logprobs", micro, logprob_micro, ref, use_ref=True) for h in handles])
                        total += time.perf_counter() - start
                    else:
                        start = time.perf_counter()
                        call(method, micro, logprob_micro, arg)
                        total += time.perf_counter() - start
                times[name].append(total)
        print(f"\nmedian seconds per call incl. Ray round trip, {calls} alternating rounds (1-min load average "
              f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs)")  # fmt: skip
        for name, values in times.items():
            print(f"  {name:<40}{statistics.median(values):>10.4f}")
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per variant")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the medians")
    parser.add_argument("--variant", action="append", default=[], help="name=override,override,... (repeatable)")
    parser.add_argument("--calls", type=int, default=0, help="time the actor's calls alone, N alternating rounds")
    parser.add_argument("--baseline", action="store_true", help="add the single-process run of the job as a column")
    args = parser.parse_args(argv)
    if args.calls:
        time_calls(args.calls)
        return 0
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
    if args.baseline:
        import single_process_grpo

        load.append(os.getloadavg()[0])
        results["1-process"] = medians(single_process_grpo.run(args.steps), args.skip)
        load.append(os.getloadavg()[0])
    names = list(results)
    print(f"\nmedian seconds per phase, steps {args.skip + 1}..{args.steps} ({os.cpu_count()} CPUs, 1-min load average "
          f"{min(load):.1f}..{max(load):.1f} during the runs)")  # fmt: skip
    print(f"{'phase':<16}" + "".join(f"{n:>12}" for n in names))
    for phase in PHASES:
        print(f"{phase:<16}" + "".join(f"{results[n].get(phase, float('nan')):>12.4f}" for n in names))
    if args.baseline:
        base = results["1-process"]["step"]
        print(f"{'step / 1-process':<16}" + "".join(f"{results[n]['step'] / base:>12.2f}" for n in names))
    for name, spec in variants.items():
        print(f"  {name}: {spec or '(configs/default.yaml as is)'}")
    if args.baseline:
        print("  1-process: tools/single_process_grpo.py (the default job in one PyTorch process)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
