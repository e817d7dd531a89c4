"""The Megatron side of a run: the policy model, its parallel layout and optimizer, the actor that trains it and the
PPO critic beside it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.config.checks import ConfigError, _check, _positive
from mcore_rl.parallel.layout import ParallelLayout


@dataclass
class LayoutConfig:
    """Parallel layout of a Megatron model (dp is derived from the world size)."""

    tp: int = 1  #: tensor-parallel size
    pp: int = 1  #: pipeline-parallel size
    cp: int = 1  #: context-parallel size (GPU only)
    ep: int = 1  #: expert-parallel size
    etp: int | None = None  #: expert tensor-parallel size (null = tp)
    vpp: int | None = None  #: virtual pipeline stages per pipeline rank (null = off)
    sequence_parallel: bool = False  #: shard activations along the sequence in TP regions (MoE + tp>1 needs it)
    #: decoder layers on the first pipeline stage (null = even split); e.g. DeepSeek-V3's 61 layers at pp=4: 16
    first_stage_layers: int | None = None
    #: decoder layers on the last pipeline stage (null = even split); MTP layers sit there on top of these
    last_stage_layers: int | None = None

    def to_layout(self) -> ParallelLayout:
        return ParallelLayout(
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
            etp=self.etp,
            vpp=self.vpp,
            sequence_parallel=self.sequence_parallel,
            first_stage_layers=self.first_stage_layers,
            last_stage_layers=self.last_stage_layers,
        )

    def validate(self) -> None:
        self.to_layout()  # ParallelLayout validates sizes and names the field


@dataclass
class ModelConfig:
    """The policy model."""

    path: str | None = None  #: HF checkpoint dir (config.json + safetensors); null = random init from hf_config
    hf_config: dict[str, Any] = field(default_factory=dict)  #: HF config used when path is null
    #: tokenizer dir; null = model.path's own tokenizer when that directory holds one (as verl's model.path), else
    #: the tiny offline tokenizer, written into the run dir (a random-init model.hf_config's)
    tokenizer: str | None = None
    dtype: str = "float32"  #: parameter dtype: float32 | bfloat16
    make_vocab_size_divisible_by: int = 64  #: Megatron pads the vocab to a multiple of this x tp
    #: longest prompt + response the ranks build for and the memory estimate sizes; null = data.max_prompt_length +
    #: rollout.max_new_tokens (agent.max_response_tokens in agent episodes; 512 for DPO): the longest sample the run
    #: can make (a fixed 512 sized the estimate's activations 6x too large for a short-answer task)
    max_sequence_length: int | None = None
    init_seed: int = 1234  #: seed of the random initialisation when path is null
    #: multi-token-prediction layers of a checkpoint whose config asks for them (DeepSeek-V3), for checkpoint checks
    #: and conversion: auto = on when the checkpoint holds their weights, off when it holds none (transformers'
    #: save_pretrained drops them) | on | off. The RL workers never build them (a logprob forward cannot run with
    #: Megatron 0.16.1's MTP, which needs labels): their tensors stay unread, the engines keep theirs
    mtp: str = "auto"

    def validate(self) -> None:
        _check(self.dtype in ("float32", "bfloat16"), "model.dtype", self.dtype, "float32 or bfloat16")
        _check(bool(self.path) or bool(self.hf_config), "model.path", self.path, "a checkpoint dir or model.hf_config")
        if self.max_sequence_length is not None:
            _positive("model.max_sequence_length", self.max_sequence_length)
        _positive("model.make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)
        _check(self.mtp in ("on", "off", "auto"), "model.mtp", self.mtp, "on, off or auto")
        if self.tokenizer is None and self.path and has_tokenizer(self.path):
            # A checkpoint brings its tokenizer: the tiny tokenizer's ids fed to a real model are all < its vocab_size,
            # so nothing else would notice, and the reward would stay 0.
            self.tokenizer = self.path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any one of these in a directory makes it an HF tokenizer directory (fast, config, sentencepiece, BPE vocab)."""


def has_tokenizer(path: str) -> bool:
    """Whether the directory `path` holds an HF tokenizer (one of TOKENIZER_FILES)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)


@dataclass
class OptimConfig:
    """Megatron's Adam, its distributed optimizer and its learning-rate schedule (mcore_rl/actor/optimizer.py decides
    what the ranks build from these, and `launch/submit.py --dry-run` counts the same)."""

    #: peak learning rate (after warmup); verl's actor default, for a pretrained model (the CPU demo jobs set theirs)
    lr: float = 1e-6
    weight_decay: float = 0.0  #: decoupled weight decay
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  #: global gradient-norm clip
    #: Megatron's distributed optimizer: fp32 masters and Adam state sharded over data-parallel ranks; null = on for
    #: trainer.runtime=cuda, off for cpu (it runs on CPU/gloo too)
    distributed: bool | None = None
    #: share of the optimizer state (and its step) held on the host, 0..1 (Megatron's HybridDeviceOptimizer); needs
    #: distributed=true, trainer.runtime=cuda and Transformer Engine
    offload_fraction: float = 0.0
    #: Megatron DDP's overlap_grad_reduce: each gradient bucket's reduce (reduce-scatter with the distributed
    #: optimizer, all-reduce without) starts as soon as the last micro-batch's backward has filled it, overlapping the
    #: rest of the backward; null = on for trainer.runtime=cuda, off for cpu (it runs on CPU/gloo too)
    overlap_grad_reduce: bool | None = None
    #: Megatron DDP's overlap_param_gather: the distributed optimizer's parameter all-gather after a step runs bucket
    #: by bucket under the next mini-batch's forward instead of at the end of the step; needs distributed=true and
    #: overlap_grad_reduce; null = on exactly when both are (the ranks gather what is left when an update returns)
    overlap_param_gather: bool | None = None
    lr_warmup_steps: int = 0  #: optimizer steps of linear warmup from 0 to lr
    lr_warmup_ratio: float | None = None  #: warmup as a share of lr_decay_steps (replaces lr_warmup_steps when set)
    #: after warmup: constant | linear | cosine | inverse-square-root (Megatron's OptimizerParamScheduler styles)
    lr_decay_style: str = "constant"
    #: optimizer steps over which lr decays to min_lr; null = the whole run (trainer.steps x mini_batches x ppo_epochs)
    lr_decay_steps: int | None = None
    min_lr: float = 0.0  #: learning rate at the end of the decay

    def warmup_steps(self, decay_steps: int) -> int:
        """Warmup in optimizer steps: lr_warmup_ratio x decay_steps when the ratio is set, else lr_warmup_steps."""
        if self.lr_warmup_ratio is not None:
            return int(self.lr_warmup_ratio * decay_steps)
        return self.lr_warmup_steps

    def validate(self, prefix: str = "actor.optim") -> None:
        _check(self.lr > 0, f"{prefix}.lr", self.lr, "> 0")
        _check(self.clip_grad >= 0, f"{prefix}.clip_grad", self.clip_grad, ">= 0")
        _check(0 <= self.offload_fraction <= 1, f"{prefix}.offload_fraction", self.offload_fraction, "in [0, 1]")
        _check(
            self.offload_fraction == 0 or self.distributed is not False,
            f"{prefix}.offload_fraction",
            self.offload_fraction,
            f"0 unless {prefix}.distributed is true (Megatron offloads the distributed optimizer's shards)",
        )
        for name in ("distributed", "overlap_grad_reduce", "overlap_param_gather"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, bool), f"{prefix}.{name}", value, "true, false or null")
        if self.overlap_param_gather:
            # Megatron's forward pre-hooks gather the distributed optimizer's shards; its training loop refuses
            # overlap_param_gather without overlap_grad_reduce (the gather is re-armed by the overlapped reduce)
            _check(
                self.distributed is not False and self.overlap_grad_reduce is not False,
                f"{prefix}.overlap_param_gather",
                self.overlap_param_gather,
                f"false or null unless {prefix}.distributed and {prefix}.overlap_grad_reduce are true (or null) "
                f"(got distributed={self.distributed!r}, overlap_grad_reduce={self.overlap_grad_reduce!r})",
            )
        _check(0 <= self.min_lr <= self.lr, f"{prefix}.min_lr", self.min_lr, f"in [0, {prefix}.lr={self.lr}]")
        _check(
            isinstance(self.lr_warmup_steps, int) and self.lr_warmup_steps >= 0,
            f"{prefix}.lr_warmup_steps",
            self.lr_warmup_steps,
            "an integer >= 0",
        )
        if self.lr_warmup_ratio is not None:
            _check(0 <= self.lr_warmup_ratio < 1, f"{prefix}.lr_warmup_ratio", self.lr_warmup_ratio, "in [0, 1)")
        if self.lr_decay_steps is not None:
            _positive(f"{prefix}.lr_decay_steps", self.lr_decay_steps)
            warmup = self.warmup_steps(self.lr_decay_steps)
            _check(
                warmup < self.lr_decay_steps,
                f"{prefix}.lr_warmup_steps",
                warmup,
                f"fewer than {prefix}.lr_decay_steps={self.lr_decay_steps} (the schedule's length)",
            )
        self._check_decay_style(prefix)

    def _check_decay_style(self, prefix: str) -> None:
        """Ask Megatron's scheduler itself whether it implements `lr_decay_style` (its branches are the registry).

        "constant" is its first branch, always there: skipping the probe for it keeps Megatron's import (seconds) out
        of the validation of the default config.
        """
        if self.lr_decay_style == "constant":
            return
        from types import SimpleNamespace

        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        probe = SimpleNamespace(param_groups=[{}])
        try:
            sched = OptimizerParamScheduler(probe, 0.0, 1.0, 0.0, 0, 4, self.lr_decay_style, 0.0, 0.0, 4, "constant")
            sched.num_steps = 2
            sched.get_lr(probe.param_groups[0])
        except Exception:  # noqa: BLE001 - Megatron raises a bare Exception (or asserts) for what it lacks
            raise ConfigError(
                f"{prefix}.lr_decay_style={self.lr_decay_style!r} is invalid: expected a style Megatron's "
                "OptimizerParamScheduler implements without further settings: constant | linear | cosine | "
                "inverse-square-root"
            ) from None


@dataclass
class RecomputeConfig:
    """Activation recompute of the Megatron workers: Megatron's recompute_granularity / recompute_method /
    recompute_num_layers (TransformerConfig), read by the ranks and by the dry run's activation estimate alike."""

    #: null (keep every layer's activations) | full (recompute whole layers in the backward) | selective (recompute
    #: the core attention only)
    granularity: str | None = None
    #: with full: uniform (checkpoint the input of every num_layers layers) | block (recompute the first num_layers
    #: layers of each pipeline stage, keep the rest)
    method: str | None = None
    #: with full: layers per recompute unit (uniform) or recomputed layers per stage (block)
    num_layers: int | None = None

    def megatron_fields(self) -> dict[str, Any]:
        """The TransformerConfig fields these settings are."""
        return dict(
            recompute_granularity=self.granularity,
            recompute_method=self.method,
            recompute_num_layers=self.num_layers,
        )

    def validate(self, prefix: str = "actor.recompute") -> None:
        """Settings nothing would read are refused; the rest are checked by Megatron's TransformerConfig itself."""
        if self.granularity != "full":
            for name in ("method", "num_layers"):
                _check(
                    getattr(self, name) is None,
                    f"{prefix}.{name}",
                    getattr(self, name),
                    f"null unless {prefix}.granularity=full (got {self.granularity!r})",
                )
        if self.granularity is None:
            return
        if self.num_layers is not None:
            _positive(f"{prefix}.num_layers", self.num_layers)
        from megatron.core.transformer import TransformerConfig

        probe = dict(num_layers=max(1, self.num_layers or 1), hidden_size=8, num_attention_heads=1)
        try:
            TransformerConfig(**probe, **self.megatron_fields())
        except (AssertionError, ValueError) as err:
            raise ConfigError(f"{prefix}: Megatron refuses these recompute settings: {err}") from None


@dataclass
class ActorConfig:
    """The Megatron actor (and its colocated frozen reference)."""

    world_size: int = 2  #: number of Megatron ranks (Ray actors)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch_size: int = 16  #: samples per micro-batch on one data-parallel rank (at most)
    #: samples per micro-batch of the forward-only logprob passes (old and reference logprobs), which keep no
    #: activations for a backward and so can take more (verl: log_prob_micro_batch_size_per_gpu); null =
    #: micro_batch_size. Fewer micro-batches mean fewer schedule calls and collectives: on the CPU path each costs
    #: more than the tiny model's arithmetic
    logprob_micro_batch_size: int | None = None
    max_tokens_per_microbatch: int | None = None  #: token budget per micro-batch (padded length x samples); null = off
    #: the update's micro-batches by real length: dp shards balanced by tokens, samples sorted by length, each
    #: micro-batch padded to its own longest sample (and filled to max_tokens_per_microbatch). Needs actor.layout.ep=1,
    #: and pp=1 unless trainer.runtime=cuda (variable shapes between pipeline stages)
    dynamic_batching: bool = False
    #: sequence packing (THD): each micro-batch's sequences end to end in one row, no padding between them (up to
    #: micro_batch_size samples, or max_tokens_per_microbatch real tokens); needs Transformer Engine (trainer.runtime
    #: =cuda), no routing replay, not with dynamic_batching
    packing: bool = False
    #: MoE token dispatcher: null = the runtime's (alltoall on CUDA, allgather on CPU) | alltoall | flex (DeepEP's
    #: dispatch/combine kernels: needs trainer.runtime=cuda, Transformer Engine and the deep_ep package)
    moe_dispatcher: str | None = None
    #: Transformer Engine's fused token permute / unpermute in MoE layers (needs Transformer Engine)
    moe_permute_fusion: bool = False
    mini_batches: int = 2  #: optimizer steps per RL step (the batch is split into this many mini-batches)
    ppo_epochs: int = 1  #: passes over the batch per RL step
    clip_ratio_low: float = 0.2  #: PPO clip epsilon below 1
    clip_ratio_high: float = 0.28  #: PPO clip epsilon above 1 (DAPO clip-higher)
    clip_ratio_c: float = 3.0  #: dual-clip bound for negative advantages
    policy_loss: str = "ppo"  #: ppo (token ratio, clip-higher, dual-clip) | gspo (sequence ratio: clips ~3e-4/4e-4)
    #: token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_agg_mode: str = "token-mean"
    kl_loss_coef: float = 0.0  #: weight of the KL(policy || ref) loss term (GRPO's kl_loss)
    kl_loss_type: str = "low_var_kl"  #: k1 | k2 | low_var_kl (k3) | abs
    entropy_coef: float = 0.0  #: entropy bonus weight: loss -= entropy_coef * aggregated token entropy
    #: frozen reference model: null = exactly when something uses it (RLConfig.uses_reference: a KL loss, KL in the
    #: reward, DPO); true = always (its KL to the policy is then logged as actor/kl_ref although no loss uses it);
    #: false = never (refused when something needs it). Resolved to true/false by RLConfig.validate
    use_ref: bool | None = None
    #: where the frozen reference's weights live (actor/reference.py): resident (a second model on the device) | host
    #: (its weights in host memory, pinned on CUDA, copied into the policy's model for each reference pass while the
    #: policy's weights wait in host memory: one model's weights on the device, as slime); null = host on
    #: trainer.runtime=cuda (a large MoE's reference costs as much device memory as its weights; the copies cost a
    #: few PCIe transfers per step), resident on cpu (there host memory is the device: a host copy saves nothing)
    ref_placement: str | None = None
    #: MoE routing replay (verl's router_replay.mode): disabled | R2 (the update replays the routing of the step's
    #: old-logprob forward) | R3 (every policy forward replays the experts the rollout engine routed each token to)
    router_replay_mode: str = "disabled"
    num_cpus_per_rank: float = 1.0  #: Ray CPUs reserved per rank (the CPU runtime: also its torch threads)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    #: MoE expert-bias update per optimizer step (DeepSeek-V3's aux-loss-free balancing, Megatron's
    #: moe_router_bias_update_rate): 0 keeps the released bias frozen during RL (as slime); Megatron's default is 1e-3
    router_bias_update_rate: float = 0.0
    #: truncated importance sampling (TIS) cap for tokens sampled by an older weight version than the one trained
    #: (rollout.max_staleness > 0): w = min(pi_old / pi_rollout, cap) per stale token; null = no correction. 1.2,
    #: tighter than the 2.0 usual against engine/trainer mismatch: stale tokens' ratios spread wider, and on the
    #: default job 2.0 left k = 2 at 0.77 final reward against 0.90 synchronous, 1.2 reached 0.88 (docs/async.md)
    stale_tis_cap: float | None = 1.2
    #: the policy's logits are divided by this before every logprob and entropy (verl and slime divide by the
    #: rollout temperature): the engines sample, and report logprobs, from softmax(logits / T), and the PPO ratio,
    #: rollout correction and rollout/logprob_abs_diff compare the actor's logprobs with theirs. null =
    #: rollout.temperature (1 when it is 0, greedy: the engines then report T=1 logprobs), and 1 in DPO (which samples
    #: nothing it trains on)
    logit_temperature: float | None = None
    #: skip the old-logprob pass where it is redundant: one mini-batch, one epoch, no KL penalty or rollout
    #: correction reading old logprobs before the update, no routing replay or packing. The update's own forward
    #: then gives the old logprobs (the same weights; with dynamic_batching put back in batch order; the ratio is 1
    #: by construction): one forward pass per step fewer, the same update
    skip_redundant_logprob_pass: bool = True
    #: the first step the run trains compares the engine's logprobs of the sampled tokens with the actor's: a mean
    #: absolute difference per token above this stops the run (exit 2) naming the likely causes (a tokenizer or
    #: temperature that is not the engine's, a weight the push missed). fp32 on both sides agrees to ~1e-5, bf16 to
    #: ~1e-2; null = no check
    first_step_logprob_tolerance: float | None = 0.1

    def validate(self) -> None:
        for name in ("world_size", "micro_batch_size", "mini_batches", "ppo_epochs"):
            _positive(f"actor.{name}", getattr(self, name))
        if self.logprob_micro_batch_size is not None:
            _positive("actor.logprob_micro_batch_size", self.logprob_micro_batch_size)
        _check(0 <= self.clip_ratio_low < 1, "actor.clip_ratio_low", self.clip_ratio_low, "in [0, 1)")
        _check(self.clip_ratio_high >= 0, "actor.clip_ratio_high", self.clip_ratio_high, ">= 0")
        from mcore_rl.config.names import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES

        self.optim.validate()
        _check(
            self.loss_agg_mode in LOSS_AGG_MODES, "actor.loss_agg_mode", self.loss_agg_mode, f"one of {LOSS_AGG_MODES}"
        )
        _check(
            self.policy_loss in POLICY_LOSSES, "actor.policy_loss", self.policy_loss, f"one of {tuple(POLICY_LOSSES)}"
        )
        _check(self.kl_loss_type in KL_ESTIMATORS, "actor.kl_loss_type", self.kl_loss_type, f"one of {KL_ESTIMATORS}")
        _check(self.entropy_coef >= 0, "actor.entropy_coef", self.entropy_coef, ">= 0")
        from mcore_rl.config.names import ROUTER_REPLAY_MODES

        _check(
            self.router_replay_mode in ROUTER_REPLAY_MODES,
            "actor.router_replay_mode",
            self.router_replay_mode,
            f"one of {ROUTER_REPLAY_MODES}",
        )
        self.layout.validate()
        self.layout.to_layout().check_world_size(self.world_size)
        _check(self.stale_tis_cap is None or self.stale_tis_cap > 0, "actor.stale_tis_cap", self.stale_tis_cap, "> 0")
        if self.first_step_logprob_tolerance is not None:
            _check(
                self.first_step_logprob_tolerance > 0, "actor.first_step_logprob_tolerance",
                self.first_step_logprob_tolerance, "> 0 or null",
            )  # fmt: skip
        if self.logit_temperature is not None:
            _check(self.logit_temperature > 0, "actor.logit_temperature", self.logit_temperature, "> 0 or null")
        self.recompute.validate()
        _check(
            self.moe_dispatcher in (None, "alltoall", "flex"),
            "actor.moe_dispatcher",
            self.moe_dispatcher,
            "null, alltoall or flex",
        )
        _check(self.router_bias_update_rate >= 0, "actor.router_bias_update_rate", self.router_bias_update_rate, ">= 0")
        from mcore_rl.config.names import REF_PLACEMENTS

        _check(
            self.ref_placement is None or self.ref_placement in REF_PLACEMENTS,
            "actor.ref_placement",
            self.ref_placement,
            f"null or one of {REF_PLACEMENTS}",
        )


@dataclass
class CriticConfig:
    """The PPO critic (algorithm.adv_estimator=gae): a Megatron model of the policy's family whose output layer is a
    scalar value head, in its own worker group with its own layout, optimizer and learning rate."""

    enable: bool = False  #: start the critic group (required by, and only allowed with, adv_estimator=gae)
    path: str | None = None  #: HF checkpoint dir of the trunk; null = the policy's (model.path, or its random init)
    world_size: int = 1  #: number of Megatron ranks of the critic (its own torch.distributed world)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))  #: lr: verl's critic default
    micro_batch_size: int = 16  #: samples per micro-batch on one data-parallel rank (at most)
    max_tokens_per_microbatch: int | None = None  #: token budget per micro-batch; null = off
    mini_batches: int = 2  #: optimizer steps per RL step
    ppo_epochs: int = 1  #: passes over the batch per RL step
    loss_agg_mode: str = "token-mean"  #: aggregation of the value loss (algorithms/masked.py's LOSS_AGG_MODES)
    cliprange_value: float | None = 0.5  #: value clipping around the old values (null = no clipping)
    warmup_steps: int = 0  #: the first steps train only the critic (the policy and the engines stay as they are)
    num_cpus_per_rank: float = 1.0  #: Ray CPUs reserved per rank (the CPU runtime: also its torch threads)

    def validate(self) -> None:
        from mcore_rl.config.names import LOSS_AGG_MODES

        for name in ("world_size", "micro_batch_size", "mini_batches", "ppo_epochs"):
            _positive(f"critic.{name}", getattr(self, name))
        _check(self.warmup_steps >= 0, "critic.warmup_steps", self.warmup_steps, ">= 0")
        _check(
            self.cliprange_value is None or self.cliprange_value > 0,
            "critic.cliprange_value",
            self.cliprange_value,
            "null or > 0",
        )
        _check(
            self.loss_agg_mode in LOSS_AGG_MODES, "critic.loss_agg_mode", self.loss_agg_mode, f"one of {LOSS_AGG_MODES}"
        )
        self.optim.validate("critic.optim")
        self.layout.validate()
        self.layout.to_layout().check_world_size(self.world_size)
