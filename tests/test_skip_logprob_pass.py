"""The old-logprob pass skipped where it is redundant (one mini-batch, one epoch, nothing reading old logprobs
before the update): the update's own forward gives the old logprobs, and the step is the same to the bit.

`MegatronActor.logprobs_and_update` with actor.skip_redundant_logprob_pass on and off, on the same seeded tiny model
and batch over two data-parallel ranks: the same old logprobs, update metrics and parameters, and one forward pass
fewer with the skip.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama, tiny_qwen3_moe


def _rank(rank: int, world: int, skip: bool):
    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig

    # EP2 over 2 ranks (dense dp 2); the logprob pass cuts the same micro-batches as the update, so the pass and the
    # update's forward see the same shapes
    actor = MegatronActor(
        rank, world, ModelConfig(hf_config=tiny_qwen3_moe(vocab_size=50)),
        ActorConfig(world_size=2, layout=LayoutConfig(ep=2), mini_batches=1, micro_batch_size=2,
                    logprob_micro_batch_size=2, skip_redundant_logprob_pass=skip),
    )  # fmt: skip
    actor.initialize(("127.0.0.1", 0))
    passes = []
    shard_logprobs = actor._shard_logprobs
    actor._shard_logprobs = lambda *a, **k: passes.append(1) or shard_logprobs(*a, **k)
    gen = torch.Generator().manual_seed(0)  # the same batch on both ranks, as the controller sends it
    batch = TrainBatch(
        [
            torch.randint(3, 50, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(8)
        ],
        torch.randint(3, 50, (8, 3), generator=gen),
        torch.ones(8, 3),
        {"rollout_logprobs": torch.full((8, 3), -3.0), "advantages": torch.randn(8, 3, generator=gen)},
    )
    out = actor.logprobs_and_update(batch).payload
    params = {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters()}
    return out["old_logprobs"], out["metrics"], params, len(passes)


@pytest.mark.slow
def test_skipping_the_redundant_old_logprob_pass_changes_nothing_but_the_pass() -> None:
    from mcore_rl.parallel.harness import run_on_ranks

    skipped = run_on_ranks(_rank, 2, (True,))
    full = run_on_ranks(_rank, 2, (False,))
    for (old_s, m_s, p_s, passes_s), (old_f, m_f, p_f, passes_f) in zip(skipped, full):
        assert (passes_s, passes_f) == (0, 1)
        assert old_s.shape == old_f.shape and torch.equal(old_s, old_f)
        assert m_s == m_f and m_s["actor/pg_loss"] != 0
        assert p_s.keys() == p_f.keys() and all(torch.equal(p_s[n], p_f[n]) for n in p_s)
    assert not torch.equal(skipped[0][0], skipped[1][0])  # each rank's own shard


def _dynamic_rank(rank: int, world: int, skip: bool):
    """dp 2 with dynamic batching on a tiny dense Llama: the update's shards are balanced by tokens and its
    micro-batches sorted by length, so each rank's update holds samples of the other rank's contiguous shard."""
    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, ModelConfig

    actor = MegatronActor(
        rank, world, ModelConfig(hf_config=tiny_llama()),
        ActorConfig(world_size=2, mini_batches=1, micro_batch_size=2, logprob_micro_batch_size=4,
                    dynamic_batching=True, skip_redundant_logprob_pass=skip),
    )  # fmt: skip
    actor.initialize(("127.0.0.1", 0))
    passes = []
    shard_logprobs = actor._shard_logprobs
    actor._shard_logprobs = lambda *a, **k: passes.append(1) or shard_logprobs(*a, **k)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 6, 2, 5, 6, 3, 1, 4])  # responses of different lengths: sorting reorders them
    mask = (torch.arange(6)[None] < lengths[:, None]).float()
    batch = TrainBatch(
        [torch.randint(3, 64, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
         for _ in range(8)],
        torch.randint(3, 64, (8, 6), generator=gen) * mask.long(), mask,
        {"rollout_logprobs": torch.full((8, 6), -3.0) * mask, "advantages": torch.randn(8, 6, generator=gen) * mask},
    )  # fmt: skip
    out = actor.logprobs_and_update(batch).payload
    params = {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters()}
    return out["old_logprobs"], out["metrics"], params, len(passes)


@pytest.mark.slow
def test_with_dynamic_batching_the_update_gives_the_old_logprobs_in_batch_order() -> None:
    from mcore_rl.parallel.harness import run_on_ranks

    skipped = run_on_ranks(_dynamic_rank, 2, (True,))
    full = run_on_ranks(_dynamic_rank, 2, (False,))
    for (old_s, m_s, p_s, passes_s), (old_f, m_f, p_f, passes_f) in zip(skipped, full):
        assert (passes_s, passes_f) == (0, 1)
        # the pass pads each micro-batch to the shard's longest sample, the update to its own: the same rows up to
        # float summation order, each at its sample's place
        assert old_s.shape == old_f.shape == (4, 6)
        torch.testing.assert_close(old_s, old_f, rtol=0, atol=1e-5)
        assert m_s["actor/pg_loss"] == pytest.approx(m_f["actor/pg_loss"], abs=1e-5) and m_s["actor/pg_loss"] != 0
        for name in p_s:
            torch.testing.assert_close(p_s[name], p_f[name], rtol=0, atol=1e-6)
    assert not torch.equal(skipped[0][0], skipped[1][0])  # each rank's own shard
