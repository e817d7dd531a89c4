"""verl's key tree, translated: one declarative table from each verl key to our field (with a value converter), or the
reason it is ignored here, or what would be lost (then it is refused).

    python -m mcore_rl.train <verl's overrides, as in verl's launch scripts>     # translated by compat/verl/cli.py
    python -m mcore_rl.train --print-config <overrides>                         # the translated config, our keys

A key is looked up exactly first, then by the longest matching prefix (`PREFIXES`: whole verl sub-trees with one
meaning, such as `*.fsdp_config.*`). Values arrive parsed by Hydra's override grammar, as verl parses them. Some verl
keys only mean something together (ppo_mini_batch_size against train_batch_size, the GPUs against the rollout's TP):
those are `Derived` here and computed once every key is read (compat/verl/cli.py's `derive`).

`VERL_DEFAULTS` holds verl's defaults for the fields where ours differ or are set by verl's own value (lr, prompt and
response length: ours are verl's today, pinned here so a verl command keeps them); they apply to every command that
uses a verl key, below what the command sets. This module imports nothing above the config layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class VerlValueError(ValueError):
    """A verl value that cannot be honoured here; the message says what was expected."""


@dataclass(frozen=True)
class Map:
    """verl key -> our field, through `convert` (identity when None; may raise VerlValueError)."""

    ours: str
    convert: Callable[[Any], Any] | None = None
    note: str = ""  #: printed with the translation when the meaning differs in a way a user should know


@dataclass(frozen=True)
class Derived:
    """Read now, turned into our fields once every key is known (compat/verl/cli.py's `derive`)."""

    ours: str  #: the fields it ends up in, for the printout and the docs


@dataclass(frozen=True)
class Ignore:
    """Accepted and ignored; `accept(value)` False means the setting would be lost: refused with `lost`."""

    reason: str
    accept: Callable[[Any], bool] | None = None
    lost: str = ""


@dataclass(frozen=True)
class Refuse:
    """No meaning we can honour: refused, naming what would be lost."""

    lost: str


Rule = Map | Derived | Ignore | Refuse


# --- value converters -----------------------------------------------------------------------------------------------


def to_list(value: Any) -> list[Any]:
    """verl accepts a bare string where a list is meant (data.train_files=path.parquet, trainer.logger=console)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise VerlValueError(f"a string or a list, got {type(value).__name__}")


def _null_if_negative(value: Any) -> Any:
    return None if value is None or (isinstance(value, (int, float)) and value < 0) else value


def _zero_if_negative(value: Any) -> Any:
    return 0 if value is None or value < 0 else value


def _policy_loss(value: Any) -> str:
    names = {"vanilla": "ppo", "gspo": "gspo"}
    if value not in names:
        raise VerlValueError(f"one of {tuple(names)} (verl's loss_mode: vanilla = our ppo, gspo = gspo)")
    return names[value]


def _rollout_engine(value: Any) -> str:
    """verl's rollout.name -> rollout.engine, where our RolloutConfig accepts that engine (asked, not listed here)."""
    from mcore_rl.config.checks import ConfigError
    from mcore_rl.config.rollout import RolloutConfig

    engines = {"sglang": "sglang", "vllm": "vllm", "hf": "hf"}
    if value not in engines:
        raise VerlValueError(f"one of {tuple(engines)}")
    try:
        RolloutConfig(engine=engines[value]).validate()
    except ConfigError as err:
        raise VerlValueError(
            f"an engine this build runs ({err}); rollout.name=sglang runs SGLang servers with the same sampling"
        ) from None
    return engines[value]


def _bucket_bytes(megabytes: Any) -> int:
    return int(megabytes) << 20


def _dispatcher(value: Any) -> str | None:
    """verl's moe_token_dispatcher_type -> actor.moe_dispatcher (alltoall | flex; null = the runtime's)."""
    if value in ("alltoall", "flex"):
        return value
    raise VerlValueError("alltoall or flex (Megatron's allgather dispatcher is the CPU runtime's own choice)")


def _bool_or_null(value: Any) -> bool | None:
    """A verl switch that our config leaves to the runtime when null (true | false | null)."""
    if value is None or isinstance(value, bool):
        return value
    raise VerlValueError("true, false or null")


def _falsy(value: Any) -> bool:
    return value in (None, False, 0, "", [], {}, "null")


def _is(*accepted: Any) -> Callable[[Any], bool]:
    return lambda value: value in accepted


def _staleness_versions(value: Any) -> int:
    """verl's async_training.staleness_threshold: how many batches beyond the one being trained the rollout may
    generate (its queue holds (threshold + 1) batches with one update per push): our max_staleness in versions."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise VerlValueError(
            f"a whole number of weight versions >= 0 (rollout.max_staleness), got {value!r}; a fraction of a batch "
            "is not a bound a sample's tokens can be held to"
        )
    return int(value)


def _top_k_off(value: Any) -> bool:
    return value in (None, -1, 0)


# --- the table ------------------------------------------------------------------------------------------------------
AR = "actor_rollout_ref"
_FUSION = (
    "always on here: the family's config builder enables Megatron's fused kernels whenever Transformer Engine is in use"
)
_OFFLOAD = (
    "colocated placement (verl's hybrid engine) offloads the actor's weights, gradients and optimizer state while the "
    "engines generate (controller/placement.py)"
)
_NO_FSDP = "FSDP setting; the actor is always Megatron here (its layout: actor.layout.*)"
_LAYOUT = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "virtual_pipeline_model_parallel_size": "vpp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "sequence_parallel": "sequence_parallel",
}


def _optim(verl: str, ours: str) -> dict[str, Rule]:
    """verl's optim group (actor's and critic's) -> our OptimConfig."""
    return {
        f"{verl}.lr": Map(f"{ours}.lr"),
        f"{verl}.weight_decay": Map(f"{ours}.weight_decay"),
        f"{verl}.clip_grad": Map(f"{ours}.clip_grad"),
        f"{verl}.lr_warmup_steps": Map(f"{ours}.lr_warmup_steps", _zero_if_negative, "-1 (verl: use the ratio) = 0"),
        f"{verl}.lr_warmup_steps_ratio": Map(f"{ours}.lr_warmup_ratio", lambda v: v or None),
        f"{verl}.lr_decay_style": Map(f"{ours}.lr_decay_style"),
        f"{verl}.lr_decay_steps": Map(f"{ours}.lr_decay_steps"),
        f"{verl}.min_lr": Map(f"{ours}.min_lr"),
        f"{verl}.betas": Derived(f"{ours}.adam_beta1, {ours}.adam_beta2"),
        f"{verl}.total_training_steps": Ignore("verl fills it in from the trainer; ours spans trainer.steps"),
        f"{verl}.optimizer": Ignore("Megatron's Adam(W) here", _is("adam", "adamw"), "optimizers other than Adam"),
        f"{verl}.lr_warmup_init": Ignore("warmup starts from 0 here", _is(0, 0.0), "a non-zero warmup start"),
        f"{verl}.weight_decay_incr_style": Ignore("constant here", _is("constant"), "a weight-decay schedule"),
        f"{verl}.use_checkpoint_opt_param_scheduler": Ignore("the schedule is saved with the checkpoint", _falsy),
        f"{verl}.override_optimizer_config.optimizer_offload_fraction": Map(f"{ours}.offload_fraction"),
        f"{verl}.override_optimizer_config.optimizer_cpu_offload": Ignore(
            f"what it asks is {ours}.offload_fraction > 0 (Megatron's HybridDeviceOptimizer)"
        ),
        f"{verl}.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d": Ignore(
            "Megatron's HybridDeviceOptimizer overlaps its copies by default"
        ),
        f"{verl}.override_optimizer_config.use_precision_aware_optimizer": Ignore(
            "Adam state stays fp32 (Megatron's default): the same update, more optimizer memory"
        ),
        f"{verl}.override_optimizer_config.overlap_param_gather": Ignore(
            "Megatron's OptimizerConfig copy of the setting (megatron-core 0.16 reads it for MXFP8 only; verl's hooks "
            "only with align_param_gather); the gather overlaps by megatron.override_ddp_config.overlap_param_gather "
            f"({ours}.overlap_param_gather), which sets both here"
        ),
    }


def _offload(ours: str) -> Ignore:
    """The actor's state goes to the host while colocated engines generate; the critic's stays on its GPUs (only the
    actor is offloaded: controller/placement.py), so asking to offload the critic is refused, not dropped."""
    if ours == "actor":
        return Ignore(_OFFLOAD)
    return Ignore(
        "the critic stays on its GPUs while the engines generate (only the actor is offloaded)",
        _falsy,
        "offloading the critic while the engines generate (the dry run counts it resident)",
    )


def _megatron(verl: str, ours: str) -> dict[str, Rule]:
    """verl's megatron group -> our LayoutConfig (plus what it means elsewhere)."""
    rules: dict[str, Rule] = {f"{verl}.{k}": Map(f"{ours}.layout.{v}") for k, v in _LAYOUT.items()}
    rules.update(
        {
            **{f"{verl}.{what}": _offload(ours) for what in ("param_offload", "grad_offload", "optimizer_offload")},
            f"{verl}.use_distributed_optimizer": Map(f"{ours}.optim.distributed"),
            # verl's Megatron workers build DDP with overlap_grad_reduce=False under these overrides (and Megatron's
            # overlap_param_gather=False); absent here, ours resolve per runtime (on for CUDA, KEPT_DEFAULTS)
            f"{verl}.override_ddp_config.overlap_grad_reduce": Map(
                f"{ours}.optim.overlap_grad_reduce", _bool_or_null, "null: on for trainer.runtime=cuda, off for cpu"
            ),
            f"{verl}.override_ddp_config.overlap_param_gather": Map(
                f"{ours}.optim.overlap_param_gather",
                _bool_or_null,
                "needs the distributed optimizer and the overlapped reduce; null: on exactly when both are",
            ),
            f"{verl}.use_mbridge": Ignore("HF weights convert through the family's weight map (mcore_rl/models/)"),
            f"{verl}.vanilla_mbridge": Ignore("HF weights convert through the family's weight map (mcore_rl/models/)"),
            f"{verl}.use_dist_checkpointing": Ignore(
                "the model loads from its HF checkpoint; training checkpoints are torch_dist already",
                _falsy,
                "starting from a Megatron dist checkpoint (convert it with tools/ to HF first)",
            ),
            f"{verl}.dist_checkpointing_path": Ignore("only read with use_dist_checkpointing", _falsy, "its path"),
            f"{verl}.dist_checkpointing_prefix": Ignore("only read with use_dist_checkpointing"),
            f"{verl}.seed": Ignore("the ranks' seed is trainer.seed here"),
            f"{verl}.use_remove_padding": Ignore("micro-batches are padded to their longest sequence; same loss"),
            f"{verl}.dtype": Map("model.dtype", lambda v: {"bf16": "bfloat16", "fp32": "float32"}.get(v, v)),
            f"{verl}.override_transformer_config.recompute_granularity": Derived("actor.recompute"),
            f"{verl}.override_transformer_config.recompute_method": Derived("actor.recompute"),
            f"{verl}.override_transformer_config.recompute_num_layers": Derived("actor.recompute"),
            f"{verl}.override_transformer_config.recompute_modules": Derived("actor.recompute"),
            f"{verl}.override_transformer_config.attention_backend": Ignore(
                "Transformer Engine picks flash/fused attention"
            ),
            f"{verl}.override_transformer_config.moe_router_dtype": Ignore(
                "the MoE families route in fp32 here", _is("fp32", "float32", None), "a router dtype other than fp32"
            ),
        }
    )
    if ours == "actor":  # the actor's MoE dispatcher settings (the critic's group has none: it uses the runtime's)
        rules[f"{verl}.override_transformer_config.moe_token_dispatcher_type"] = Map(
            "actor.moe_dispatcher", _dispatcher, "flex is DeepEP's dispatcher: pre-flight checks TE, CUDA and deep_ep"
        )
        rules[f"{verl}.override_transformer_config.moe_enable_deepep"] = Derived("actor.moe_dispatcher (flex)")
        rules[f"{verl}.override_transformer_config.moe_permute_fusion"] = Map("actor.moe_permute_fusion")
    else:
        for knob in ("moe_token_dispatcher_type", "moe_enable_deepep", "moe_permute_fusion"):
            rules[f"{verl}.override_transformer_config.{knob}"] = Ignore("the critic's MoE layers use the runtime's")
    for fusion in (
        "apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
        "gradient_accumulation_fusion", "persist_layer_norm", "moe_grouped_gemm", "deallocate_pipeline_outputs",
        "cross_entropy_loss_fusion",
    ):  # fmt: skip
        rules[f"{verl}.override_transformer_config.{fusion}"] = Ignore(_FUSION)
    return rules


def _ref_same(what: str) -> Ignore:
    return Ignore(f"the reference runs inside the actor's ranks here, with the actor's {what}")


VERL_KEYS: dict[str, Rule] = {
    # data
    "data.train_files": Map("data.train_files", to_list),
    "data.val_files": Map("data.val_files", to_list),
    "data.train_batch_size": Map("data.batch_size"),
    "data.val_batch_size": Map("data.val_batch_size"),
    "data.gen_batch_size": Ignore(
        "dynamic sampling generates data.batch_size prompts per round, up to algorithm.filter_groups."
        "max_num_gen_batches rounds: the same groups, in more (smaller) rounds"
    ),
    "data.max_prompt_length": Map("data.max_prompt_length"),
    "data.max_response_length": Map("rollout.max_new_tokens"),
    "data.filter_overlong_prompts": Derived("data.overlong"),
    "data.truncation": Derived("data.overlong"),
    "data.prompt_key": Map("data.prompt_key"),
    "data.shuffle": Map("data.shuffle"),
    "data.seed": Map("data.seed", lambda v: 1 if v is None else v),
    "data.tokenizer": Map("model.tokenizer"),
    "data.return_raw_chat": Ignore("prompts are kept as chat messages and templated once, here"),
    "data.return_raw_input_ids": Ignore("prompts are kept as chat messages and templated once, here"),
    "data.return_full_prompt": Ignore("prompts are kept as chat messages and templated once, here"),
    "data.reward_fn_key": Ignore("rewards are chosen by data_source here", _is("data_source"), "another reward key"),
    "data.dataloader_num_workers": Ignore("prompts are tokenized once, up front (data/dataset.py)"),
    "data.filter_overlong_prompts_workers": Ignore("prompts are tokenized once, up front (data/dataset.py)"),
    "data.validation_shuffle": Ignore("validation goes through the set in order", _falsy, "a shuffled validation"),
    "data.use_shm": Ignore("files are read from their path"),
    "data.train_max_samples": Ignore("the whole file is used", _is(-1, None), "a cap on the rows read"),
    "data.val_max_samples": Ignore("the whole file is used", _is(-1, None), "a cap on the rows read"),
    "data.trust_remote_code": Ignore("no remote code runs", _falsy, "a tokenizer's remote code"),
    "data.image_key": Ignore("text-only: no image column is read"),
    "data.video_key": Ignore("text-only: no video column is read"),
    "data.return_multi_modal_inputs": Ignore("text-only"),
    "data.apply_chat_template_kwargs": Ignore("the tokenizer's template, as it is", _falsy, "chat-template arguments"),
    "data.custom_cls.path": Ignore("data/dataset.py reads verl's schema", _falsy, "a custom dataset class"),
    "data.custom_cls.name": Ignore("only read with data.custom_cls.path"),
    # the policy model
    f"{AR}.model.path": Derived("model.path"),
    f"{AR}.model.tokenizer_path": Map("model.tokenizer"),
    f"{AR}.model.enable_gradient_checkpointing": Derived("actor.recompute"),
    f"{AR}.model.use_remove_padding": Ignore(
        "micro-batches are padded to their longest sequence: the same loss; sequence packing (THD) is actor.packing "
        "here (GPU with Transformer Engine)"
    ),
    f"{AR}.model.use_fused_kernels": Ignore(_FUSION),
    f"{AR}.model.fused_kernel_options.impl_backend": Ignore(_FUSION),
    f"{AR}.model.use_liger": Ignore("Liger kernels are for HF models; the actor is Megatron with its fused kernels"),
    f"{AR}.model.trust_remote_code": Ignore("no remote code runs", _falsy, "the model's remote code"),
    f"{AR}.model.external_lib": Ignore("families are mcore_rl/models/", _falsy, "an external model library"),
    f"{AR}.model.custom_chat_template": Ignore("the tokenizer's template", _falsy, "a custom chat template"),
    f"{AR}.model.hf_config_path": Ignore("config.json of model.path", _falsy, "a separate HF config"),
    f"{AR}.model.use_shm": Ignore("the checkpoint is read from its path"),
    f"{AR}.model.enable_activation_offload": Ignore("activations stay on the GPU", _falsy, "activation offload"),
    f"{AR}.model.lora_rank": Ignore("full-parameter training", _is(0, None), "LoRA adapters (not implemented)"),
    f"{AR}.model.lora_alpha": Ignore("only read with lora_rank > 0"),
    f"{AR}.model.target_modules": Ignore("only read with lora_rank > 0"),
    f"{AR}.model.override_config.model_config.max_position_embeddings": Map(
        "model.max_sequence_length", note="the longest prompt + response the run builds for"
    ),
    f"{AR}.model.override_config.moe_config.freeze_moe_router": Ignore(
        "the router trains", _falsy, "a frozen MoE router"
    ),
    # the actor
    f"{AR}.actor.strategy": Ignore("the actor is Megatron here", _is("megatron", "fsdp", "fsdp2"), "another backend"),
    **_optim(f"{AR}.actor.optim", "actor.optim"),
    **_megatron(f"{AR}.actor.megatron", "actor"),
    f"{AR}.actor.grad_clip": Map("actor.optim.clip_grad"),
    f"{AR}.actor.ppo_mini_batch_size": Derived("actor.mini_batches"),
    f"{AR}.actor.ppo_micro_batch_size_per_gpu": Map("actor.micro_batch_size"),
    f"{AR}.actor.ppo_micro_batch_size": Refuse("a global micro-batch; set ppo_micro_batch_size_per_gpu"),
    f"{AR}.actor.use_dynamic_bsz": Derived("actor.max_tokens_per_microbatch"),
    f"{AR}.actor.ppo_max_token_len_per_gpu": Derived("actor.max_tokens_per_microbatch"),
    f"{AR}.actor.ppo_epochs": Map("actor.ppo_epochs"),
    f"{AR}.actor.shuffle": Ignore("mini-batches follow the batch's order", _falsy, "shuffled mini-batches"),
    f"{AR}.actor.data_loader_seed": Ignore("mini-batches follow the batch's order"),
    f"{AR}.actor.clip_ratio": Ignore("verl reads clip_ratio_low and clip_ratio_high (both 0.2 by default), as here"),
    f"{AR}.actor.clip_ratio_low": Map("actor.clip_ratio_low"),
    f"{AR}.actor.clip_ratio_high": Map("actor.clip_ratio_high"),
    f"{AR}.actor.clip_ratio_c": Map("actor.clip_ratio_c"),
    f"{AR}.actor.loss_agg_mode": Map("actor.loss_agg_mode"),
    f"{AR}.actor.policy_loss.loss_mode": Map("actor.policy_loss", _policy_loss),
    f"{AR}.actor.entropy_coeff": Map("actor.entropy_coef"),
    f"{AR}.actor.calculate_entropy": Ignore("the entropy is computed when entropy_coef > 0 and always logged"),
    f"{AR}.actor.use_kl_loss": Derived("actor.kl_loss_coef"),
    f"{AR}.actor.kl_loss_coef": Derived("actor.kl_loss_coef"),
    f"{AR}.actor.kl_loss_type": Map("actor.kl_loss_type"),
    f"{AR}.actor.use_torch_compile": Ignore("Megatron's own fused kernels; no torch.compile"),
    f"{AR}.actor.loss_scale_factor": Ignore("the loss is aggregated by loss_agg_mode", _falsy, "a loss scale"),
    f"{AR}.actor.router_replay.mode": Map("actor.router_replay_mode"),
    f"{AR}.actor.ulysses_sequence_parallel_size": Map(
        "actor.layout.cp", note="verl's Ulysses split (FSDP) is Megatron's context parallelism here (GPU only)"
    ),
    f"{AR}.actor.checkpoint.async_save": Ignore("checkpoints are written then renamed", _falsy, "asynchronous saves"),
    # the reference: always inside the actor's ranks here
    f"{AR}.ref.log_prob_micro_batch_size_per_gpu": Map("actor.logprob_micro_batch_size"),
    f"{AR}.ref.log_prob_use_dynamic_bsz": _ref_same("micro-batching"),
    f"{AR}.ref.log_prob_max_token_len_per_gpu": _ref_same("token budget"),
    f"{AR}.ref.ulysses_sequence_parallel_size": Derived("actor.layout.cp (must agree)"),
    f"{AR}.ref.strategy": _ref_same("backend"),
    f"{AR}.ref.use_torch_compile": Ignore("Megatron's own fused kernels; no torch.compile"),
    **{f"{AR}.ref.megatron.{k}": Derived(f"actor.layout.{v} (must agree)") for k, v in _LAYOUT.items()},
    # verl offloads the reference's weights between its passes (ref.megatron.param_offload, whose default is
    # actor.megatron.param_offload; an FSDP reference's fsdp_config.param_offload): our actor.ref_placement
    f"{AR}.actor.megatron.param_offload": Derived(
        "actor.ref_placement (when ref.megatron.param_offload is unset); the actor's weights: colocated offload"
    ),
    f"{AR}.ref.megatron.param_offload": Derived("actor.ref_placement (true: host, false: resident)"),
    f"{AR}.ref.fsdp_config.param_offload": Derived("actor.ref_placement (true: host, false: resident)"),
    f"{AR}.ref.megatron.grad_offload": Ignore("the reference has no gradients"),
    f"{AR}.ref.megatron.optimizer_offload": Ignore("the reference has no optimizer"),
    f"{AR}.ref.megatron.use_dist_checkpointing": Ignore("the reference loads model.path, as the actor"),
    f"{AR}.ref.megatron.use_mbridge": Ignore("HF weights convert through the family's weight map"),
    f"{AR}.hybrid_engine": Ignore("colocated placement (trainer.placement=colocated) is verl's hybrid engine"),
    f"{AR}.nccl_timeout": Map("sync.timeout_s"),
    # rollout
    f"{AR}.rollout.name": Map("rollout.engine", _rollout_engine),
    f"{AR}.rollout.mode": Ignore("the engines are HTTP servers (verl's async mode)", _is("async", "sync")),
    f"{AR}.rollout.n": Map("rollout.n"),
    f"{AR}.rollout.temperature": Map("rollout.temperature"),
    f"{AR}.rollout.top_p": Map("rollout.top_p"),
    f"{AR}.rollout.top_k": Ignore("no top-k truncation", _top_k_off, "top-k sampling (not wired: expected -1 or 0)"),
    f"{AR}.rollout.do_sample": Ignore("training rollouts sample", _is(True), "greedy training rollouts"),
    # the engine's own settings: rollout.sglang.* or rollout.vllm.*, by rollout.name (compat/verl/derive.py)
    f"{AR}.rollout.tensor_model_parallel_size": Derived("rollout.{sglang,vllm}.tp, rollout.num_engines"),
    f"{AR}.rollout.data_parallel_size": Derived("rollout.{sglang,vllm}.dp"),
    f"{AR}.rollout.expert_parallel_size": Derived("rollout.sglang.ep | rollout.vllm.enable_expert_parallel"),
    f"{AR}.rollout.gpu_memory_utilization": Derived(
        "rollout.sglang.mem_fraction_static (SGLang's name for it) | rollout.vllm.gpu_memory_utilization"
    ),
    f"{AR}.rollout.max_num_seqs": Map("rollout.max_running_requests"),
    f"{AR}.rollout.load_format": Derived("rollout.{sglang,vllm}.load_format"),
    f"{AR}.rollout.log_prob_micro_batch_size_per_gpu": Map("actor.logprob_micro_batch_size"),
    f"{AR}.rollout.log_prob_use_dynamic_bsz": Ignore("the old-logprob pass shares the actor's micro-batching"),
    f"{AR}.rollout.log_prob_max_token_len_per_gpu": Ignore("the old-logprob pass shares the actor's token budget"),
    f"{AR}.rollout.enable_chunked_prefill": Ignore("SGLang chunks long prefills by default"),
    f"{AR}.rollout.max_num_batched_tokens": Ignore(
        "the engine's own scheduler budget (pass it in rollout.vllm.extra_args or rollout.sglang.extra_args)"
    ),
    f"{AR}.rollout.max_model_len": Derived("rollout.vllm.max_model_len (SGLang: the model's context)"),
    f"{AR}.rollout.enforce_eager": Derived("rollout.vllm.extra_args --enforce-eager (SGLang: its own CUDA graphs)"),
    f"{AR}.rollout.free_cache_engine": Ignore("colocated engines release weights and KV cache while the actor trains"),
    f"{AR}.rollout.enable_prefix_caching": Ignore("the engines' prefix caches are on (SGLang's radix cache, vLLM's)"),
    f"{AR}.rollout.disable_log_stats": Ignore("engine logs go to <run_dir>/rollout"),
    f"{AR}.rollout.cudagraph_capture_sizes": Ignore("the engine's own CUDA graph sizes (its extra_args)"),
    f"{AR}.rollout.dtype": Ignore("engines serve model.dtype"),
    f"{AR}.rollout.ignore_eos": Ignore("responses stop at eos", _falsy, "generation past eos"),
    f"{AR}.rollout.calculate_log_probs": Ignore("the engines always return their logprobs"),
    f"{AR}.rollout.skip_tokenizer_init": Map("rollout.sglang.skip_tokenizer_init"),
    f"{AR}.rollout.over_sample_rate": Ignore("every request finishes", _is(0, 0.0, None), "over-sampling"),
    f"{AR}.rollout.checkpoint_engine.update_weights_bucket_megabytes": Map("sync.bucket_bytes", _bucket_bytes),
    f"{AR}.rollout.agent.num_workers": Ignore("requests are concurrent HTTP calls"),
    f"{AR}.rollout.multi_turn.enable": Map("agent.enabled"),
    f"{AR}.rollout.multi_turn.max_assistant_turns": Map("agent.max_turns"),
    f"{AR}.rollout.multi_turn.format": Map("agent.chat_format"),
    f"{AR}.rollout.val_kwargs.n": Derived("rollout.val_n"),
    f"{AR}.rollout.val_kwargs.do_sample": Derived("rollout.val_n"),
    f"{AR}.rollout.val_kwargs.temperature": Map("rollout.val_temperature"),
    f"{AR}.rollout.val_kwargs.top_p": Map("rollout.val_top_p"),
    f"{AR}.rollout.val_kwargs.top_k": Ignore("no top-k truncation", _top_k_off, "top-k sampling (expected -1 or 0)"),
    # critic
    "critic.strategy": Ignore("the critic is Megatron here", _is("megatron", "fsdp", "fsdp2"), "another backend"),
    "critic.model.path": Derived("critic.path"),
    "critic.model.tokenizer_path": Ignore("the critic reads the policy's tokens"),
    "critic.model.enable_gradient_checkpointing": Ignore(
        "the critic keeps its activations (it has no recompute setting here): more memory, the same values"
    ),
    "critic.model.use_remove_padding": Ignore("micro-batches are padded to their longest sequence; the same loss"),
    "critic.model.trust_remote_code": Ignore("no remote code runs", _falsy, "the model's remote code"),
    **_optim("critic.optim", "critic.optim"),
    **_megatron("critic.megatron", "critic"),
    "critic.ppo_mini_batch_size": Derived("critic.mini_batches"),
    "critic.ppo_micro_batch_size_per_gpu": Map("critic.micro_batch_size"),
    "critic.ppo_micro_batch_size": Refuse("a global micro-batch; set critic.ppo_micro_batch_size_per_gpu"),
    "critic.use_dynamic_bsz": Derived("critic.max_tokens_per_microbatch"),
    "critic.ppo_max_token_len_per_gpu": Derived("critic.max_tokens_per_microbatch"),
    "critic.forward_max_token_len_per_gpu": Ignore("the value pass shares the critic's token budget"),
    "critic.grad_clip": Map("critic.optim.clip_grad"),
    "critic.ulysses_sequence_parallel_size": Map("critic.layout.cp"),
    "critic.shuffle": Ignore("mini-batches follow the batch's order", _falsy, "shuffled mini-batches"),
    # reward
    "reward_model.enable": Derived("reward.model_path"),
    "reward_model.model.path": Derived("reward.model_path"),
    "reward_model.model.input_tokenizer": Ignore("the reward model scores the decoded text with its own tokenizer"),
    "reward_model.micro_batch_size_per_gpu": Ignore("the reward-model worker scores a step in one batch"),
    "reward_model.reward_manager": Ignore(
        "rule rewards are scored per response (naive); DAPO's manager is naive + reward.overlong_buffer",
        _is("naive", "dapo", "batch"),
        "a reward manager other than naive, dapo or batch",
    ),
    "reward_model.launch_reward_fn_async": Ignore("rewards are scored on reward.num_threads threads"),
    "reward_model.overlong_buffer.enable": Map("reward.overlong_buffer.enable"),
    "reward_model.overlong_buffer.len": Map("reward.overlong_buffer.len"),
    "reward_model.overlong_buffer.penalty_factor": Map("reward.overlong_buffer.penalty_factor"),
    "reward_model.overlong_buffer.log": Ignore("the overlong penalty is always logged"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": Map("reward.overlong_buffer.enable"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": Map("reward.overlong_buffer.len"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": Map("reward.overlong_buffer.penalty_factor"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": Ignore("the overlong penalty is always logged"),
    "reward_model.reward_kwargs.max_resp_len": Ignore(
        "the ramp ends at rollout.max_new_tokens (data.max_response_length)"
    ),
    "reward_model.sandbox_fusion.url": Ignore(
        "code is run in the local sandbox (reward/sandbox.py)",
        _falsy,
        "a SandboxFusion server (set reward.path to code_reward's scorer)",
    ),
    "custom_reward_function.path": Map("reward.path", lambda v: v or None),
    "custom_reward_function.name": Derived("reward.name"),
    "custom_reward_function.reward_kwargs": Map("reward.kwargs", lambda v: dict(v or {})),
    # algorithm (most keys are ours as they are)
    "algorithm.adv_estimator": Derived("algorithm.adv_estimator, critic.enable"),
    "algorithm.norm_adv_by_std_in_grpo": Map("algorithm.norm_adv_by_std"),
    "algorithm.filter_groups.metric": Ignore(
        "groups are filtered on the sequence reward; for math_dapo acc = (score > 0), the same groups unless an "
        "overlong penalty splits them",
        _is("acc", "score", "seq_reward", "seq_final_reward"),
        "another metric",
    ),
    "algorithm.use_pf_ppo": Ignore("uniform sampling", _falsy, "priority-filtered PPO (not implemented)"),
    "algorithm.rollout_correction.bypass_mode": Ignore("off", _falsy, "bypass mode (not implemented)"),
    "algorithm.rollout_correction.loss_type": Ignore("ppo_clip", _is("ppo_clip"), "another correction loss"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": Ignore("off", _falsy, "batch-normalised weights"),
    # generation ahead of training (verl's fully-async trainer: the async_training tree)
    "async_training.staleness_threshold": Map("rollout.max_staleness", _staleness_versions),
    "async_training.partial_rollout": Map("rollout.partial_rollout", bool),
    "async_training.trigger_parameter_sync_step": Ignore(
        "one push after every update", _is(1), "several updates per push"
    ),
    "async_training.require_batches": Ignore(
        "a step trains data.batch_size prompts", _is(1), "several batches per update"
    ),
    "async_training.use_rollout_log_probs": Ignore(
        "stale tokens are weighed against the engines' own logprobs (actor.stale_tis_cap)",
        bool,
        "stale tokens trained without the engines' logprobs",
    ),
    # trainer
    "trainer.total_epochs": Derived("trainer.steps"),
    "trainer.total_training_steps": Derived("trainer.steps"),
    "trainer.logger": Map("trainer.loggers", lambda v: list(dict.fromkeys([*to_list(v), "jsonl"]))),
    "trainer.nnodes": Derived("actor.world_size, critic.world_size, rollout.num_engines"),
    "trainer.n_gpus_per_node": Derived("actor.world_size, critic.world_size, rollout.num_engines"),
    "trainer.save_freq": Map("trainer.save_every", _zero_if_negative),
    "trainer.test_freq": Map("trainer.val_every", _zero_if_negative),
    "trainer.critic_warmup": Map("critic.warmup_steps"),
    "trainer.resume_mode": Derived("trainer.resume"),
    "trainer.resume_from_path": Derived("trainer.resume"),
    "trainer.default_local_dir": Map("trainer.run_dir", note="checkpoints go to <run_dir>/checkpoints"),
    "trainer.max_actor_ckpt_to_keep": Map("trainer.keep_last"),
    "trainer.max_critic_ckpt_to_keep": Ignore("the critic is saved with the actor (trainer.keep_last)"),
    "trainer.log_val_generations": Ignore("validation logs scores, not generations"),
    "trainer.balance_batch": Ignore(
        "dp shards are balanced by tokens only with actor.dynamic_batching=true (needs actor.layout.ep=1): the same "
        "loss, the slowest rank sets the pace"
    ),
    "trainer.device": Map("trainer.runtime", lambda v: {"cuda": "cuda", "cpu": "cpu"}.get(v, v)),
    "trainer.default_hdfs_dir": Ignore("checkpoints stay in trainer.run_dir", _falsy, "copies to HDFS"),
    "trainer.del_local_ckpt_after_load": Ignore("checkpoints are kept (trainer.keep_last)", _falsy, "deletion"),
    "trainer.esi_redundant_time": Ignore("no ESI preemption handling"),
    "trainer.ray_wait_register_center_timeout": Ignore("workers report through Ray directly"),
    "trainer.rollout_data_dir": Map("trainer.rollout_data_dir"),
    "trainer.use_legacy_worker_impl": Ignore("one worker implementation here"),
    "ray_kwargs.ray_init.num_cpus": Map("trainer.ray_num_cpus"),
}

#: whole verl sub-trees with one meaning here (the longest matching prefix wins; `*` is one key part)
PREFIXES: dict[str, Rule] = {
    f"{AR}.actor.fsdp_config.": Ignore(_NO_FSDP),
    f"{AR}.ref.fsdp_config.": Ignore(_NO_FSDP),
    f"{AR}.ref.megatron.override_ddp_config.": Ignore("the reference is not trained: it has no DDP wrapper"),
    "critic.model.fsdp_config.": Ignore(_NO_FSDP),
    "critic.fsdp_config.": Ignore(_NO_FSDP),
    "*.profiler.": Ignore("profiling: tools/profile_step.py and trainer timings (timing_s/*)"),
    "*.*.profiler.": Ignore("profiling: tools/profile_step.py and trainer timings (timing_s/*)"),
    "global_profiler.": Ignore("profiling: tools/profile_step.py and trainer timings (timing_s/*)"),
    f"{AR}.actor.checkpoint.": Ignore("checkpoints hold model, optimizer and loop state, always"),
    "critic.checkpoint.": Ignore("checkpoints hold model, optimizer and loop state, always"),
    f"{AR}.rollout.engine_kwargs.vllm.": Ignore("vLLM's engine arguments; read only with rollout.engine=vllm"),
    f"{AR}.rollout.engine_kwargs.sglang.": Refuse("SGLang launch arguments: pass them as rollout.sglang.extra_args"),
    f"{AR}.rollout.trace.": Ignore("no rollout tracing"),
    f"{AR}.model.lora.": Ignore("only read with LoRA, which is not implemented"),
    "critic.model.lora.": Ignore("only read with LoRA, which is not implemented"),
    f"{AR}.model.mtp.": Ignore("MTP layers follow model.mtp (auto)"),
    "transfer_queue.": Ignore("no transfer queue: batches move through Ray"),
    "ray_kwargs.timeline_json_file": Ignore("no Ray timeline dump"),
    "reward_manager.": Ignore("rule rewards are scored per response (verl's naive manager)"),
}

#: verl's defaults where ours differ, and where ours are verl's value (actor and critic lr, prompt and response length:
#: pinned, so a verl command keeps verl's whatever ours become): our key -> (value, the verl key); applied below the
#: command's own keys
VERL_DEFAULTS: dict[str, tuple[Any, str]] = {
    "algorithm.adv_estimator": ("gae", "algorithm.adv_estimator"),
    "actor.clip_ratio_high": (0.2, f"{AR}.actor.clip_ratio_high"),
    "actor.optim.lr": (1e-6, f"{AR}.actor.optim.lr"),
    "actor.optim.weight_decay": (0.01, f"{AR}.actor.optim.weight_decay"),
    "critic.optim.lr": (1e-5, "critic.optim.lr"),
    "critic.optim.weight_decay": (0.01, "critic.optim.weight_decay"),
    "rollout.n": (1, f"{AR}.rollout.n"),
    "rollout.max_new_tokens": (512, "data.max_response_length"),
    "rollout.val_n": (0, f"{AR}.rollout.val_kwargs.do_sample"),
    "data.batch_size": (1024, "data.train_batch_size"),
    "data.max_prompt_length": (512, "data.max_prompt_length"),
    "data.seed": (1, "data.seed"),
    "model.dtype": ("bfloat16", f"{AR}.actor.megatron.dtype"),
    "trainer.val_before_train": (True, "trainer.val_before_train"),
    "trainer.runtime": ("cuda", "trainer.device"),
    "trainer.placement": ("colocated", f"{AR}.hybrid_engine"),
    "trainer.resume": ("auto", "trainer.resume_mode"),
    "trainer.project_name": ("verl_examples", "trainer.project_name"),
    "trainer.experiment_name": ("gsm8k", "trainer.experiment_name"),
    "trainer.loggers": (["console", "jsonl"], "trainer.logger (verl's yaml adds wandb; here only when named)"),
    "rollout.engine": ("sglang", f"{AR}.rollout.name"),
    "sync.timeout_s": (600.0, f"{AR}.nccl_timeout"),
}

#: verl's defaults a verl command does NOT get: our key -> (verl's value, its verl key, why ours is kept). Each is a
#: placement or an overlap that leaves the numbers of a step as they are (tests/test_reference_swap.py,
#: tests/test_overlap_reduce.py) and saves GPU memory or time; the verl key given explicitly is honoured.
KEPT_DEFAULTS: dict[str, tuple[Any, str, str]] = {
    "actor.ref_placement": (
        "resident",
        f"{AR}.ref.megatron.param_offload (False: actor.megatron.param_offload's)",
        "null = host on CUDA: the same reference logprobs with one model's weights less per GPU, for a copy of them "
        "from pinned host memory per reference pass; ref.megatron.param_offload=False keeps verl's resident one",
    ),
    "actor.optim.overlap_grad_reduce": (
        False,
        f"{AR}.actor.megatron.override_ddp_config.overlap_grad_reduce",
        "null = on for CUDA: the same parameters, the gradient reduce under the backward (critic.optim's too)",
    ),
    "actor.optim.overlap_param_gather": (
        False,
        f"{AR}.actor.megatron.override_ddp_config.overlap_param_gather",
        "null = on with the distributed optimizer and the overlapped reduce: the same parameters, the all-gather "
        "under the next forward (critic.optim's too)",
    ),
}

#: verl's defaults read by `derive` when a command does not set them (verl key -> value)
VERL_INPUT_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.truncation": "error",
    "data.filter_overlong_prompts": False,
    f"{AR}.actor.ppo_mini_batch_size": 256,
    f"{AR}.actor.ppo_max_token_len_per_gpu": 16384,
    "critic.ppo_max_token_len_per_gpu": 32768,
    f"{AR}.actor.use_kl_loss": False,
    f"{AR}.actor.kl_loss_coef": 0.001,
    f"{AR}.rollout.tensor_model_parallel_size": 2,
    f"{AR}.model.enable_gradient_checkpointing": True,
    f"{AR}.rollout.val_kwargs.n": 1,
    f"{AR}.rollout.val_kwargs.do_sample": False,
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8,
    "trainer.total_epochs": 30,
    "trainer.resume_mode": "auto",
    "algorithm.adv_estimator": "gae",
    "custom_reward_function.name": "compute_score",
}

#: verl's --config-name values and what they mean here
VERL_CONFIG_NAMES = {
    "ppo_trainer": "verl's FSDP defaults; the actor is Megatron here, with verl's Megatron defaults",
    "ppo_megatron_trainer": "verl's Megatron defaults (VERL_DEFAULTS)",
}


def lookup(key: str) -> Rule | None:
    """The rule of a verl key (without a leading `+`): exact, else the longest matching prefix, else None."""
    if key in VERL_KEYS:
        return VERL_KEYS[key]
    parts = key.split(".")
    best: tuple[int, Rule] | None = None
    for prefix, rule in PREFIXES.items():
        pattern = prefix.rstrip(".").split(".")
        if len(parts) < len(pattern) or (not prefix.endswith(".") and len(parts) != len(pattern)):
            continue
        if all(p in ("*", k) for p, k in zip(pattern, parts)) and (best is None or len(prefix) > best[0]):
            best = (len(prefix), rule)
    return best[1] if best else None


def markdown_table() -> str:
    """The table above as markdown (docs/verl_keys.md is this output: `python -m mcore_rl.compat.verl.keys`)."""

    def row(key: str, rule: Rule) -> str:
        if isinstance(rule, Map):
            return f"| `{key}` | `{rule.ours}` | mapped{': ' + rule.note if rule.note else ''} |"
        if isinstance(rule, Derived):
            return f"| `{key}` | `{rule.ours}` | computed with other keys (compat/verl/derive.py) |"
        if isinstance(rule, Ignore):
            refused = f"; refused when it asks for {rule.lost}" if rule.accept is not None and rule.lost else ""
            return f"| `{key}` | ignored | {rule.reason}{refused} |"
        return f"| `{key}` | refused | {rule.lost} |"

    defaults = [f"| `{ours}` | `{value!r}` | `{verl}` |" for ours, (value, verl) in VERL_DEFAULTS.items()]
    kept = [f"| `{ours}` | `{value!r}` | `{verl}` | {why} |" for ours, (value, verl, why) in KEPT_DEFAULTS.items()]
    return "\n".join(
        [
            "# verl keys on `python -m mcore_rl.train`",
            "",
            "Generated from `mcore_rl/compat/verl/keys.py` by",
            "`python -m mcore_rl.compat.verl.keys > docs/verl_keys.md` (a test checks that this file is its output).",
            "How to use it: docs/coming_from_verl.md.",
            "",
            "A command may mix verl's keys with ours. A verl key mapped to one of our keys and that key itself",
            "(`rollout.n` and `actor_rollout_ref.rollout.n`) are one setting: two different values are refused, naming",
            "both keys; equal values are accepted. A value of the wrong type for our field is named with its verl key",
            "as the key is read. A list-of-strings field takes one plain string as a list of one",
            "(`data.train_files=/x.parquet`, `trainer.logger=console`), for verl's keys and ours alike.",
            "",
            "## verl's defaults that apply to a verl command (where ours differ, or are the same value, pinned)",
            "",
            "| our key | value | verl key |",
            "| --- | --- | --- |",
            *defaults,
            "",
            "## verl's defaults that do not apply (ours stay; the verl key given explicitly is honoured)",
            "",
            "| our key | verl's value | verl key | why ours |",
            "| --- | --- | --- | --- |",
            *kept,
            "",
            "## Every verl key (`*` ends a prefix: the whole sub-tree)",
            "",
            "| verl key | here | how |",
            "| --- | --- | --- |",
            *(row(k, r) for k, r in VERL_KEYS.items()),
            *(row(k + "*", r) for k, r in PREFIXES.items()),
            "",
        ]
    )


if __name__ == "__main__":
    print(markdown_table(), end="")
