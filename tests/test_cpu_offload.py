"""Colocated placement on the CPU runtime (actor/offload.py): while the engines generate, a rank frees its gradient
buffers and weight-sync buckets instead of moving state that already lives in host memory, and gets the gradient
buffers back, zeroed, before it trains. Training is then the same to the bit as without the round trip.
Run: `.venv/bin/pytest tests/test_cpu_offload.py`
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama


def _rank(rank: int, world: int, round_trip: bool):
    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, ModelConfig

    actor = MegatronActor(
        rank, world, ModelConfig(hf_config=tiny_llama()),
        ActorConfig(world_size=1, mini_batches=1, micro_batch_size=2, logprob_micro_batch_size=4),
    )  # fmt: skip
    actor.initialize(("127.0.0.1", 0))
    gen = torch.Generator().manual_seed(0)

    def batch() -> TrainBatch:
        prompts = [torch.randint(3, 60, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(4)]  # fmt: skip
        return TrainBatch(
            prompts, torch.randint(3, 60, (4, 3), generator=gen), torch.ones(4, 3),
            {"rollout_logprobs": torch.full((4, 3), -3.0), "advantages": torch.randn(4, 3, generator=gen)},
        )  # fmt: skip

    report = {}
    metrics = [actor.logprobs_and_update(batch()).payload["metrics"]]
    grads = [b.grad_data for ddp in actor.ddp_chunks for b in ddp.buffers]  # every main_grad is a view of one
    grad_bytes = sum(t.numel() * t.element_size() for t in grads)
    if round_trip:
        report = actor.offload()
        report["storage_after_offload"] = sum(t.untyped_storage().size() for t in grads)
        report["second_offload"] = actor.offload()
        actor.onload()
        report["zeroed"] = all(not bool(t.any()) for t in grads)
    metrics.append(actor.logprobs_and_update(batch()).payload["metrics"])
    params = {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters()}
    return report, grad_bytes, metrics, params


@pytest.mark.slow
def test_a_cpu_rank_frees_its_gradient_buffers_between_steps_and_trains_the_same() -> None:
    from mcore_rl.parallel.harness import run_on_ranks

    ((report, grad_bytes, metrics, params),) = run_on_ranks(_rank, 1, (True,))
    ((_, _, control_metrics, control_params),) = run_on_ranks(_rank, 1, (False,))
    assert grad_bytes > 0 and report["grad_buffers"] == grad_bytes and report["freed"] >= grad_bytes
    assert report["bytes"] == 0, "nothing moves on the CPU runtime"
    assert report["storage_after_offload"] == 0, "the gradient buffers still hold their storage"
    assert report["second_offload"]["freed"] == 0, "a second offload freed again"
    assert report["zeroed"], "onload gave the gradient buffers back with stale values"
    assert metrics == control_metrics
    assert params.keys() == control_params.keys()
    assert all(torch.equal(params[n], control_params[n]) for n in params)
