"""Padded tokens per update step and update time: fixed-length micro-batches, actor.dynamic_batching, actor.packing.

    python tools/bench_dynamic_batching.py              # both jobs' padding, then the update timing (one CPU rank)
    python tools/bench_dynamic_batching.py --no-time    # padding only (no Megatron)

Jobs (synthetic batches shaped like them; lengths = prompt + response):
- default: configs/default.yaml's step (16 prompts x 8 samples, 2 mini-batches, micro-batch 32, dp 2, answers of
  1-2 tokens after ~30-token prompts);
- mixed: rollout.max_new_tokens=64 on a task whose answer lengths vary by prompt (4..64 tokens; the n samples of one
  prompt are close to each other), the same batch shape.
Padded tokens = tokens the model computes minus real tokens, summed over every micro-batch of the step (the padded
paths hold one extra position per sequence besides; packing only pads each row to a multiple of pad_multiple, here 1;
it runs only with Transformer Engine, so it is not timed here). The timing
runs a one-rank CPU actor (tiny Qwen3-MoE, ep=1) through three updates of the mixed batch each way and prints the
median ratio; logprobs are not affected (dynamic batching changes only the update's micro-batches).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mcore_rl.actor.batch import TrainBatch, balanced_shard, dynamic_micro_batches, micro_batches, sequence_length

QWEN3_MOE_TINY = dict(
    model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
    num_experts_per_tok=2, norm_topk_prob=True, rope_theta=10000.0, rms_norm_eps=1e-6,
)  # fmt: skip


def job_batch(kind: str, prompts: int = 16, n: int = 8, seed: int = 0) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    rows, lengths = [], []
    for _ in range(prompts):
        prompt_len = 28 + int(torch.randint(0, 6, (1,), generator=gen))
        base = 1 if kind == "default" else int(torch.randint(4, 60, (1,), generator=gen))
        for _ in range(n):
            rows.append(list(range(1, prompt_len + 1)))
            spread = 2 if kind == "default" else 5
            lengths.append(max(1, min(64, base + int(torch.randint(0, spread, (1,), generator=gen)))))
    R = max(lengths)
    responses, mask = torch.zeros(len(rows), R, dtype=torch.long), torch.zeros(len(rows), R)
    for i, length in enumerate(lengths):
        responses[i, :length] = torch.randint(1, 100, (length,), generator=gen)
        mask[i, :length] = 1
    return TrainBatch(rows, responses, mask, {"advantages": torch.randn(len(rows), R, generator=gen)})


def padded_tokens(batch: TrainBatch, mini_batches: int, dp: int, micro: int, budget: int | None, mode: str) -> int:
    """mode: fixed | dynamic | packed."""
    from mcore_rl.actor.packing import packed_micro_batches

    real = sum(len(p) for p in batch.prompts) + int(batch.response_lengths().sum())
    computed = 0
    for mini in batch.chunks(mini_batches):
        for rank in range(dp):
            if mode == "packed":
                computed += sum(mb.tokens.numel() for mb in packed_micro_batches(mini.shard(rank, dp), micro,
                                                                                max_tokens=budget))  # fmt: skip
            elif mode == "dynamic":
                computed += sum(mb.tokens.numel() for mb in dynamic_micro_batches(balanced_shard(mini, rank, dp), micro,
                                                                                 max_tokens=budget))  # fmt: skip
            else:
                mbs, _ = micro_batches(mini.shard(rank, dp), micro, 1, budget, sequence_length(mini))
                computed += sum(mb.tokens.numel() for mb in mbs)
    return computed - real


def _time_updates(rank: int, world: int, batch: TrainBatch, dynamic: bool) -> list[float]:
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, ModelConfig

    cfg = ActorConfig(world_size=1, use_ref=False, mini_batches=2, micro_batch_size=32, dynamic_batching=dynamic,
                      max_tokens_per_microbatch=2048)  # fmt: skip
    actor = MegatronActor(rank, world, ModelConfig(hf_config=QWEN3_MOE_TINY), cfg)
    actor.initialize(("127.0.0.1", 0))
    batch.tensors["old_logprobs"] = torch.zeros_like(batch.response_mask) - 4.0
    actor.update(batch)  # warm-up
    times = []
    for _ in range(3):
        start = time.perf_counter()
        actor.update(batch)
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-time", action="store_true", help="padding figures only")
    args = p.parse_args()
    for kind in ("default", "mixed"):
        batch = job_batch(kind)
        real = sum(len(q) for q in batch.prompts) + int(batch.response_lengths().sum())
        before = padded_tokens(batch, 2, 2, 32, None, "fixed")
        after = padded_tokens(batch, 2, 2, 32, 2048, "dynamic")
        packed = padded_tokens(batch, 2, 2, 32, 2048, "packed")
        print(f"{kind:8s} real tokens {real:6d}  padded per step: fixed {before:6d}  dynamic {after:6d}  "
              f"packed {packed:6d}")  # fmt: skip
    if args.no_time:
        return 0
    from mcore_rl.parallel.harness import run_on_ranks

    batch = job_batch("mixed")
    fixed = statistics.median(run_on_ranks(_time_updates, 1, (batch, False))[0])
    dynamic = statistics.median(run_on_ranks(_time_updates, 1, (batch, True))[0])
    print(f"mixed update (one CPU rank, 128 samples, 2 mini-batches): fixed {fixed:.3f} s, dynamic {dynamic:.3f} s, "
          f"ratio {dynamic / fixed:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
