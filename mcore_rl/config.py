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

    def validate(self) -> None:
        _check(self.dtype in ("float32", "bfloat16"), "model.dtype", self.dtype, "float32 or bfloat16")
        _check(bool(self.path) or bool(self.hf_config), "model.path", self.path, "a checkpoint dir or model.hf_config")
        _positive("model.max_sequence_length", self.max_sequence_length)


@dataclass
class OptimConfig:
    """Adam settings of Megatron's optimizer."""

    lr: float = 1e-3  #: learning rate (constant)
    weight_decay: float = 0.0  #: decoupled weight decay
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  #: global gradient-norm clip

    def validate(self) -> None:
        _check(self.lr > 0, "actor.optim.lr", self.lr, "> 0")
        _check(self.clip_grad >= 0, "actor.optim.clip_grad", self.clip_grad, ">= 0")


@dataclass
class ActorConfig:
    """The Megatron actor (and its colocated frozen reference)."""

    world_size: int = 2  #: number of Megatron ranks (Ray actors)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch_size: int = 16  #: samples per micro-batch on one data-parallel rank (at most)
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
    entropy_coef: float = 0.0  #: entropy bonus weight
    use_ref: bool = True  #: keep a frozen reference model for KL
    num_cpus_per_rank: float = 1.0  #: Ray CPUs reserved per rank

    def validate(self) -> None:
        for name in ("world_size", "micro_batch_size", "mini_batches", "ppo_epochs"):
            _positive(f"actor.{name}", getattr(self, name))
        _check(0 <= self.clip_ratio_low < 1, "actor.clip_ratio_low", self.clip_ratio_low, "in [0, 1)")
        _check(self.clip_ratio_high >= 0, "actor.clip_ratio_high", self.clip_ratio_high, ">= 0")
        self.optim.validate()
        modes = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
        _check(self.loss_agg_mode in modes, "actor.loss_agg_mode", self.loss_agg_mode, f"one of {modes}")
        _check(self.policy_loss in ("ppo", "gspo"), "actor.policy_loss", self.policy_loss, "ppo or gspo")
        kls = ("k1", "k2", "low_var_kl", "k3", "abs")
        _check(self.kl_loss_type in kls, "actor.kl_loss_type", self.kl_loss_type, f"one of {kls}")
        self.layout.validate()
        self.layout.to_layout().check_world_size(self.world_size)


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
class AlgorithmConfig:
    """Advantage estimation."""

    adv_estimator: str = "grpo"  #: grpo | rloo | opo | reinforce_plus_plus | reinforce_plus_plus_baseline
    norm_adv_by_std: bool = True  #: GRPO: divide by the group std (false = Dr.GRPO)
    gamma: float = 1.0  #: discount (REINFORCE++)
    lam: float = 1.0  #: GAE lambda (PPO with a critic)

    def validate(self) -> None:
        pending = {"gae": "a critic (PPO)", "remax": "greedy baseline rollouts (ReMax)"}
        if self.adv_estimator in pending:
            raise ConfigError(
                f"algorithm.adv_estimator={self.adv_estimator!r} needs {pending[self.adv_estimator]}, which the RL "
                f"loop does not run yet; expected one of {OUTCOME_ESTIMATORS}"
            )
        _check(
            self.adv_estimator in OUTCOME_ESTIMATORS,
            "algorithm.adv_estimator",
            self.adv_estimator,
            f"one of {OUTCOME_ESTIMATORS}",
        )


OUTCOME_ESTIMATORS = ("grpo", "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


@dataclass
class DataConfig:
    """Prompts."""

    train_files: list[str] = field(default_factory=list)  #: parquet files in verl's schema; empty = synthetic task
    synthetic_task: str = "copy_digit"  #: task written into the run dir when train_files is empty
    synthetic_num_prompts: int = 512
    batch_size: int = 8  #: prompts per RL step
    max_prompt_length: int = 64  #: longer prompts are refused (overlong=error) or dropped
    overlong: str = "error"  #: error | drop
    shuffle: bool = True
    seed: int = 0

    def validate(self) -> None:
        _positive("data.batch_size", self.batch_size)
        _check(self.overlong in ("error", "drop"), "data.overlong", self.overlong, "error or drop")


@dataclass
class RewardConfig:
    """Reward function (verl's custom_reward_function: path + name), else built-ins by data_source."""

    path: str | None = None
    name: str | None = None
    num_threads: int = 1
    timeout_s: float | None = None


@dataclass
class TrainerConfig:
    """The run."""

    steps: int = 40  #: RL steps
    runtime: str = "cpu"  #: cpu (gloo, opt-in) | cuda (NCCL)
    run_dir: str = "runs/latest"  #: metrics.jsonl and artifacts go here
    seed: int = 0
    ray_address: str | None = None  #: null = start a local Ray
    ray_num_cpus: int | None = None  #: logical CPUs for a local Ray (null = enough for the actors)
    #: save a training checkpoint into <run_dir>/checkpoints every this many steps and after the last; 0 = never
    save_every: int = 0
    keep_last: int | None = 2  #: checkpoints kept (older ones deleted after each save); null = keep all
    #: auto (the latest checkpoint in <run_dir>/checkpoints, else a new run) | a checkpoint dir | null (a new run)
    resume: str | None = None

    def validate(self) -> None:
        _positive("trainer.steps", self.steps)
        _check(self.runtime in ("cpu", "cuda"), "trainer.runtime", self.runtime, "cpu or cuda")
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


@dataclass
class RLConfig:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def validate(self) -> None:
        for group in (self.model, self.actor, self.rollout, self.sync, self.algorithm, self.data, self.trainer):
            group.validate()
        self.check_model()
        if self.trainer.resume is not None or self.trainer.save_every:
            from mcore_rl.checkpoint.manager import check_resume

            check_resume(self)  # a resume target that is not a compatible checkpoint: refused before anything starts
        if self.sync.transport == "tensor" and self.rollout.engine == "sglang" and self.rollout.sglang.nnodes > 1:
            raise ConfigError(
                "sync.transport='tensor' is invalid with rollout.sglang.nnodes > 1: the tensor transport shares memory "
                "(or CUDA IPC handles) within one node; expected sync.transport=distributed or disk"
            )
        total = self.data.batch_size * self.rollout.n
        dp = self.actor.layout.to_layout().dp(self.actor.world_size)
        _check(
            total % (self.actor.mini_batches * dp) == 0,
            "actor.mini_batches",
            self.actor.mini_batches,
            f"a divisor of data.batch_size*rollout.n/dp = {total}/{dp}",
        )

    def check_model(self) -> None:
        """Refuse an unknown model_type or a layout that does not divide the model, before any process starts."""
        import json
        import os

        from mcore_rl.models.base import HFConfig, get_family

        if self.model.path:
            config_path = os.path.join(self.model.path, "config.json")
            if not os.path.isfile(config_path):
                raise ConfigError(f"model.path={self.model.path!r}: {config_path} does not exist")
            with open(config_path) as f:
                hf = HFConfig(json.load(f))
        else:
            hf = HFConfig(self.model.hf_config)
        family = get_family(hf.model_type)
        self.actor.layout.to_layout().validate(self.actor.world_size, family.shape(hf))


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
