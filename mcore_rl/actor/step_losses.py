"""The losses a Megatron worker's update runs per micro-batch, and how their metrics add up over micro-batches.

    loss, metrics = policy_loss(actor, mb, logits, denominator, scale)    # role "actor"
    loss, metrics = value_loss(actor, mb, values, denominator, scale)     # role "critic"
    means = sum_metrics(outputs)                                          # the schedule's loss dicts -> token means

Metrics are token-weighted sums per micro-batch (`_tokens` carries the weight); `sum_metrics` divides once.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_rl.actor.batch import MicroBatch
from mcore_rl.actor.logprobs import response_positions, vocab_parallel_entropy, vocab_parallel_entropy_grad
from mcore_rl.actor.packing import unpack_rows
from mcore_rl.algorithms import aggregate_loss, get_policy_loss, kl_loss

#: loss metric -> the name verl logs it under (actor/pg_clipfrac ...), where the two differ
_VERL_NAMES = {"clip_frac": "pg_clipfrac", "clip_frac_lower": "pg_clipfrac_lower"}


def value_loss(actor: Any, mb: MicroBatch, output: torch.Tensor, denominator: float, scale: float):
    """The critic's clipped value loss of one micro-batch (actor/value_head.py), scaled for Megatron's schedule."""
    from mcore_rl.actor.value_head import critic_loss, response_values

    values = unpack_rows(mb, response_values(output, mb.gather_index))
    loss, metrics = critic_loss(actor.cfg, values, mb.tensors, mb.response_mask, denominator)
    return loss * scale, metrics


def policy_loss(actor: Any, mb: MicroBatch, logits: torch.Tensor, denominator: float, scale: float):
    """The policy loss of one micro-batch (PPO-clip / GSPO, optional KL to the reference and entropy bonus) and its
    token-weighted metric sums, scaled for Megatron's schedule (x dp x micro-batches: see MegatronActor._update)."""
    cfg = actor.cfg
    logp = actor._response_logprobs(mb, logits)
    mask = mb.response_mask
    if "old_logprobs" not in mb.tensors and getattr(actor, "update_old_logprobs", None) is not None:
        # the old-logprob pass was redundant (MegatronActor._old_pass_redundant): this forward is that pass
        mb.tensors["old_logprobs"] = logp.detach() * mask
        actor.update_old_logprobs.append((mb.tensors["sample_index"], mb.tensors["old_logprobs"]))
    extra = {"clip_ratio_c": cfg.clip_ratio_c} if cfg.policy_loss == "ppo" else {}
    # Rollout correction (controller/advantage_stage.py) weighs every token, stale ones included; without it, tokens
    # sampled by an older weight version (generation ahead of training) still get TIS by default.
    weights = mb.tensors.get("importance_weights")
    if weights is None:
        weights = stale_tis_weights(mb.tensors, mask, cfg.stale_tis_cap)
    out = get_policy_loss(cfg.policy_loss)(
        logp,
        mb.tensors["old_logprobs"],
        mb.tensors["advantages"],
        mask,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        **extra,
        loss_agg_mode=cfg.loss_agg_mode,
        max_response_len=mask.shape[1],
        agg_denominator=denominator,
        importance_weights=weights,
    )
    loss = out.loss
    # Metrics are token-weighted sums here and divided by the token count in the controller.
    weight = float(mask.sum())
    metrics = {
        f"actor/{_VERL_NAMES.get(k, k)}": float(v.detach() if torch.is_tensor(v) else v) * weight
        for k, v in out.metrics.items()
    }
    # loss x denominator = this micro-batch's summed token losses (token-mean) or sequence losses.
    metrics["actor/pg_loss"] = float(out.loss.detach()) * denominator
    if "ref_logprobs" in mb.tensors:
        kl = kl_loss(
            logp,
            mb.tensors["ref_logprobs"],
            mask,
            kind=cfg.kl_loss_type,
            loss_agg_mode=cfg.loss_agg_mode,
            max_response_len=mask.shape[1],
            agg_denominator=denominator,
        )
        metrics["actor/kl_loss"] = float(kl.detach()) * denominator
        if cfg.kl_loss_coef:
            loss = loss + cfg.kl_loss_coef * kl
    if cfg.entropy_coef:  # the bonus: maximise the aggregated token entropy
        rows = response_positions(logits, mb.gather_index)
        entropy = unpack_rows(mb, vocab_parallel_entropy_grad(rows, actor.vocab_size, actor.pg.tp))
        loss = loss - cfg.entropy_coef * aggregate_loss(
            entropy, mask, cfg.loss_agg_mode, max_response_len=mask.shape[1], denominator=denominator
        )
    else:  # the metric only: no graph, its temporaries a chunk at a time
        with torch.no_grad():
            rows = response_positions(logits, mb.gather_index)
            entropy = unpack_rows(mb, vocab_parallel_entropy(rows, actor.vocab_size, actor.pg.tp))
    metrics["actor/entropy"] = float((entropy.detach() * mask).sum())
    metrics["_tokens"] = weight
    return loss * scale, metrics


def stale_tis_weights(tensors: dict[str, torch.Tensor], mask: torch.Tensor, cap: float | None) -> torch.Tensor | None:
    """TIS weights min(pi_old / pi_rollout, cap) on the stale tokens (sampled by an older weight version than the one
    the step trains from: generation ahead of training), 1 on the others; None when no token is stale or the
    correction is off. `stale` is [B, T], one flag per token (controller/async_producer.py), so a sample that spans
    a push is weighted on its old tokens only; a [B] flag marks whole samples."""
    stale = tensors.get("stale")
    if stale is None or cap is None or not bool(stale.any()):
        return None
    from mcore_rl.algorithms.mismatch import truncated_importance_weights

    tis = truncated_importance_weights(tensors["old_logprobs"], tensors["rollout_logprobs"], mask, cap=cap)
    stale = stale.to(mask)
    if stale.dim() == 1:
        stale = stale.unsqueeze(1)
    return stale * tis + (1 - stale) * mask


def sum_metrics(outputs: list[dict[str, float]]) -> dict[str, float]:
    """Token-weighted metric sums of the micro-batches -> means over this rank's tokens, keeping the token count."""
    if not outputs:
        return {}
    tokens = sum(o["_tokens"] for o in outputs)
    keys = {k for o in outputs for k in o if k != "_tokens"}
    out = {k: sum(o.get(k, 0.0) for o in outputs) / max(tokens, 1.0) for k in keys}
    out["_tokens"] = tokens
    return out
