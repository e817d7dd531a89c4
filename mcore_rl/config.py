"""The typed configuration tree of a run: one dataclass per group, each field documented, each group validating
itself (`validate()`).

Hydra composes YAML from configs/ over this schema (registered in the ConfigStore as `rl_schema`), so a key that
does not exist is refused by name. `to_config(cfg)` turns the composed DictConfig into these dataclasses, running every
`validate()`; errors name the field and the expected value.

    python -m mcore_rl.train actor.layout.ep=2 rollout.n=8 trainer.steps=40
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcore_rl.parallel.layout import ParallelLayout


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and what was expected."""


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: expected {expected}")


def _positive(name: str, value: Any) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, value, "a positive integer")


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
    tokenizer: str | None = None  #: tokenizer dir; null = the tiny offline tokenizer, written into the run dir
    dtype: str = "float32"  #: parameter dtype: float32 | bfloat16
    make_vocab_size_divisible_by: int = 64  #: Megatron pads the vocab to a multiple of this x tp
    max_sequence_length: int = 512  #: longest prompt + response
    init_seed: int = 1234  #: seed of the random initialisation when path is null
    #: multi-token-prediction layers of a checkpoint whose config asks for them (DeepSeek-V3): auto = on when the
    #: checkpoint holds their weights, off when it holds none (transformers' save_pretrained drops them) | on | off
    mtp: str = "auto"

    def validate(self) -> None:
        _check(self.dtype in ("float32", "bfloat16"), "model.dtype", self.dtype, "float32 or bfloat16")
        _check(bool(self.path) or bool(self.hf_config), "model.path", self.path, "a checkpoint dir or model.hf_config")
        _positive("model.max_sequence_length", self.max_sequence_length)
        _positive("model.make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)
        _check(self.mtp in ("on", "off", "auto"), "model.mtp", self.mtp, "on, off or auto")


@dataclass
class OptimConfig:
    """Megatron's Adam, its distributed optimizer and its learning-rate schedule (mcore_rl/actor/optimizer.py decides
    what the ranks build from these, and `launch/submit.py --dry-run` counts the same)."""

    lr: float = 1e-3  #: peak learning rate (after warmup)
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
    #: MoE routing replay (verl's router_replay.mode): disabled | R2 (the update replays the routing of the step's
    #: old-logprob forward) | R3 (every policy forward replays the experts the rollout engine routed each token to)
    router_replay_mode: str = "disabled"
    num_cpus_per_rank: float = 1.0  #: Ray CPUs reserved per rank
    #: truncated importance sampling (TIS) cap for samples generated with an older weight version than the one
    #: trained (trainer.async_rollout): w = min(pi_old / pi_rollout, cap) per token; null = no correction
    stale_tis_cap: float | None = 2.0

    def validate(self) -> None:
        for name in ("world_size", "micro_batch_size", "mini_batches", "ppo_epochs"):
            _positive(f"actor.{name}", getattr(self, name))
        if self.logprob_micro_batch_size is not None:
            _positive("actor.logprob_micro_batch_size", self.logprob_micro_batch_size)
        _check(0 <= self.clip_ratio_low < 1, "actor.clip_ratio_low", self.clip_ratio_low, "in [0, 1)")
        _check(self.clip_ratio_high >= 0, "actor.clip_ratio_high", self.clip_ratio_high, ">= 0")
        from mcore_rl.algorithms import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES

        self.optim.validate()
        _check(
            self.loss_agg_mode in LOSS_AGG_MODES, "actor.loss_agg_mode", self.loss_agg_mode, f"one of {LOSS_AGG_MODES}"
        )
        _check(
            self.policy_loss in POLICY_LOSSES, "actor.policy_loss", self.policy_loss, f"one of {tuple(POLICY_LOSSES)}"
        )
        _check(self.kl_loss_type in KL_ESTIMATORS, "actor.kl_loss_type", self.kl_loss_type, f"one of {KL_ESTIMATORS}")
        _check(self.entropy_coef >= 0, "actor.entropy_coef", self.entropy_coef, ">= 0")
        from mcore_rl.actor.router_replay import ROUTER_REPLAY_MODES

        _check(
            self.router_replay_mode in ROUTER_REPLAY_MODES,
            "actor.router_replay_mode",
            self.router_replay_mode,
            f"one of {ROUTER_REPLAY_MODES}",
        )
        self.layout.validate()
        self.layout.to_layout().check_world_size(self.world_size)
        _check(self.stale_tis_cap is None or self.stale_tis_cap > 0, "actor.stale_tis_cap", self.stale_tis_cap, "> 0")


@dataclass
class SGLangConfig:
    """Real SGLang servers (GPU only): what `mcore_rl/rollout/sglang_launcher.py` passes to
    `python -m sglang.launch_server`. An engine uses `tp` GPUs in all, spread over `nnodes` nodes; `ep` and `dp`
    divide `tp` (SGLang's rule)."""

    tp: int = 1  #: --tp-size: GPUs per engine (all nodes of the engine together)
    ep: int = 1  #: --ep-size: expert-parallel size inside the engine (1 = experts sharded by TP)
    dp: int = 1  #: --dp-size: data-parallel attention replicas inside the engine (with enable_dp_attention)
    enable_dp_attention: bool = False  #: --enable-dp-attention (DeepSeek-V3 / Qwen3-MoE large-EP serving)
    moe_a2a_backend: str | None = None  #: --moe-a2a-backend (e.g. deepep); null = SGLang's default
    mem_fraction_static: float = 0.7  #: --mem-fraction-static: weights + KV cache share of each GPU
    enable_memory_saver: bool = True  #: --enable-memory-saver: lets colocated engines release weights and KV cache
    nnodes: int = 1  #: nodes per engine (multi-node engines get --nnodes/--node-rank/--dist-init-addr)
    load_format: str = "dummy"  #: --load-format: dummy (random; the actor syncs real weights before use) | auto
    skip_tokenizer_init: bool = True  #: --skip-tokenizer-init: token ids in and out, as the RL loop needs
    startup_timeout_s: float = 1200.0  #: seconds to wait for /health after launch (weights load, CUDA graphs)
    extra_args: list[str] = field(default_factory=list)  #: further launch_server flags, passed as they are

    def validate(self) -> None:
        for name in ("tp", "ep", "dp", "nnodes"):
            _positive(f"rollout.sglang.{name}", getattr(self, name))
        _check(self.tp % self.ep == 0, "rollout.sglang.ep", self.ep, f"a divisor of rollout.sglang.tp={self.tp}")
        _check(self.tp % self.dp == 0, "rollout.sglang.dp", self.dp, f"a divisor of rollout.sglang.tp={self.tp}")
        _check(
            self.dp == 1 or self.enable_dp_attention,
            "rollout.sglang.dp",
            self.dp,
            "1 unless rollout.sglang.enable_dp_attention=true",
        )
        _check(
            0 < self.mem_fraction_static < 1,
            "rollout.sglang.mem_fraction_static",
            self.mem_fraction_static,
            "in (0, 1)",
        )
        _check(self.load_format in ("dummy", "auto"), "rollout.sglang.load_format", self.load_format, "dummy or auto")
        _check(self.startup_timeout_s > 0, "rollout.sglang.startup_timeout_s", self.startup_timeout_s, "> 0")


ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
"""sglang-router's --policy choices (sglang_router.launch_router, 0.3.x)."""


@dataclass
class RolloutConfig:
    """Generation: `num_engines` SGLang-API servers behind sglang-router, driven by one HTTP client."""

    #: hf: our embedded SGLang-compatible server over transformers (CPU or GPU) | sglang: real SGLang servers (GPU)
    engine: str = "hf"
    num_engines: int = 1  #: rollout engines (each one HTTP server) behind the router
    router_policy: str = "cache_aware"  #: sglang-router --policy: cache_aware | round_robin | power_of_two | random
    n: int = 8  #: samples per prompt (sent as one request with sampling_params.n, so one engine prefills it once)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    max_running_requests: int = 256  #: embedded server: sequences decoded together (continuous batching)
    request_timeout_s: float = 600.0  #: client: seconds before one /generate attempt is given up and retried
    max_retries: int = 3  #: client: retries of a failed /generate (engine died, timeout) before the step fails
    health_check_interval_s: float = 2.0  #: seconds between the pool's /health probes of every engine
    num_cpus: float = 1.0  #: Ray CPUs reserved per embedded engine
    seed: int = 0  #: sampling seed (step number is added; sample i of a request uses seed + i)
    #: validation: samples per prompt of the sampled pass (rollout temperature/top_p) for mean@k and pass@k
    #: (verl: val_kwargs.n); 0 = the greedy pass only. The greedy pass (temperature 0, one sample) always runs
    val_n: int = 4
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def validate(self) -> None:
        _check(self.engine in ("hf", "sglang"), "rollout.engine", self.engine, "hf or sglang")
        _positive("rollout.n", self.n)
        _positive("rollout.num_engines", self.num_engines)
        _positive("rollout.max_new_tokens", self.max_new_tokens)
        _positive("rollout.max_running_requests", self.max_running_requests)
        _check(
            self.router_policy in ROUTER_POLICIES,
            "rollout.router_policy",
            self.router_policy,
            f"one of {ROUTER_POLICIES}",
        )
        _check(self.request_timeout_s > 0, "rollout.request_timeout_s", self.request_timeout_s, "> 0")
        _check(
            self.health_check_interval_s > 0,
            "rollout.health_check_interval_s",
            self.health_check_interval_s,
            "> 0",
        )
        _check(
            isinstance(self.max_retries, int) and self.max_retries >= 0,
            "rollout.max_retries",
            self.max_retries,
            "an integer >= 0",
        )
        _check(
            isinstance(self.val_n, int) and (self.val_n == 0 or self.val_n >= 2),
            "rollout.val_n",
            self.val_n,
            "0 (greedy validation only) or an integer >= 2 (the greedy pass is the n=1 case)",
        )
        _check(self.temperature >= 0, "rollout.temperature", self.temperature, ">= 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "in (0, 1]")
        self.sglang.validate()


@dataclass
class SyncConfig:
    """Weight sync, actor -> engines (resharding/sync/): plan -> bucketed execution -> transport -> version fence."""

    #: distributed (broadcast groups: gloo on CPU, NCCL on GPU) | tensor (shared memory / CUDA IPC, same node) | disk
    transport: str = "distributed"
    mode: str = "full"  #: full (engines get whole HF tensors) | shard_aware (each engine rank only what it keeps)
    bucket_bytes: int = 256 << 20  #: bytes per bucket; at least the largest exported tensor
    #: generation during a sync: none (the embedded server stages the update and commits it atomically between two
    #: decode steps) | in_place | retract | abort (SGLang's /pause_generation modes)
    pause_mode: str = "none"
    timeout_s: float = 300.0  #: seconds a broadcast or an engine's answer may take before the sync fails
    #: send the family's FP8 targets (attention and MLP projections) as 128x128-blockwise e4m3 + weight_scale_inv,
    #: for engines serving FP8 (the rollout then runs the quantised model; tools/fp8_parity.py gates its accuracy)
    fp8: bool = False
    #: keep each sending rank's sync buffers (two buckets + the largest tensor at most) resident between syncs, so
    #: no sync faults in fresh pages; false frees them after every sync (a colocated run short of memory)
    keep_buffers: bool = True

    def validate(self) -> None:
        from mcore_rl.resharding.sync.plan import MODES
        from mcore_rl.resharding.sync.transports import TRANSPORTS

        _check(self.transport in TRANSPORTS, "sync.transport", self.transport, f"one of {TRANSPORTS}")
        _check(self.mode in MODES, "sync.mode", self.mode, f"one of {MODES}")
        _positive("sync.bucket_bytes", self.bucket_bytes)
        pauses = ("none", "in_place", "retract", "abort")
        _check(self.pause_mode in pauses, "sync.pause_mode", self.pause_mode, f"one of {pauses}")
        _check(self.timeout_s > 0, "sync.timeout_s", self.timeout_s, "> 0")


@dataclass
class KLControlConfig:
    """The coefficient of the in-reward KL penalty (verl's algorithm.kl_ctrl)."""

    type: str = "fixed"  #: fixed | adaptive (Ziegler et al. 2019), algorithms/kl.py's KL_CONTROLLERS
    kl_coef: float = 0.001  #: the coefficient (the adaptive controller's initial value)
    target_kl: float = 0.1  #: adaptive: the per-token KL the controller steers towards
    horizon: int = 10000  #: adaptive: samples over which the coefficient responds

    def validate(self) -> None:
        from mcore_rl.algorithms import KL_CONTROLLERS

        _check(self.type in KL_CONTROLLERS, "algorithm.kl_ctrl.type", self.type, f"one of {tuple(KL_CONTROLLERS)}")
        _check(self.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", self.kl_coef, ">= 0")
        _check(self.target_kl > 0, "algorithm.kl_ctrl.target_kl", self.target_kl, "> 0")
        _positive("algorithm.kl_ctrl.horizon", self.horizon)


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling (verl's algorithm.filter_groups): groups whose samples all got the same reward are
    dropped and more prompts are generated until the batch holds data.batch_size groups."""

    enable: bool = False
    max_num_gen_batches: int = 10  #: generation rounds (of data.batch_size prompts) per step at most
    #: when the rounds run out: error (stop the run) | shrink (log a warning, train on the groups found, cut to a
    #: size the mini-batches and data-parallel ranks divide)
    on_unfilled: str = "error"

    def validate(self) -> None:
        _positive("algorithm.filter_groups.max_num_gen_batches", self.max_num_gen_batches)
        _check(
            self.on_unfilled in ("error", "shrink"),
            "algorithm.filter_groups.on_unfilled",
            self.on_unfilled,
            "error or shrink",
        )


@dataclass
class RolloutCorrectionConfig:
    """Importance weights for the rollout/training mismatch (verl's algorithm.rollout_correction), applied to the
    policy loss; algorithms/mismatch.py."""

    rollout_is: str | None = None  #: token (TIS) | sequence (truncated sequence ratio) | null = off
    rollout_is_threshold: float = 2.0  #: the truncation cap C of the importance weights
    rollout_rs: str | None = None  #: rejection (MIS): sequence (summed log-ratio) | geometric (mean) | null = off
    rollout_rs_threshold: float = 2.0  #: upper bound of the sequence ratio; outside [lower, upper] -> weight 0
    rollout_rs_threshold_lower: float | None = None  #: lower bound (null = 1 / upper)

    def validate(self) -> None:
        from mcore_rl.algorithms import IS_LEVELS, RS_LEVELS

        name = "algorithm.rollout_correction"
        _check(
            self.rollout_is in (None, *IS_LEVELS), f"{name}.rollout_is", self.rollout_is, f"null or one of {IS_LEVELS}"
        )
        _check(
            self.rollout_rs in (None, *RS_LEVELS), f"{name}.rollout_rs", self.rollout_rs, f"null or one of {RS_LEVELS}"
        )
        _check(self.rollout_is_threshold > 0, f"{name}.rollout_is_threshold", self.rollout_is_threshold, "> 0")
        _check(self.rollout_rs_threshold > 0, f"{name}.rollout_rs_threshold", self.rollout_rs_threshold, "> 0")
        lower = self.rollout_rs_threshold_lower
        _check(
            lower is None or 0 <= lower <= self.rollout_rs_threshold,
            f"{name}.rollout_rs_threshold_lower",
            lower,
            f"null or in [0, rollout_rs_threshold={self.rollout_rs_threshold}]",
        )


@dataclass
class AlgorithmConfig:
    """Advantage estimation and what shapes the reward before it (verl's `algorithm` group)."""

    #: algorithms/advantages.py's ADVANTAGE_ESTIMATORS: grpo | gae (needs critic.enable) | rloo | opo | remax
    #: (a greedy baseline rollout per prompt) | reinforce_plus_plus | reinforce_plus_plus_baseline
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True  #: GRPO: divide by the group std (false = Dr.GRPO)
    gamma: float = 1.0  #: discount (GAE, REINFORCE++)
    lam: float = 1.0  #: GAE lambda (PPO with a critic)
    use_kl_in_reward: bool = False  #: subtract kl_ctrl.kl_coef * KL(old || ref) per token from the reward
    kl_penalty: str = "kl"  #: the in-reward KL estimator: algorithms/kl.py's KL_ESTIMATORS
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def validate(self) -> None:
        from mcore_rl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS

        known = tuple(ADVANTAGE_ESTIMATORS)
        _check(self.adv_estimator in known, "algorithm.adv_estimator", self.adv_estimator, f"one of {known}")
        _check(self.kl_penalty in KL_ESTIMATORS, "algorithm.kl_penalty", self.kl_penalty, f"one of {KL_ESTIMATORS}")
        _check(0 <= self.gamma <= 1, "algorithm.gamma", self.gamma, "in [0, 1]")
        _check(0 <= self.lam <= 1, "algorithm.lam", self.lam, "in [0, 1]")
        self.kl_ctrl.validate()
        self.filter_groups.validate()
        self.rollout_correction.validate()


@dataclass
class CriticConfig:
    """The PPO critic (algorithm.adv_estimator=gae): a Megatron model of the policy's family whose output layer is a
    scalar value head, in its own worker group with its own layout, optimizer and learning rate."""

    enable: bool = False  #: start the critic group (required by, and only allowed with, adv_estimator=gae)
    path: str | None = None  #: HF checkpoint dir of the trunk; null = the policy's (model.path, or its random init)
    world_size: int = 1  #: number of Megatron ranks of the critic (its own torch.distributed world)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-2))
    micro_batch_size: int = 16  #: samples per micro-batch on one data-parallel rank (at most)
    max_tokens_per_microbatch: int | None = None  #: token budget per micro-batch; null = off
    mini_batches: int = 2  #: optimizer steps per RL step
    ppo_epochs: int = 1  #: passes over the batch per RL step
    loss_agg_mode: str = "token-mean"  #: aggregation of the value loss (algorithms/masked.py's LOSS_AGG_MODES)
    cliprange_value: float | None = 0.5  #: value clipping around the old values (null = no clipping)
    warmup_steps: int = 0  #: the first steps train only the critic (the policy and the engines stay as they are)
    num_cpus_per_rank: float = 1.0  #: Ray CPUs reserved per rank

    def validate(self) -> None:
        from mcore_rl.algorithms import LOSS_AGG_MODES

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


@dataclass
class DataConfig:
    """Prompts."""

    train_files: list[str] = field(default_factory=list)  #: parquet files in verl's schema; empty = synthetic task
    #: validation parquet files (verl's schema); empty with a synthetic task and validation on (trainer.val_every or
    #: trainer.val_before_train) = a held-out synthetic set, written into the run dir with another seed
    val_files: list[str] = field(default_factory=list)
    val_batch_size: int | None = None  #: prompts per validation request batch; null = the whole set at once
    synthetic_task: str = "copy_digit"  #: task written into the run dir when train_files is empty
    synthetic_num_prompts: int = 512
    batch_size: int = 8  #: prompts per RL step
    max_prompt_length: int = 64  #: longer prompts are refused (overlong=error) or dropped
    overlong: str = "error"  #: error | drop
    shuffle: bool = True
    seed: int = 0

    def validate(self) -> None:
        _positive("data.batch_size", self.batch_size)
        if self.val_batch_size is not None:
            _positive("data.val_batch_size", self.val_batch_size)
        _positive("data.max_prompt_length", self.max_prompt_length)
        _positive("data.synthetic_num_prompts", self.synthetic_num_prompts)
        _check(self.overlong in ("error", "drop"), "data.overlong", self.overlong, "error or drop")


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (verl's reward_model.overlong_buffer), added to the reward: 0 up to
    rollout.max_new_tokens - len, then a linear ramp down to -penalty_factor at max_new_tokens."""

    enable: bool = False
    len: int = 4  #: tokens of the ramp before rollout.max_new_tokens
    penalty_factor: float = 1.0  #: the penalty at the longest response

    def validate(self, max_new_tokens: int) -> None:
        if self.enable:
            _check(
                isinstance(self.len, int) and 0 < self.len <= max_new_tokens,
                "reward.overlong_buffer.len",
                self.len,
                f"in [1, rollout.max_new_tokens={max_new_tokens}]",
            )
            _check(self.penalty_factor >= 0, "reward.overlong_buffer.penalty_factor", self.penalty_factor, ">= 0")


@dataclass
class RewardConfig:
    """Reward function (verl's custom_reward_function: path + name), else built-ins by data_source."""

    path: str | None = None  #: python file defining the reward function; null = built-ins by data_source
    name: str | None = None  #: function name in `path` (verl's custom_reward_function.name)
    num_threads: int = 1  #: concurrent calls of a per-response function
    timeout_s: float | None = None  #: per-call limit in seconds (null = none); a call past it fails the step
    #: HF sequence-classification reward model dir (num_labels=1), scored by a Ray worker (reward/reward_model.py)
    model_path: str | None = None
    model_weight: float = 1.0  #: weight of the reward model's score in the per-row sum
    rule_weight: float = 1.0  #: weight of the rule (or user) reward in the per-row sum when a reward model is set
    model_num_cpus: float = 0.0  #: Ray CPUs reserved for the reward-model worker (0: it shares the run's)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)

    def validate(self) -> None:
        _positive("reward.num_threads", self.num_threads)
        if self.timeout_s is not None:
            _check(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "> 0 seconds, or null for no limit")
        _check(
            self.name is None or self.path is not None,
            "reward.name",
            self.name,
            "null unless reward.path names the file that defines it",
        )
        if self.model_path is not None:
            import os

            _check(
                os.path.isfile(os.path.join(self.model_path, "config.json")),
                "reward.model_path",
                self.model_path,
                "an HF checkpoint dir with config.json",
            )
        _check(self.model_num_cpus >= 0, "reward.model_num_cpus", self.model_num_cpus, ">= 0")


@dataclass
class DPOConfig:
    """Offline DPO (`python -m mcore_rl.train --config-name dpo`, trainer.mode=dpo): preference pairs train the actor
    against its frozen reference; the rollout engines only sample the policy to score it with the rule reward."""

    beta: float = 0.1  #: inverse temperature of the implicit reward beta * log(pi / ref) (IPO: its tau)
    loss_type: str = "sigmoid"  #: a loss of mcore_rl.algorithms.dpo.DPO_LOSSES: sigmoid (DPO) | ipo
    #: parquet files with prompt/chosen/rejected (data/preference.py); empty = pairs derived from data.synthetic_task
    train_files: list[str] = field(default_factory=list)

    def validate(self) -> None:
        from mcore_rl.algorithms.dpo import DPO_LOSSES

        _check(self.beta > 0, "dpo.beta", self.beta, "> 0")
        _check(self.loss_type in DPO_LOSSES, "dpo.loss_type", self.loss_type, f"one of {sorted(DPO_LOSSES)}")


TRAINER_MODES = ("rl", "dpo")
"""What train.py's main dispatches to: the RL loop (train.run) or the DPO loop (controller/dpo_loop.py)."""


@dataclass
class AgentConfig:
    """Multi-turn tool-use episodes (mcore_rl/rollout/agent/): the model calls tools, their answers come back as
    tokens (loss mask 0), until it answers, `max_turns`, or `max_response_tokens`."""

    enabled: bool = False  #: run agent episodes instead of single-turn samples
    chat_format: str = "hermes"  #: tool-call markup: hermes (Qwen2.5/Qwen3 <tool_call>{json}</tool_call>)
    #: tools of a sample whose extra_info has no tools_kwargs (verl's tools_kwargs, when present, select them)
    tools: list[str] = field(default_factory=list)
    max_turns: int = 4  #: model turns per episode (a tool call in the last one is not run)
    max_response_tokens: int = 256  #: tokens after the prompt (model and tool tokens together)
    tool_timeout_s: float = 10.0  #: wall-clock limit of one tool call (an error observation after it)
    max_tool_errors: int | None = None  #: end an episode after this many error observations; null = never
    max_concurrency: int = 256  #: episodes in flight at once (each has at most one request at the engines)

    def validate(self) -> None:
        from mcore_rl.rollout.agent.parser import CHAT_FORMATS
        from mcore_rl.rollout.agent.tools import TOOLS

        formats = tuple(CHAT_FORMATS)
        _check(self.chat_format in CHAT_FORMATS, "agent.chat_format", self.chat_format, f"one of {formats}")
        for name in self.tools:
            _check(name in TOOLS, "agent.tools", name, f"registered tools {tuple(TOOLS)}")
        for name in ("max_turns", "max_response_tokens", "max_concurrency"):
            _positive(f"agent.{name}", getattr(self, name))
        _check(self.tool_timeout_s > 0, "agent.tool_timeout_s", self.tool_timeout_s, "> 0")
        _check(
            self.max_tool_errors is None or self.max_tool_errors > 0,
            "agent.max_tool_errors",
            self.max_tool_errors,
            "a positive integer or null",
        )


@dataclass
class TrainerConfig:
    """The run."""

    steps: int = 40  #: RL steps
    runtime: str = "cpu"  #: cpu (gloo, opt-in) | cuda (NCCL)
    run_dir: str = "runs/latest"  #: metrics.jsonl and artifacts go here
    seed: int = 0
    ray_address: str | None = None  #: null = start a local Ray
    ray_num_cpus: int | None = None  #: logical CPUs for a local Ray (null = enough for the actors)
    #: where metrics go (metrics/backends.py): console (lines + progress bar), jsonl, tensorboard, wandb
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    project_name: str = "mcore_rl"  #: wandb project
    experiment_name: str | None = None  #: wandb run name (null = wandb's)
    wandb_mode: str = "offline"  #: offline (no network; `wandb sync` later) | online | disabled
    val_every: int = 0  #: validate every this many steps and after the last (verl: test_freq); 0 = never
    val_before_train: bool = False  #: validate the initial weights (logged as step 0)
    mode: str = "rl"  #: rl (the RL loop) | dpo (offline DPO on preference pairs, see the dpo group)
    #: split: actor ranks and rollout engines in separate pools (Ray placement groups) | colocated: they share
    #: devices; engines release weights and KV cache while the actor trains, the actor offloads while they generate
    placement: str = "split"
    #: generate the next batch while the actor trains on this one (one step off policy; needs placement=split).
    #: Named async_rollout: `async` is a Python keyword, which a dataclass field cannot be
    async_rollout: bool = False
    max_staleness: int = 1  #: async_rollout: a trained sample's tokens are at most this many weight versions old
    #: save a training checkpoint into <run_dir>/checkpoints every this many steps and after the last; 0 = never
    save_every: int = 0
    keep_last: int | None = 2  #: checkpoints kept (older ones deleted after each save); null = keep all
    #: auto (the latest checkpoint in <run_dir>/checkpoints, else a new run) | a checkpoint dir | null (a new run)
    resume: str | None = None

    def validate(self) -> None:
        from mcore_rl.controller.placement import PLACEMENTS
        from mcore_rl.metrics.backends import BACKENDS, missing_packages

        _positive("trainer.steps", self.steps)
        if self.ray_num_cpus is not None:
            _positive("trainer.ray_num_cpus", self.ray_num_cpus)
        _check(self.runtime in ("cpu", "cuda"), "trainer.runtime", self.runtime, "cpu or cuda")
        for name in self.loggers:
            _check(name in BACKENDS, "trainer.loggers", list(self.loggers), f"a list of {tuple(BACKENDS)}")
        for name, package in missing_packages(list(self.loggers)).items():
            raise ConfigError(
                f"trainer.loggers={list(self.loggers)!r} is invalid here: the {name} logger needs the {package!r} "
                f"package, which is not installed (pip install {package}); expected it installed or {name!r} removed"
            )
        modes = ("offline", "online", "disabled")
        _check(self.wandb_mode in modes, "trainer.wandb_mode", self.wandb_mode, f"one of {modes}")
        _check(
            isinstance(self.val_every, int) and self.val_every >= 0,
            "trainer.val_every",
            self.val_every,
            "an integer >= 0",
        )
        _check(self.mode in TRAINER_MODES, "trainer.mode", self.mode, f"one of {TRAINER_MODES}")
        _check(self.placement in PLACEMENTS, "trainer.placement", self.placement, f"one of {tuple(PLACEMENTS)}")
        _positive("trainer.max_staleness", self.max_staleness)
        _check(
            not self.async_rollout or self.placement == "split",
            "trainer.async_rollout",
            self.async_rollout,
            "false with trainer.placement=colocated (engines and actor take turns on the same devices)",
        )
        _check(
            isinstance(self.save_every, int) and not isinstance(self.save_every, bool) and self.save_every >= 0,
            "trainer.save_every",
            self.save_every,
            "an integer >= 0 (0 = no checkpoints)",
        )
        if self.keep_last is not None:
            _positive("trainer.keep_last", self.keep_last)
        _check(self.resume is None or bool(str(self.resume).strip()), "trainer.resume", self.resume,
               "auto, a checkpoint directory, or null")  # fmt: skip

    @property
    def validates(self) -> bool:
        """Whether the run validates at all."""
        return self.val_every > 0 or self.val_before_train


@dataclass
class RLConfig:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def validate(self) -> None:
        groups = (
            self.model,
            self.actor,
            self.rollout,
            self.sync,
            self.algorithm,
            self.data,
            self.reward,
            self.trainer,
            self.agent,
        )
        for group in groups:
            group.validate()
        self.check_model()
        if self.actor.use_ref is None:
            self.actor.use_ref = self.uses_reference()
        elif self.uses_reference() and not self.actor.use_ref:
            users = {
                f"actor.kl_loss_coef={self.actor.kl_loss_coef}": self.actor.kl_loss_coef > 0,
                "algorithm.use_kl_in_reward=true": self.algorithm.use_kl_in_reward,
                "trainer.mode=dpo": self.trainer.mode == "dpo",
            }
            raise ConfigError(
                f"actor.use_ref=false is invalid with {', '.join(k for k, v in users.items() if v)}: it needs the "
                "reference model; expected actor.use_ref=true or null"
            )
        if self.trainer.mode == "dpo":
            self.check_dpo()
        self.check_algorithm()
        if self.trainer.resume is not None or self.trainer.save_every:
            from mcore_rl.checkpoint.manager import check_resume

            check_resume(self)  # a resume target that is not a compatible checkpoint: refused before anything starts
        if self.sync.transport == "tensor" and self.rollout.engine == "sglang" and self.rollout.sglang.nnodes > 1:
            raise ConfigError(
                "sync.transport='tensor' is invalid with rollout.sglang.nnodes > 1: the tensor transport shares memory "
                "(or CUDA IPC handles) within one node; expected sync.transport=distributed or disk"
            )
        if self.trainer.validates and not self.data.val_files and self.data.train_files:
            raise ConfigError(
                f"trainer.val_every={self.trainer.val_every} / trainer.val_before_train={self.trainer.val_before_train}"
                " need data.val_files (only a synthetic task gets a held-out set by default); expected parquet files"
            )
        for name, group in (("actor", self.actor), ("critic", self.critic)):
            optim = group.optim
            _check(
                optim.offload_fraction == 0 or self.trainer.runtime == "cuda",
                f"{name}.optim.offload_fraction",
                optim.offload_fraction,
                "0 with trainer.runtime=cpu (offload moves optimizer state from the GPU to the host; it needs CUDA "
                "and Transformer Engine)",
            )
            if optim.lr_decay_steps is None:  # the schedule spans the run: one optimizer step per mini-batch, epoch
                optim.lr_decay_steps = self.trainer.steps * group.mini_batches * group.ppo_epochs
                optim.validate(f"{name}.optim")
        total = self.data.batch_size * self.rollout.n
        dp = self.actor.layout.to_layout().dp(self.actor.world_size)
        _check(
            total % (self.actor.mini_batches * dp) == 0,
            "actor.mini_batches",
            self.actor.mini_batches,
            f"a divisor of data.batch_size*rollout.n/dp = {total}/{dp}",
        )

    def uses_reference(self) -> bool:
        """Whether a KL term of the objective needs the reference model's logprobs (then the reference pass runs
        every step; otherwise neither the model is built nor the pass run, unless actor.use_ref=true asks). DPO's
        implicit reward is a log-ratio to the reference, so DPO always uses it."""
        return self.actor.kl_loss_coef > 0 or self.algorithm.use_kl_in_reward or self.trainer.mode == "dpo"

    def check_dpo(self) -> None:
        """DPO trains on pairs: each mini-batch's dp shard and each micro-batch must hold whole pairs."""
        self.dpo.validate()
        _check(self.actor.use_ref, "actor.use_ref", self.actor.use_ref, "true for DPO (the frozen reference)")
        _check(self.actor.micro_batch_size % 2 == 0, "actor.micro_batch_size", self.actor.micro_batch_size, "even")
        dp = self.actor.layout.to_layout().dp(self.actor.world_size)
        _check(
            self.data.batch_size % (self.actor.mini_batches * dp) == 0,
            "data.batch_size",
            self.data.batch_size,
            f"pairs per step divisible by actor.mini_batches x dp = {self.actor.mini_batches * dp}",
        )

    def check_algorithm(self) -> None:
        """The algorithm's cross-group requirements: a critic exactly for GAE, reward shaping within the response
        length, mini-batches that divide the critic's batch too."""
        critic = self.critic
        if self.algorithm.adv_estimator == "gae" and not critic.enable:
            raise ConfigError(
                "algorithm.adv_estimator='gae' needs a critic: expected critic.enable=true (and optionally "
                "critic.world_size, critic.layout, critic.optim.lr, critic.path)"
            )
        if critic.enable:
            _check(
                self.algorithm.adv_estimator == "gae",
                "critic.enable",
                critic.enable,
                f"false with algorithm.adv_estimator={self.algorithm.adv_estimator!r} (only gae reads the critic)",
            )
            critic.validate()
            total = self.data.batch_size * self.rollout.n
            dp = critic.layout.to_layout().dp(critic.world_size)
            _check(
                total % (critic.mini_batches * dp) == 0,
                "critic.mini_batches",
                critic.mini_batches,
                f"a divisor of data.batch_size*rollout.n/dp = {total}/{dp}",
            )
        if self.algorithm.use_kl_in_reward:
            _check(self.actor.use_ref, "actor.use_ref", self.actor.use_ref, "true with algorithm.use_kl_in_reward")
        self.reward.overlong_buffer.validate(self.rollout.max_new_tokens)

    def check_model(self) -> None:
        """Refuse an unknown model_type or a layout that does not divide the model, before any process starts."""
        import json
        import os

        from mcore_rl.models.base import HFConfig, get_family

        if self.model.path:
            config_path = os.path.join(self.model.path, "config.json")
            if not os.path.isfile(config_path):
                raise ConfigError(f"model.path={self.model.path!r}: {config_path} does not exist")
            try:
                with open(config_path) as f:
                    raw = json.load(f)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ConfigError(
                    f"model.path={self.model.path!r}: {config_path} is not readable JSON: {err}"
                ) from None
            if not isinstance(raw, dict):
                raise ConfigError(
                    f"model.path={self.model.path!r}: {config_path} holds {type(raw).__name__}, expected a JSON object"
                )
            hf = HFConfig(raw)
        else:
            hf = HFConfig(self.model.hf_config)
        family = get_family(hf.model_type)
        self.actor.layout.to_layout().validate(self.actor.world_size, family.shape(hf))
        mode = self.actor.router_replay_mode
        if mode != "disabled":
            _check(
                bool(family.shape(hf).num_experts),
                "actor.router_replay_mode",
                mode,
                f"'disabled' for {hf.model_type}, a dense model (routing replay needs MoE layers)",
            )
            _check(self.actor.layout.cp == 1, "actor.router_replay_mode", mode, "'disabled' with actor.layout.cp > 1")
            _check(self.trainer.mode == "rl", "actor.router_replay_mode", mode, "'disabled' for trainer.mode=dpo")
        if self.critic.enable:
            self.critic.layout.to_layout().validate(self.critic.world_size, family.shape(hf))


def register_schema() -> None:
    """Register the schema with Hydra's ConfigStore (configs/*.yaml list `rl_schema` first in their defaults)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="rl_schema", node=RLConfig)


def to_config(cfg: Any) -> RLConfig:
    """Composed DictConfig -> RLConfig, running every group's validation."""
    from omegaconf import OmegaConf

    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, RLConfig):
        raise ConfigError("the composed config is not an RLConfig: does configs/*.yaml list rl_schema first?")
    obj.validate()
    return obj
