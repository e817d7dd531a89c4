"""The actor's one-call step (`MegatronActor.logprobs_and_update`) against the two calls it replaces.

The loop runs the old-logprob pass inside the update call when the advantages do not read old logprobs
(train.py). It must compute what `policy_and_ref_logprobs` + the controller's gather + `update` compute: the same
old and reference logprobs, the same update metrics and the same parameters after it, to the bit.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen3_moe


def _rank(rank: int, world: int, fused: bool):
    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig

    # EP2 over 2 ranks (dense dp 2), two mini-batches: the second mini-batch of rank 0 reads old logprobs that
    # rank 1's logprob pass computed, so the shards' gather is exercised; a reference model, so its pass is too.
    actor = MegatronActor(
        rank, world, ModelConfig(hf_config=tiny_qwen3_moe(vocab_size=50)),
        ActorConfig(world_size=2, layout=LayoutConfig(ep=2), use_ref=True, kl_loss_coef=0.1, mini_batches=2),
    )  # fmt: skip
    actor.initialize(("127.0.0.1", 0))
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
    with torch.no_grad():  # let the policy differ from the reference, so the KL term is not zero
        for p in actor.chunks[0].parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    if fused:
        out = actor.logprobs_and_update(batch, use_ref=True).payload
        old, ref, metrics = out["old_logprobs"], out["ref_logprobs"], out["metrics"]
    else:
        both = actor.policy_and_ref_logprobs(batch).payload  # this rank's dp shard, [B/dp, 2, R]
        whole = torch.empty((both.shape[0] * 2, *both.shape[1:]))
        torch.distributed.all_gather_into_tensor(whole, both.contiguous(), group=actor.pg.dp)  # the controller
        batch.tensors["old_logprobs"], batch.tensors["ref_logprobs"] = whole[:, 0], whole[:, 1]
        old, ref = both[:, 0], both[:, 1]
        metrics = actor.update(batch).payload
    params = {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters()}
    return old, ref, metrics, params


@pytest.mark.slow
def test_logprobs_and_update_in_one_call_equal_the_two_calls_bit_for_bit():
    from mcore_rl.parallel.harness import run_on_ranks

    fused = run_on_ranks(_rank, 2, (True,))
    separate = run_on_ranks(_rank, 2, (False,))
    for (old_f, ref_f, m_f, p_f), (old_s, ref_s, m_s, p_s) in zip(fused, separate):
        assert torch.equal(old_f, old_s) and torch.equal(ref_f, ref_s)
        assert not torch.equal(old_f, ref_f)
        # verl's timing_s/ref: both paths time the reference pass (a clock reading, so not compared)
        assert m_f.pop("timing_s/ref") > 0 and m_s.pop("timing_s/ref") > 0
        assert m_f == m_s and m_f["actor/kl_loss"] != 0
        assert p_f.keys() == p_s.keys() and all(torch.equal(p_f[n], p_s[n]) for n in p_f)
    # the two ranks trained on the same batch with different shards: their logprob shards differ
    assert not torch.equal(fused[0][0], fused[1][0])
