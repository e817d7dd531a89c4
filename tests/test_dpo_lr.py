"""DPO updates follow the configured learning-rate schedule (actor/dpo_step.py steps it as the RL update does).

One CPU rank of a tiny Qwen3-MoE actor takes DPO updates of 2 mini-batches each (2 optimizer steps per update) under
a linear warmup then a cosine decay; the optimizer's lr after each update and the logged `actor/lr` are compared with
Megatron's schedule at the optimizer steps taken (not at the updates). Before the fix every step ran at the
schedule's first value (lr / warmup).
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_qwen3_moe

HF = tiny_qwen3_moe(vocab_size=100)
WARMUP, DECAY, LR, MIN_LR = 3, 8, 1e-3, 1e-4
UPDATES, MINI_BATCHES = 3, 2


def expected_lr(step: int) -> float:
    """Megatron's OptimizerParamScheduler at optimizer step `step` (from 1): linear warmup from 0, cosine to MIN_LR."""
    if step <= WARMUP:
        return LR * step / WARMUP
    ratio = min(step - WARMUP, DECAY - WARMUP) / (DECAY - WARMUP)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (math.cos(math.pi * ratio) + 1)


def _dpo_rank(rank: int, world: int) -> dict[str, list[float]]:
    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, ModelConfig, OptimConfig

    optim = OptimConfig(lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP, lr_decay_style="cosine", lr_decay_steps=DECAY)
    cfg = ActorConfig(world_size=world, optim=optim, mini_batches=MINI_BATCHES, micro_batch_size=2, use_ref=True)
    actor = MegatronActor(rank, world, ModelConfig(hf_config=HF), cfg)
    actor.initialize(("127.0.0.1", 0))  # the harness already started torch.distributed
    gen = torch.Generator().manual_seed(0)
    logged, after = [], []
    for _ in range(UPDATES):
        pairs = 2 * MINI_BATCHES  # one pair per micro-batch of 2 sequences
        batch = TrainBatch(
            [[1, 2, 3]] * (2 * pairs),
            torch.randint(1, 90, (2 * pairs, 4), generator=gen),
            torch.ones(2 * pairs, 4),
            {"ref_logprobs": torch.full((2 * pairs, 4), -4.0)},
        )
        logged.append(actor.dpo_update(batch, 0.1, "sigmoid").payload["actor/lr"])
        after.append(float(actor.optimizer.param_groups[0]["lr"]))
    return {"logged": logged, "after": after}


def test_dpo_steps_follow_the_warmup_and_decay() -> None:
    from mcore_rl.parallel.harness import run_on_ranks

    (got,) = run_on_ranks(_dpo_rank, 1)
    steps = [range(MINI_BATCHES * u + 1, MINI_BATCHES * (u + 1) + 1) for u in range(UPDATES)]
    # the lr the next optimizer step runs at, after 2, 4, 6 steps: warmup's end at 3, then the decay
    assert got["after"] == pytest.approx([expected_lr(s[-1] + 1) for s in steps], rel=1e-6)
    # actor/lr: the mean over an update's optimizer steps of the lr each ran at (as the RL update logs it)
    assert got["logged"] == pytest.approx([sum(map(expected_lr, s)) / MINI_BATCHES for s in steps], rel=1e-6)
