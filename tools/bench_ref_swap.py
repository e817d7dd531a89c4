"""What actor.ref_placement=host costs per reference pass: bytes moved and seconds per swap, on the default job.

    python tools/bench_ref_swap.py              # 2 gloo ranks, configs/default.yaml's model and layout (ep=2)
    python tools/bench_ref_swap.py --repeat 50

Each rank builds the default job's actor twice (reference resident, then on the host) and prints, per rank: the bytes
one reference pass moves with `host` (park the policy, copy the reference in, copy the policy back: 3 x the rank's
weights), the median seconds of the swap in and the swap out, and the median seconds of a whole reference logprob pass
over the default job's batch (128 samples of ~31 tokens) with each placement. On the CPU runtime the "transfers" are
host memcpys; on CUDA they are pinned PCIe copies (the GPU check kit's numbers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _rank(rank: int, world: int, placement: str, repeat: int) -> dict:
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig
    from tools.bench_dynamic_batching import job_batch

    job = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    model = ModelConfig(hf_config=job["model"]["hf_config"], dtype=job["model"]["dtype"])
    actor_job = job["actor"]
    cfg = ActorConfig(
        world_size=world, layout=LayoutConfig(**actor_job["layout"]), use_ref=True, ref_placement=placement,
        micro_batch_size=actor_job["micro_batch_size"], logprob_micro_batch_size=actor_job["logprob_micro_batch_size"],
    )  # fmt: skip
    actor = MegatronActor(rank, world, model, cfg)
    actor.initialize(("127.0.0.1", 0))
    batch = job_batch("default")
    batch.responses.remainder_(model.hf_config["vocab_size"])  # the bench's ids are drawn from 100; this vocab is 63
    passes = []
    for _ in range(5):
        start = time.perf_counter()
        actor.logprobs(batch, use_ref=True)
        passes.append(time.perf_counter() - start)
    out = {"pass_s": statistics.median(passes)}
    if placement == "host":
        swaps = []
        for _ in range(repeat):
            with actor.reference.weights_in(actor):
                pass
            swaps.append(actor.reference.last_swap)
        out.update(
            bytes=swaps[0]["bytes"],
            weights=actor.reference.bytes,
            swap_in_s=statistics.median(s["swap_in_s"] for s in swaps),
            swap_out_s=statistics.median(s["swap_out_s"] for s in swaps),
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20, help="swaps timed per rank")
    args = parser.parse_args()
    from mcore_rl.parallel.harness import run_on_ranks

    resident = run_on_ranks(_rank, 2, ("resident", args.repeat))
    host = run_on_ranks(_rank, 2, ("host", args.repeat))
    print("rank  weights   moved/pass  swap in   swap out  ref pass resident  ref pass host")
    for rank, (r, h) in enumerate(zip(resident, host)):
        print(
            f"{rank:>4}  {h['weights'] / 1024:6.1f} KiB {h['bytes'] / 1024:7.1f} KiB  {h['swap_in_s'] * 1e3:6.3f} ms "
            f"{h['swap_out_s'] * 1e3:6.3f} ms  {r['pass_s'] * 1e3:10.1f} ms  {h['pass_s'] * 1e3:12.1f} ms"
        )


if __name__ == "__main__":
    main()
