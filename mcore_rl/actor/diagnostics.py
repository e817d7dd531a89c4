"""Forward passes for checks, not for training: the policy's full-vocabulary logits (parity against the rollout engine
and HF) and the experts its routers choose (against the engine's routed experts). MegatronActor.forward_logits /
router_choices call these under no_grad and return what the output ranks hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from mcore_rl.actor.batch import TrainBatch, micro_batches
from mcore_rl.actor.schedule import run_schedule


def forward_logits(actor: Any, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [B_dp, T, vocab] of this rank's dp shard of `tokens` (TP-gathered, padding trimmed).

    For parity checks against the rollout engine and HF; not used in training.
    """
    for chunk in actor.ddp_chunks:
        chunk.eval()
    shard = tokens.chunk(actor.pg.dp.size())[actor.pg.dp.rank()].to(actor.device)
    tp = actor.pg.tp.size()

    def forward_step(data_iterator: Iterator[torch.Tensor], model: torch.nn.Module):
        ids = next(data_iterator)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        out = model(input_ids=ids, position_ids=positions, attention_mask=None)

        def gather(logits: torch.Tensor):
            parts = [torch.empty_like(logits) for _ in range(tp)]
            torch.distributed.all_gather(parts, logits.contiguous(), group=actor.pg.tp)
            return logits.new_zeros(()), {"logits": torch.cat(parts, -1)[..., : actor.vocab_size]}

        return out, gather

    outputs = run_schedule(actor.ddp_chunks, forward_step, [shard], shard.shape[1], shard.shape[0], actor.pg, True)
    return outputs[0]["logits"] if outputs else None


def router_choices(actor: Any, batch: TrainBatch, replay: bool = True) -> torch.Tensor:
    """The experts the policy's routers dispatched each token to in a forward over this rank's dp shard, int32
    [B_dp, T, num_hidden_layers, k] (sorted per token, -1 in layers not on this rank), with the configured
    routing replay (or without it); for checks against the rollout engine's routed experts, not used in training.
    """
    from mcore_rl.actor.router_replay import capture_router_choices

    for chunk in actor.ddp_chunks:
        chunk.eval()
    batch.tensors["sample_index"] = torch.arange(batch.size)
    shard = batch.shard(actor.pg.dp.rank(), actor.pg.dp.size())
    mbs, seq_len = micro_batches(shard, shard.size, actor._pad_multiple, device=actor.device)  # one capture
    layers = actor.spec.hf.req("num_hidden_layers")
    handles, captured = capture_router_choices(actor.ddp_chunks, shard.size, layers)
    if replay and actor.routing is not None:
        actor.routing.begin("update")  # what the update's forwards route by
    try:
        actor._run_schedule(actor.ddp_chunks, mbs, seq_len, lambda mb, logits: (logits.new_zeros(()), {}), True)
    finally:
        if actor.routing is not None:
            actor.routing.end()
        for handle in handles:
            handle.remove()
    out = torch.full((shard.size, seq_len, layers, actor.spec.transformer_config().moe_router_topk), -1)
    for layer, choices in captured.items():
        local = choices.reshape(-1, shard.size, choices.shape[-1])  # [s, b, k] (pp=1, no sp: full sequence)
        out[:, : local.shape[0], layer] = local.transpose(0, 1)
    return out.to(torch.int32)
