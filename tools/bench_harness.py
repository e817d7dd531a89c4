"""Start-up cost of the multi-rank harness: ranks forked from the preloaded fork server against spawned ranks.

    python tools/bench_harness.py [--world 4] [--calls 3]

Each call starts `--world` gloo ranks that each build the default job's actor (its tiny Qwen3-MoE model, EP over the
ranks, and its optimizer: what a parity, conversion or checkpoint rank does first) and return the local parameter
count. Both start methods run here, one after the other, in
the same process; each line gives the wall seconds of one call and the CPU-seconds the whole machine spent on it
(from /proc/stat, so other load on the machine shows up in it). The first forkserver call includes starting the
server and its imports. Ends with
`harness: spawn_s=<median> forkserver_s=<median> ratio=<r> spawn_cpu_s=<median> forkserver_cpu_s=<median>`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without an install


def _busy_cpu_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / 100.0


def build_rank(rank: int, world_size: int, hf_config: dict) -> int:
    """Build the default job's actor under EP=world_size and return this rank's parameter count."""
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig

    actor = MegatronActor(
        rank, world_size, ModelConfig(hf_config=hf_config),
        ActorConfig(world_size=world_size, layout=LayoutConfig(ep=world_size)),
    )  # fmt: skip
    actor.initialize(("127.0.0.1", 0))
    return sum(p.numel() for chunk in actor.chunks for p in chunk.parameters())


def default_hf_config() -> dict:
    from omegaconf import OmegaConf

    path = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
    return OmegaConf.to_container(OmegaConf.load(path).model.hf_config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4, help="ranks per call, 1, 2 or 4 (default 4)")
    parser.add_argument("--calls", type=int, default=3, help="calls per start method (default 3)")
    args = parser.parse_args(argv)
    if args.world not in (1, 2, 4) or args.calls < 1:
        parser.error(f"--world must be 1, 2 or 4 (EP over the model's 4 experts), --calls positive "
                     f"(got {args.world}, {args.calls})")  # fmt: skip
    from mcore_rl.parallel.harness import run_on_ranks

    hf_config = default_hf_config()
    figures: dict[str, tuple[list[float], list[float]]] = {}
    for method in ("spawn", "forkserver"):
        walls, cpus = figures.setdefault(method, ([], []))
        for call in range(args.calls):
            cpu0, t0 = _busy_cpu_s(), time.perf_counter()
            counts = run_on_ranks(build_rank, args.world, (hf_config,), start_method=method)
            walls.append(time.perf_counter() - t0)
            cpus.append(_busy_cpu_s() - cpu0)
            print(f"{method:10s} call {call}: {walls[-1]:6.2f} s wall, {cpus[-1]:6.2f} CPU-s, params/rank {counts}")
    med = {m: (statistics.median(w), statistics.median(c)) for m, (w, c) in figures.items()}
    print(
        f"harness: spawn_s={med['spawn'][0]:.2f} forkserver_s={med['forkserver'][0]:.2f} "
        f"ratio={med['spawn'][0] / med['forkserver'][0]:.1f} spawn_cpu_s={med['spawn'][1]:.2f} "
        f"forkserver_cpu_s={med['forkserver'][1]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
