"""Rollout samples -> the actor's TrainBatch, and token-weighted metric reduction across ranks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.actor.batch import TrainBatch
from mcore_rl.rollout.sampling import Sample


def samples_to_batch(samples: Sequence[Sample], n: int) -> tuple[TrainBatch, torch.Tensor]:
    """Stack samples (prompt-major: prompt i's n samples are i*n .. i*n+n-1) into a TrainBatch and group ids.

    A sample's `loss_mask` (multi-turn: 0 on tool tokens) becomes its row of `response_mask`; the batch then carries
    the response lengths, since the mask no longer sums to them."""
    longest = max(1, max(len(s.response_ids) for s in samples))
    responses = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest)
    rollout_logp = torch.zeros(len(samples), longest)
    for i, s in enumerate(samples):
        r = len(s.response_ids)
        responses[i, :r] = torch.as_tensor(s.response_ids, dtype=torch.long)
        mask[i, :r] = 1.0 if s.loss_mask is None else torch.as_tensor(s.loss_mask, dtype=torch.float32)
        rollout_logp[i, :r] = torch.as_tensor(s.response_logprobs, dtype=torch.float32)
    batch = TrainBatch(
        prompts=[list(s.prompt_ids) for s in samples],
        responses=responses,
        response_mask=mask,
        tensors={"rollout_logprobs": rollout_logp},
        lengths=None
        if all(s.loss_mask is None for s in samples)
        else torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long),
    )
    if samples and all(s.routed_experts is not None for s in samples):
        # R3: the engine's routing of prompt + response tokens (all but the last), aligned to token positions
        from mcore_rl.actor.router_replay import ROUTED_EXPERTS, routing_tensor

        layers, top_k = samples[0].routed_experts.shape[1:]
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        batch.tensors[ROUTED_EXPERTS] = routing_tensor([s.routed_experts for s in samples], lengths, layers, top_k)
    group_ids = torch.arange(len(samples)) // n
    return batch, group_ids


def reduce_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Token-weighted mean of per-rank metric means (each dict carries its `_tokens`)."""
    tokens = sum(m.get("_tokens", 0.0) for m in per_rank) or 1.0
    keys = {k for m in per_rank for k in m if k != "_tokens"}
    return {k: sum(m.get(k, 0.0) * m.get("_tokens", 0.0) for m in per_rank) / tokens for k in sorted(keys)}
