"""One DPO update on a Megatron actor rank: preference pairs through Megatron's schedule, the pair loss, optimizer step.

    TrainBatch of 2P sequences, interleaved [chosen_0, rejected_0, chosen_1, ...] with "ref_logprobs" [2P, R]
      -> mini-batches (`actor.mini_batches`) -> dp shard -> micro-batches (all of even size, so a pair never splits)
      -> per micro-batch: token logprobs -> sequence logprobs -> algorithms.dpo loss over its pairs
      -> backward (Megatron's schedule), finalize grads, optimizer step, lr schedule step (actor.optim.lr_*)

The loss of a micro-batch is the sum of its pair losses divided by the mini-batch's pair count (over all dp ranks),
times dp x micro-batches (Megatron averages gradients over dp and scales each micro-batch's loss by 1/num_microbatches
when it has no token count), so that the gradient is that of the mean pair loss of the mini-batch.
Called by `MegatronActor.dpo_update`; the loop is `mcore_rl/controller/dpo_loop.py`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from mcore_rl.actor.batch import MicroBatch, TrainBatch, micro_batches, sequence_length
from mcore_rl.algorithms.dpo import dpo_loss, get_dpo_loss, sequence_logprobs

if TYPE_CHECKING:
    from mcore_rl.actor.megatron_actor import MegatronActor


def check_pairs(batch: TrainBatch, parts: int, micro_batch_size: int) -> None:
    """Refuse a split that would put a pair's chosen and rejected sequences into different micro-batches."""
    if batch.size % (2 * parts):
        raise ValueError(f"{batch.size} sequences do not split into {parts} parts of whole chosen/rejected pairs")
    if micro_batch_size % 2:
        raise ValueError(f"actor.micro_batch_size={micro_batch_size} must be even for DPO (a pair per 2 sequences)")


def dpo_update(actor: MegatronActor, batch: TrainBatch, beta: float, loss_type: str) -> dict[str, float]:
    """DPO update over `actor.cfg.mini_batches` mini-batches; returns this rank's pair-weighted mean metrics."""
    cfg = actor.cfg
    dp_rank, dp_size = actor.pg.dp.rank(), actor.pg.dp.size()
    check_pairs(batch, cfg.mini_batches * dp_size, cfg.micro_batch_size)
    length_normalized = get_dpo_loss(loss_type).length_normalized
    for chunk in actor.ddp_chunks:
        chunk.train()
    totals: dict[str, float] = {}
    steps = 0
    for _ in range(cfg.ppo_epochs):
        for mini in batch.chunks(cfg.mini_batches):
            pairs = mini.size // 2
            shard = mini.shard(dp_rank, dp_size)
            # No token budget here: it could cut an odd micro-batch size and split a pair.
            mbs, seq_len = micro_batches(
                shard, cfg.micro_batch_size, actor._pad_multiple, None, sequence_length(mini), device=actor.device
            )
            scale = dp_size * len(mbs)

            def loss_fn(mb: MicroBatch, logits: torch.Tensor, pairs: int = pairs, scale: int = scale) -> Any:
                token_logp = actor._response_logprobs(mb, logits)
                mask = mb.response_mask
                policy = sequence_logprobs(token_logp, mask, length_normalized)
                ref = sequence_logprobs(mb.tensors["ref_logprobs"], mask, length_normalized)
                out = dpo_loss(loss_type, policy[0::2], policy[1::2], ref[0::2], ref[1::2], beta)
                metrics = {k: float(v) for k, v in out.metrics().items()}
                metrics["_tokens"] = float(out.losses.numel())  # weights of the cross-rank mean: pairs
                return out.losses.sum() / pairs * scale, metrics

            for chunk in actor.ddp_chunks:
                chunk.zero_grad_buffer()
            actor.optimizer.zero_grad()
            outputs = actor._run_schedule(actor.ddp_chunks, mbs, seq_len, loss_fn, forward_only=False)
            lr = float(actor.optimizer.param_groups[0]["lr"])
            ok, grad_norm, _ = actor.optimizer_step()
            # the schedule counts optimizer steps, as the RL update does (actor/optimizer.py lr_scheduler): without
            # this, lr_warmup / lr_decay_style left every DPO step at the schedule's first value
            actor.lr_scheduler.step(1)
            metrics = _pair_means(outputs)
            metrics["actor/grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
            metrics["actor/update_ok"] = float(bool(ok))
            metrics["actor/lr"] = lr
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
            steps += 1
    return {k: v / steps for k, v in totals.items()}


def _pair_means(outputs: list[dict[str, float]]) -> dict[str, float]:
    if not outputs:
        return {}
    pairs = sum(o["_tokens"] for o in outputs)
    out = {k: sum(o[k] for o in outputs) / max(pairs, 1.0) for k in outputs[0] if k != "_tokens"}
    out["_tokens"] = pairs
    return out
