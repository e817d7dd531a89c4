"""One RL step's metrics under verl's names, so a verl user finds them where they look (verl/trainer/ppo/metric_utils):

    critic/score/{mean,max,min}            sequence rewards from the reward function
    critic/advantages/{mean,max,min}       over response tokens
    response_length/{mean,max,min,clip_ratio}, prompt_length/{mean,max,min}
    actor/{pg_loss,pg_clipfrac,ppo_kl,entropy,grad_norm,kl_loss,kl_ref}   (from the actor ranks)
    timing_s/{gen,reward,old_log_prob,adv,update_actor,update_weights,testing,step}   the step's phases (StepTimer laps)
    timing_per_token_ms/<phase>            gen per response token, the actor phases per prompt+response token
    perf/{total_num_tokens,time_per_step,throughput}   throughput: tokens per second per actor rank (verl: per GPU)
    perf/tokens_per_s/<phase>              tokens per second of each phase (all ranks together)
    perf/mfu/{update_actor,old_log_prob}   model FLOPs utilisation, on CUDA only (6 N / 2 N FLOPs per token)
    rollout/logprob_abs_diff               |engine logprob - Megatron logprob| per token (weight-sync exactness)
    critic/rewards/{mean,max,min}          sequence rewards after the in-reward KL penalty (= score without one)
    critic/{values,returns}/{mean,max,min}, critic/vf_explained_var   with a critic (GAE)
    response_length_non_aborted/*, response/aborted_ratio   over samples with a non-empty response (verl: aborted =
                                           response length 0)
    prompt_length/clip_ratio               prompts at data.max_prompt_length
    rollout_corr/{kl,k3_kl,training_ppl,rollout_ppl,log_ppl_diff,...,chi2_token,chi2_seq}   verl's off-policy
                                           diagnostics of engine vs Megatron logprobs; rollout_corr/rollout_is_* of
                                           the importance weights when rollout correction is on
    actor/kl_coef                          the KL loss's coefficient (when a KL loss is on)
    training/{global_step,epoch}           the step and the data epoch it drew from
    perf/cpu_memory_used_gb                the host's used memory (psutil, as verl)
    timing_s/ref, timing_per_token_ms/ref  the reference's logprob pass (inside timing_s/old_log_prob), max over ranks
    perf/max_memory_{allocated,reserved}_gb   the actor ranks' CUDA peaks, max over ranks; not on CPU
                                           (both from the actor's update: actor/rank_stats.py)

Our own names exist only where verl has none (rollout/logprob_abs_diff, perf/tokens_per_s/*, weight_version,
rollout_corr/mismatch_* and is_truncated_frac from algorithms/mismatch.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: Phases counted in response tokens (generation); the rest process prompt + response tokens.
RESPONSE_TOKEN_PHASES = ("gen",)
#: Phases whose FLOPs are a forward only (2 N per token) or forward + backward (6 N per token), per pass.
FORWARD_PHASES = {"old_log_prob": 2}
TRAIN_PHASES = {"update_actor": 6}
#: Dense bf16 peak FLOP/s per GPU by the name CUDA reports (datasheet figures, no sparsity).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "B200": 2250e12}


def peak_flops(device_name: str | None) -> float | None:
    """Dense bf16 peak of the named GPU, or None (CPU, unknown GPU: then no MFU is reported)."""
    if not device_name:
        return None
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in device_name.split() or any(word.startswith(key) for word in device_name.split()):
            return flops
    return None


@dataclass(frozen=True)
class FlopsModel:
    """What MFU needs: parameters active per token, passes per phase, the peak of one rank's GPU, rank count."""

    active_params: float  #: dense + routed experts x top_k / num_experts
    peak_flops_per_rank: float
    ranks: int
    passes: Mapping[str, int]  #: forward passes per phase: old_log_prob 1 or 2 (with the reference), update epochs

    @classmethod
    def for_run(cls, cfg: Any, hf: Mapping[str, Any], device_name: str | None) -> FlopsModel | None:
        """The run's model on its actor ranks' GPU (`device_name` as CUDA reports it); None on CPU."""
        from mcore_rl.models.estimate import count_params

        peak = peak_flops(device_name)
        if peak is None:
            return None
        counts = count_params(hf)
        experts = int(hf.get("n_routed_experts") or hf.get("num_experts") or hf.get("num_local_experts") or 0)
        top_k = int(hf.get("num_experts_per_tok") or 0)
        active = counts.dense + (counts.expert * top_k / experts if experts else 0.0)
        passes = {"old_log_prob": 2 if cfg.actor.use_ref else 1, "update_actor": cfg.actor.ppo_epochs}
        return cls(active, peak, cfg.actor.world_size, passes)

    def mfu(self, phase: str, tokens: float, seconds: float) -> float | None:
        per_token = FORWARD_PHASES.get(phase) or TRAIN_PHASES.get(phase)
        if per_token is None or seconds <= 0:
            return None
        flops = per_token * self.active_params * tokens * self.passes.get(phase, 1)
        return flops / (seconds * self.peak_flops_per_rank * self.ranks)


def _stats(name: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    values = values.float()
    return {
        f"{name}/mean": float(values.mean()),
        f"{name}/max": float(values.max()),
        f"{name}/min": float(values.min()),
    }


# verl's bound on log-ratios before exp in its chi-square diagnostics (rollout_corr_helper.SAFETY_BOUND)
_LOG_RATIO_BOUND = 20.0


def offpolicy_metrics(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's rollout_corr/* diagnostics of the Megatron (training) vs engine (rollout) logprobs, by its leaf names:
    KL(rollout || training) directly (kl) and by k3, per-sequence perplexities and their log difference, chi-square
    of the token and sequence ratios."""
    from mcore_rl.algorithms import masked_mean

    mask = mask.float()
    tokens = mask.sum(-1).clamp_min(1)
    seq_old, seq_rollout = (old * mask).sum(-1) / tokens, (rollout * mask).sum(-1) / tokens
    log_ratio = old - rollout
    log_ppl_diff = seq_rollout - seq_old
    seq_log_ratio = (log_ratio * mask).sum(-1).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    out = {
        "training_ppl": torch.exp(-seq_old).mean(),
        "training_log_ppl": (-seq_old).mean(),
        "kl": masked_mean(rollout - old, mask),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
        "rollout_ppl": torch.exp(-seq_rollout).mean(),
        "rollout_log_ppl": (-seq_rollout).mean(),
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.max(),
        "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "chi2_token": masked_mean(torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)).square(), mask) - 1,
        "chi2_seq": torch.exp(2.0 * seq_log_ratio).mean() - 1,
    }
    return {f"rollout_corr/{k}": float(v) for k, v in out.items()}


def host_memory_gb() -> float | None:
    """Used host memory in GB (psutil's virtual_memory().used, verl's perf/cpu_memory_used_gb); None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().used / 1024**3


def step_metrics(
    batch: Any,
    scores: torch.Tensor,
    actor: Mapping[str, float],
    laps: Mapping[str, float],
    *,
    max_response_length: int,
    actor_ranks: int,
    flops: FlopsModel | None = None,
    max_prompt_length: int | None = None,
    reward_kl: tuple[float, str] | None = None,
    kl_loss_coef: float = 0.0,
) -> dict[str, float]:
    """The step's metrics (module docstring) from its scored batch, the actor's reduced metrics and the phase laps.

    `reward_kl` = (coefficient, estimator) of the in-reward KL penalty the advantages used, for critic/rewards."""
    from mcore_rl.algorithms import kl_penalty, masked_mean

    mask, tensors = batch.response_mask, batch.tensors
    response_len = mask.sum(1)
    prompt_len = torch.tensor([len(p) for p in batch.prompts], dtype=torch.float32)
    out: dict[str, float] = {}
    out.update(_stats("critic/score", scores))
    rewards = scores.float()
    if reward_kl is not None and "ref_logprobs" in tensors:  # the sequence reward the estimator saw
        token_kl = kl_penalty(tensors["old_logprobs"], tensors["ref_logprobs"], reward_kl[1]) * mask
        rewards = rewards - reward_kl[0] * token_kl.sum(-1)
    out.update(_stats("critic/rewards", rewards))
    valid = mask.bool()
    if "advantages" in tensors:
        out.update(_stats("critic/advantages", tensors["advantages"][valid]))
    if "returns" in tensors:
        out.update(_stats("critic/returns", tensors["returns"][valid]))
    if "values" in tensors:
        values = tensors["values"][valid]
        out.update(_stats("critic/values", values))
        if "returns" in tensors and values.numel() > 1:
            returns = tensors["returns"][valid]
            out["critic/vf_explained_var"] = float(1.0 - (returns - values).var() / (returns.var() + 1e-5))
    out.update(_stats("response_length", response_len))
    out["response_length/clip_ratio"] = float((response_len >= max_response_length).float().mean())
    aborted = response_len == 0
    out.update(_stats("response_length_non_aborted", response_len[~aborted]))
    if (~aborted).any():
        kept = response_len[~aborted]
        out["response_length_non_aborted/clip_ratio"] = float((kept >= max_response_length).float().mean())
    out["response/aborted_ratio"] = float(aborted.float().mean())
    out.update(_stats("prompt_length", prompt_len))
    if max_prompt_length is not None:
        out["prompt_length/clip_ratio"] = float((prompt_len >= max_prompt_length).float().mean())
    if "old_logprobs" in tensors and "rollout_logprobs" in tensors:
        diff = (tensors["old_logprobs"] - tensors["rollout_logprobs"]).abs()
        out["rollout/logprob_abs_diff"] = float(masked_mean(diff, mask))
        if mask.any():
            out.update(offpolicy_metrics(tensors["old_logprobs"], tensors["rollout_logprobs"], mask))
    if "importance_weights" in tensors:
        out.update(_stats("rollout_corr/rollout_is", tensors["importance_weights"][valid]))
        out = {k.replace("rollout_is/", "rollout_is_"): v for k, v in out.items()}
    if kl_loss_coef > 0:
        out["actor/kl_coef"] = kl_loss_coef
    memory = host_memory_gb()
    if memory is not None:
        out["perf/cpu_memory_used_gb"] = memory
    if "ref_logprobs" in tensors:  # only where a reference pass ran: KL(old policy || reference), k3
        out["actor/kl_ref"] = float(
            masked_mean(kl_penalty(tensors["old_logprobs"], tensors["ref_logprobs"], "low_var_kl"), mask)
        )
    out.update(actor)

    response_tokens = float(response_len.sum())
    all_tokens = response_tokens + float(prompt_len.sum())
    step_s = sum(laps.values())
    for phase, seconds in laps.items():
        out[f"timing_s/{phase}"] = seconds
        tokens = response_tokens if phase in RESPONSE_TOKEN_PHASES else all_tokens
        if seconds > 0 and tokens > 0 and phase not in ("reward", "adv", "testing"):
            out[f"timing_per_token_ms/{phase}"] = 1000.0 * seconds / tokens
            out[f"perf/tokens_per_s/{phase}"] = tokens / seconds
        if flops is not None:
            mfu = flops.mfu(phase, tokens, seconds)
            if mfu is not None:
                out[f"perf/mfu/{phase}"] = mfu
    ref_s = actor.get("timing_s/ref")
    if ref_s is not None and ref_s > 0 and all_tokens > 0:  # verl counts the reference pass over all tokens
        out["timing_per_token_ms/ref"] = 1000.0 * ref_s / all_tokens
    out["timing_s/step"] = step_s
    out["perf/total_num_tokens"] = all_tokens
    out["perf/time_per_step"] = step_s
    out["perf/throughput"] = all_tokens / (step_s * actor_ranks) if step_s > 0 else 0.0
    return out
