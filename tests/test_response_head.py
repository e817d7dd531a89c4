"""The output layer narrowed to response positions (actor/logprobs.py ResponseHead): the vocabulary projection runs
over the rows that predict response tokens only, and the logprobs, the update's loss and metrics and the updated
weights are those of the full projection.

The same seeded tiny Llama and batch on two ranks (tp 2 without sequence parallelism: the vocabulary split over
the ranks; and dp 2), with MegatronActor.response_head on and off.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_llama


def _batch() -> object:
    from mcore_rl.actor.batch import TrainBatch

    gen = torch.Generator().manual_seed(0)  # the same batch on both ranks, as the controller sends it
    prompts = [torch.randint(3, 50, (int(torch.randint(4, 9, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(8)]  # fmt: skip
    lengths = torch.tensor([3, 1, 2, 3, 3, 2, 1, 3])
    mask = (torch.arange(3)[None] < lengths[:, None]).float()
    return TrainBatch(prompts, torch.randint(3, 50, (8, 3), generator=gen) * mask.long(), mask,
                      {"old_logprobs": torch.full((8, 3), -3.0) * mask,
                       "advantages": torch.randn(8, 3, generator=gen) * mask})  # fmt: skip


def _rank(rank: int, world: int, tp: int, narrow: bool, sequence_parallel: bool = False):
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig

    actor = MegatronActor(
        rank, world, ModelConfig(hf_config=tiny_llama(vocab_size=50)),
        ActorConfig(world_size=2, layout=LayoutConfig(tp=tp, sequence_parallel=sequence_parallel), mini_batches=1,
                    micro_batch_size=2, logprob_micro_batch_size=4),
    )  # fmt: skip
    actor.initialize(("127.0.0.1", 0))
    actor.response_head = narrow
    rows = []
    from mcore_rl.actor.logprobs import narrowable_output_layer

    layer = narrowable_output_layer(actor.ddp_chunks[0])
    if layer is not None:  # the sequence positions the vocabulary projection ran over, per forward
        layer.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    logprobs = actor.logprobs(_batch()).payload
    metrics = actor.update(_batch()).payload
    params = {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters()}
    return logprobs, metrics, params, rows, layer is not None


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_at_response_positions_only_give_the_full_projections_results(tp: int) -> None:
    from mcore_rl.parallel.harness import run_on_ranks

    narrow = run_on_ranks(_rank, 2, (tp, True))
    full = run_on_ranks(_rank, 2, (tp, False))
    for (lp_n, m_n, p_n, rows_n, _), (lp_f, m_f, p_f, rows_f, _) in zip(narrow, full):
        # the projection ran over the response's 3 positions, not the micro-batch's prompt + response (up to 12)
        assert set(rows_n) == {3} and min(rows_f) > 3
        if lp_n is not None:  # the ranks that hold the output
            assert lp_n.shape == lp_f.shape
            torch.testing.assert_close(lp_n, lp_f, rtol=0, atol=1e-6)
            assert m_n.keys() == m_f.keys() and m_n["actor/pg_loss"] != 0
            for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
                assert m_n[key] == pytest.approx(m_f[key], rel=1e-5), key
        assert p_n.keys() == p_f.keys()
        for name in p_n:
            torch.testing.assert_close(p_n[name], p_f[name], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_sequence_parallelism_keeps_the_full_projection() -> None:
    """With sequence parallelism the output layer's input is this rank's slice of the sequence, so positions of the
    whole sequence cannot be picked there: the layer is not narrowed, and the run is what it was."""
    from mcore_rl.parallel.harness import run_on_ranks

    for _, metrics, _, rows, narrowable in run_on_ranks(_rank, 2, (2, True, True)):
        assert not narrowable and rows == []
        if metrics is not None:
            assert metrics["actor/pg_loss"] != 0


@pytest.mark.slow
def test_a_tensor_parallel_shard_holding_only_padding_gives_finite_logprobs() -> None:
    """A 50-token vocabulary padded to 128 over tp 2: rank 1's shard is all padding. Its target logit was gathered
    from a -inf column and multiplied by 0 (NaN), and the all-reduce spread the NaN to every logprob and the loss."""
    from mcore_rl.parallel.harness import run_on_ranks

    for lp, metrics, params, _, _ in run_on_ranks(_rank, 2, (2, False)):
        if lp is not None:
            assert torch.isfinite(lp).all() and (lp[_batch().response_mask.bool()] < 0).all()  # 0 past the end
            assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/pg_loss"] != 0
        assert all(torch.isfinite(p).all() for p in params.values())
