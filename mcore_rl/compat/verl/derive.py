"""verl keys that mean something only together (compat/verl/keys.py's `Derived` rules), turned into our fields.

    derive(given, settings, megatron) -> (our key -> value, one line per derived field, errors)

verl counts mini-batches in prompts (ppo_mini_batch_size) where we count optimizer steps per RL step (mini_batches);
it sizes the run by GPUs (nnodes x n_gpus_per_node, every role colocated on all of them) where we size each role;
it names a model by hub id where we read a directory (the local Hugging Face cache is looked up here).
"""

from __future__ import annotations

import os
from typing import Any

from mcore_rl.compat.verl import keys as V

AR = V.AR
TRUNCATIONS = ("error", "left", "right")


def hf_cache_dirs() -> list[str]:
    """Where huggingface_hub keeps downloaded models: HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return [os.environ["HF_HUB_CACHE"]]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return [os.path.join(home, "hub")]


def resolve_model_path(value: Any, verl_key: str, ours: str) -> str:
    """A checkpoint directory, or a hub id (`Qwen/Qwen3-8B`) found in the local HF cache: its snapshot directory.

    Raises VerlValueError naming the directories looked in (nothing is downloaded: a run reads what is here)."""
    if not isinstance(value, str) or not value:
        raise V.VerlValueError(f"{verl_key} (our {ours}): expected a checkpoint directory or a hub id, got {value!r}")
    path = os.path.expanduser(os.path.expandvars(value))
    if os.path.isdir(path):
        return path
    parts = value.split("/")
    if len(parts) != 2 or value.startswith((".", "/", "~")) or not all(parts):
        raise V.VerlValueError(
            f"{verl_key}={value!r} (our {ours}): no such directory; expected a checkpoint directory or a hub id "
            "such as Qwen/Qwen3-8B in the local Hugging Face cache"
        )
    looked = []
    for cache in hf_cache_dirs():
        repo = os.path.join(cache, "models--" + value.replace("/", "--"))
        looked.append(repo)
        ref = os.path.join(repo, "refs", "main")
        snapshots = os.path.join(repo, "snapshots")
        candidates = []
        if os.path.isfile(ref):
            with open(ref) as f:
                candidates.append(os.path.join(snapshots, f.read().strip()))
        if os.path.isdir(snapshots):
            candidates += sorted(os.path.join(snapshots, d) for d in os.listdir(snapshots))
        for snapshot in candidates:
            if os.path.isfile(os.path.join(snapshot, "config.json")):
                return snapshot
    raise V.VerlValueError(
        f"{verl_key}={value!r} (our {ours}): the hub id is not in the local Hugging Face cache (looked in "
        f"{', '.join(looked)}; set HF_HOME or HF_HUB_CACHE to the cache, or download it first: "
        f"`huggingface-cli download {value}`); nothing is downloaded by a run"
    )


def count_rows(files: list[str]) -> int:
    """Rows of parquet files from their footers (no data read)."""
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(path).num_rows for path in files)


class _Derivation:
    """State of one derive() call: the given keys (with verl's defaults), the results, the messages."""

    def __init__(self, given: dict[str, Any], settings: dict[str, Any]) -> None:
        self.given, self.settings = given, settings
        self.out: dict[str, Any] = {}
        self.lines: list[str] = []
        self.errors: list[str] = []

    def get(self, key: str) -> Any:
        """A verl key's value: as the command gave it, else as it gave our field of it, else verl's default."""
        if key in self.given:
            return self.given[key]
        rule = V.VERL_KEYS.get(key)
        if isinstance(rule, V.Map) and rule.convert is None and rule.ours in self.settings:
            return self.settings[rule.ours]
        return V.VERL_INPUT_DEFAULTS.get(key)

    def set(self, ours: str, value: Any, why: str) -> None:
        self.out[ours] = value
        self.lines.append(f"{why} -> {ours}={value!r}")

    def fail(self, message: str) -> None:
        self.errors.append(message)

    def current(self, ours: str, default: Any) -> Any:
        """Our value as the command set it (a mapped key), else what derive set, else `default`."""
        return self.settings.get(ours, self.out.get(ours, default))


def derive(
    given: dict[str, Any], settings: dict[str, Any], megatron: bool
) -> tuple[dict[str, Any], list[str], list[str]]:
    """See the module docstring; `megatron` = the command is one of verl's Megatron scripts."""
    d = _Derivation(given, settings)
    _data(d)
    _models(d)
    _batches(d, "actor", f"{AR}.actor")
    _gpus(d)
    _algorithm(d)
    _recompute(d, megatron)
    _deepep(d)
    _validation(d)
    _trainer(d)
    _reference(d)
    _ref_placement(d, megatron)
    for verl_key, ours in ((f"{AR}.actor.optim.betas", "actor.optim"), ("critic.optim.betas", "critic.optim")):
        if verl_key in given:
            betas = given[verl_key]
            if not isinstance(betas, (list, tuple)) or len(betas) != 2:
                d.fail(f"verl's {verl_key}={betas!r} (our {ours}.adam_beta1/2) is invalid: expected [beta1, beta2]")
            else:
                d.set(f"{ours}.adam_beta1", betas[0], verl_key)
                d.set(f"{ours}.adam_beta2", betas[1], verl_key)
    return d.out, d.lines, d.errors


def _data(d: _Derivation) -> None:
    prompt, response = d.get("data.max_prompt_length"), d.get("data.max_response_length")
    if "model.max_sequence_length" not in d.settings and isinstance(prompt, int) and isinstance(response, int):
        d.set("model.max_sequence_length", prompt + response, "data.max_prompt_length + data.max_response_length")
    truncation, drop = d.get("data.truncation"), d.get("data.filter_overlong_prompts")
    if truncation not in TRUNCATIONS:
        d.fail(f"verl's data.truncation={truncation!r} (our data.overlong) is invalid: expected one of {TRUNCATIONS}")
    elif "data.truncation" in d.given or "data.filter_overlong_prompts" in d.given:
        d.set("data.overlong", "drop" if drop else truncation, "data.filter_overlong_prompts / data.truncation")


def _models(d: _Derivation) -> None:
    for verl_key, ours in ((f"{AR}.model.path", "model.path"), ("critic.model.path", "critic.path")):
        if verl_key in d.given:
            try:
                d.set(ours, resolve_model_path(d.given[verl_key], verl_key, ours), verl_key)
            except V.VerlValueError as err:
                d.fail(str(err))
    if "model.path" in d.out and "model.tokenizer" not in d.settings:
        d.set("model.tokenizer", d.out["model.path"], f"{AR}.model.path (the tokenizer ships with the model)")
    if d.given.get("reward_model.enable"):
        if "reward_model.model.path" not in d.given:
            d.fail("verl's reward_model.enable=True (our reward.model_path) needs reward_model.model.path")
        else:
            try:
                path = resolve_model_path(
                    d.given["reward_model.model.path"], "reward_model.model.path", "reward.model_path"
                )
                d.set("reward.model_path", path, "reward_model.enable + reward_model.model.path")
            except V.VerlValueError as err:
                d.fail(str(err))
    elif "reward_model.model.path" in d.given:
        d.lines.append("reward_model.model.path: ignored: reward_model.enable is False (verl reads it only then)")
    if d.given.get("custom_reward_function.path") or d.settings.get("reward.path"):
        d.set("reward.name", d.get("custom_reward_function.name"), "custom_reward_function.name")
    elif "custom_reward_function.name" in d.given:
        d.lines.append("custom_reward_function.name: ignored: no custom_reward_function.path (built-in scorers)")


def _batches(d: _Derivation, ours: str, verl: str) -> None:
    """ppo_mini_batch_size (prompts) -> mini_batches; use_dynamic_bsz -> a token budget per micro-batch."""
    batch = d.get("data.train_batch_size")
    if not _positive_int(batch):
        if ours == "actor":  # said once (the critic's mini-batches divide the same batch)
            d.fail(f"verl's data.train_batch_size={batch!r} (our data.batch_size) is invalid: expected a positive "
                   "integer (prompts per step)")  # fmt: skip
        return
    mini = d.given.get(f"{verl}.ppo_mini_batch_size", d.get(f"{AR}.actor.ppo_mini_batch_size"))
    bad = not isinstance(mini, int) or mini <= 0 or not isinstance(batch, int) or batch % mini
    if bad and ours == "critic" and f"{verl}.ppo_mini_batch_size" not in d.given:
        return  # the critic inherits the actor's mini-batch: the actor's error says it once
    if bad:
        d.fail(
            f"verl's {verl}.ppo_mini_batch_size={mini!r} (our {ours}.mini_batches = data.train_batch_size / it) is "
            f"invalid: expected a positive divisor of data.train_batch_size={batch!r}"
        )
    else:
        d.set(
            f"{ours}.mini_batches", batch // mini, f"data.train_batch_size={batch} / {verl}.ppo_mini_batch_size={mini}"
        )
    dynamic = d.given.get(f"{verl}.use_dynamic_bsz", d.given.get(f"{AR}.actor.use_dynamic_bsz", False))
    if dynamic:
        budget = d.given.get(f"{verl}.ppo_max_token_len_per_gpu", d.get(f"{verl}.ppo_max_token_len_per_gpu"))
        d.set(f"{ours}.max_tokens_per_microbatch", budget, f"{verl}.use_dynamic_bsz + ppo_max_token_len_per_gpu")
    elif f"{verl}.ppo_max_token_len_per_gpu" in d.given:
        d.lines.append(f"{verl}.ppo_max_token_len_per_gpu: ignored: use_dynamic_bsz is False (verl reads it only then)")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _gpus(d: _Derivation) -> None:
    """verl colocates every role on nnodes x n_gpus_per_node GPUs; engines are that many GPUs / the rollout's TP."""
    nnodes, per_node = d.get("trainer.nnodes"), d.get("trainer.n_gpus_per_node")
    rollout_tp = d.get(f"{AR}.rollout.tensor_model_parallel_size")
    if not all(isinstance(x, int) and x > 0 for x in (nnodes, per_node, rollout_tp)):
        d.fail(f"verl's trainer.nnodes={nnodes!r}, trainer.n_gpus_per_node={per_node!r} and rollout TP={rollout_tp!r}"
               " (our actor.world_size, rollout.num_engines) are invalid: expected positive integers")  # fmt: skip
        return
    gpus = nnodes * per_node
    why = f"trainer.nnodes={nnodes} x n_gpus_per_node={per_node}"
    d.set("actor.world_size", gpus, why)
    engine = _engine_settings(d)
    d.set(f"rollout.{engine}.tp", rollout_tp, f"{AR}.rollout.tensor_model_parallel_size")
    if gpus % rollout_tp:
        d.fail(f"verl's {AR}.rollout.tensor_model_parallel_size={rollout_tp} (our rollout.sglang.tp) is invalid: "
               f"expected a divisor of the {gpus} GPUs ({why})")  # fmt: skip
    else:
        d.set("rollout.num_engines", gpus // rollout_tp, f"{gpus} GPUs / rollout TP {rollout_tp}")
    if d.get("algorithm.adv_estimator") == "gae":
        d.set("critic.world_size", gpus, f"{why} (the critic is colocated too)")
        _batches(d, "critic", "critic")
    for role in ("actor", "critic"):
        tp = d.current(f"{role}.layout.tp", 1)
        if f"{role}.layout.sequence_parallel" not in d.settings:  # verl's default is on; Megatron uses it with tp > 1
            d.out[f"{role}.layout.sequence_parallel"] = isinstance(tp, int) and tp > 1


#: verl's rollout.* engine knobs -> their key in each engine's group (rollout.sglang, rollout.vllm); None: that engine
#: has no such setting
_ENGINE_KNOBS: dict[str, dict[str, str | None]] = {
    "sglang": {"data_parallel_size": "dp", "gpu_memory_utilization": "mem_fraction_static",
               "load_format": "load_format", "max_model_len": None},
    "vllm": {"data_parallel_size": "dp", "gpu_memory_utilization": "gpu_memory_utilization",
             "load_format": "load_format", "max_model_len": "max_model_len"},
}  # fmt: skip


def _sglang_only_knobs(d: _Derivation, prefix: str) -> None:
    ep = d.given.get(prefix + "expert_parallel_size")
    if ep is not None:
        d.set("rollout.sglang.ep", ep, prefix + "expert_parallel_size")
    if d.given.get(prefix + "enforce_eager"):
        d.lines.append(f"{prefix}enforce_eager: ignored: a vLLM flag; SGLang's CUDA graphs are its own "
                       "(rollout.sglang.extra_args: --disable-cuda-graph)")  # fmt: skip


def _vllm_only_knobs(d: _Derivation, prefix: str) -> None:
    ep = d.given.get(prefix + "expert_parallel_size")
    if ep is not None:
        d.set("rollout.vllm.enable_expert_parallel", ep > 1, prefix + "expert_parallel_size (vLLM: over tp x dp)")
    if d.given.get(prefix + "enforce_eager"):
        d.set("rollout.vllm.extra_args", ["--enforce-eager"], prefix + "enforce_eager")


#: the engine group -> its knobs that the other engine has no counterpart of
_ENGINE_ONLY_KNOBS = {"sglang": _sglang_only_knobs, "vllm": _vllm_only_knobs}


def _engine_settings(d: _Derivation) -> str:
    """verl's rollout.* engine knobs -> the chosen engine's group (rollout.vllm with vLLM, else rollout.sglang);
    returns its name."""
    engine = d.settings.get("rollout.engine")
    engine = engine if isinstance(engine, str) and engine in _ENGINE_KNOBS else "sglang"
    prefix = f"{AR}.rollout."
    for verl_key, ours in _ENGINE_KNOBS[engine].items():
        if prefix + verl_key in d.given:
            if ours is None:
                d.lines.append(f"{prefix}{verl_key}: ignored: SGLang serves the model's context (prompts and "
                               "responses are capped by data.max_prompt_length / max_response_length)")  # fmt: skip
            else:
                d.set(f"rollout.{engine}.{ours}", d.given[prefix + verl_key], prefix + verl_key)
    _ENGINE_ONLY_KNOBS[engine](d, prefix)
    return engine


def _algorithm(d: _Derivation) -> None:
    estimator = d.get("algorithm.adv_estimator")
    d.set("algorithm.adv_estimator", estimator, "algorithm.adv_estimator")
    d.set("critic.enable", estimator == "gae", "algorithm.adv_estimator (gae brings its critic, as in verl)")
    use_kl = d.get(f"{AR}.actor.use_kl_loss")
    coef = d.get(f"{AR}.actor.kl_loss_coef")
    d.set("actor.kl_loss_coef", coef if use_kl else 0.0, f"{AR}.actor.use_kl_loss={use_kl} / kl_loss_coef={coef}")


def _deepep(d: _Derivation) -> None:
    """moe_enable_deepep=True is Megatron's flex dispatcher over DeepEP (actor.moe_dispatcher=flex)."""
    key = f"{AR}.actor.megatron.override_transformer_config.moe_enable_deepep"
    if d.given.get(key):
        dispatcher = d.current("actor.moe_dispatcher", None)
        if dispatcher not in (None, "flex"):
            d.fail(f"verl's {key}=True (our actor.moe_dispatcher=flex) contradicts moe_token_dispatcher_type="
                   f"{dispatcher!r}; expected flex")  # fmt: skip
        else:
            d.set("actor.moe_dispatcher", "flex", key)
    elif key in d.given:
        d.lines.append(f"{key}=False: ignored: DeepEP off (actor.moe_dispatcher as set)")


def _recompute(d: _Derivation, megatron: bool) -> None:
    """verl's Megatron workers read override_transformer_config.recompute_*; its FSDP workers read
    enable_gradient_checkpointing (HF's per-layer checkpointing = full recompute of every layer)."""
    prefix = f"{AR}.actor.megatron.override_transformer_config."
    granularity = d.given.get(prefix + "recompute_granularity")
    if granularity is not None:
        d.set("actor.recompute.granularity", granularity, prefix + "recompute_granularity")
        for name in ("method", "num_layers"):
            if d.given.get(prefix + f"recompute_{name}") is not None:
                d.set(f"actor.recompute.{name}", d.given[prefix + f"recompute_{name}"], prefix + f"recompute_{name}")
        modules = d.given.get(prefix + "recompute_modules")
        if granularity == "selective" and modules not in (None, ["core_attn"]):
            d.fail(
                f"verl's {prefix}recompute_modules={modules!r} (our actor.recompute.granularity=selective) cannot be "
                "honoured here: selective recompute covers core_attn only; expected ['core_attn']"
            )
        return
    key = f"{AR}.model.enable_gradient_checkpointing"
    if megatron:
        if key in d.given:
            d.lines.append(f"{key}: ignored: verl's Megatron workers read override_transformer_config.recompute_*")
        return
    if key not in d.given and d.settings.get("trainer.runtime") == "cpu":
        d.lines.append(f"{key}: verl's default (True) not applied: trainer.runtime=cpu keeps activations (Megatron's "
                       "recompute saves CUDA RNG state)")  # fmt: skip
        return
    if d.get(key):
        d.set("actor.recompute.granularity", "full", f"{key}=True (FSDP's per-layer checkpointing)")
        d.set("actor.recompute.method", "uniform", key)
        d.set("actor.recompute.num_layers", 1, key)


def _validation(d: _Derivation) -> None:
    """val_kwargs: do_sample=False is verl's greedy pass (our mean@1); do_sample=True samples n at its temperature."""
    n, sample = d.get(f"{AR}.rollout.val_kwargs.n"), d.get(f"{AR}.rollout.val_kwargs.do_sample")
    if not isinstance(n, int) or n < 1:
        d.fail(f"verl's {AR}.rollout.val_kwargs.n={n!r} (our rollout.val_n) is invalid: expected an integer >= 1")
        return
    if not sample:
        d.set("rollout.val_n", 0, f"val_kwargs.do_sample=False (greedy: mean@1) with n={n}")
        for ours in ("rollout.val_temperature", "rollout.val_top_p"):  # verl samples with them only with do_sample
            if d.settings.pop(ours, None) is not None:
                d.lines.append(f"{ours}: dropped: val_kwargs.do_sample=False validates greedily, as verl does")
        return
    d.set("rollout.val_n", 0 if n == 1 else n, f"val_kwargs.do_sample=True, n={n}")
    if "rollout.val_temperature" not in d.settings:  # verl's val_kwargs.temperature default is 0 (greedy)
        d.set("rollout.val_temperature", 0.0, "val_kwargs.temperature (verl's default 0)")


def _trainer(d: _Derivation) -> None:
    mode, path = d.get("trainer.resume_mode"), d.given.get("trainer.resume_from_path")
    resumes = {"auto": "auto", "disable": None, "resume_path": path}
    if mode not in resumes or (mode == "resume_path" and not path):
        d.fail(f"verl's trainer.resume_mode={mode!r} (our trainer.resume) is invalid: expected auto, disable, or "
               "resume_path with trainer.resume_from_path")  # fmt: skip
    else:
        d.set("trainer.resume", resumes[mode], "trainer.resume_mode")
    steps = d.given.get("trainer.total_training_steps")
    if steps is not None:
        d.set("trainer.steps", steps, "trainer.total_training_steps")
        return
    epochs = d.get("trainer.total_epochs")
    files = d.settings.get("data.train_files") or []
    batch = d.get("data.train_batch_size")
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        what = f"{missing} {'is' if len(missing) == 1 else 'are'} not there" if files else "none are given"
        d.fail(f"verl's trainer.total_epochs={epochs} (our trainer.steps = epochs x rows / data.train_batch_size) "
               f"counts the rows of data.train_files, and {what}; expected existing parquet files, or "
               "trainer.total_training_steps")  # fmt: skip
        return
    if not _positive_int(batch):
        return  # _batches names it
    rows = count_rows(files)
    if rows < batch:
        d.fail(
            f"data.train_files hold {rows} rows, fewer than data.train_batch_size={batch}: expected at least one batch"
        )
        return
    d.set(
        "trainer.steps", epochs * (rows // batch), f"trainer.total_epochs={epochs} x {rows} rows // {batch} (drop_last)"
    )


def _reference(d: _Derivation) -> None:
    """The reference runs inside the actor's ranks here: its layout is the actor's, or the command is refused."""
    for verl_name, ours in (*V._LAYOUT.items(), ("ulysses_sequence_parallel_size", "cp")):
        key = (
            f"{AR}.ref.megatron.{verl_name}"
            if verl_name != "ulysses_sequence_parallel_size"
            else f"{AR}.ref.{verl_name}"
        )
        if key not in d.given:
            continue
        actor = d.current(f"actor.layout.{ours}", None if ours in ("etp", "vpp") else 1)
        value = d.given[key]
        if ours == "sequence_parallel":
            continue  # follows tp here
        if value != actor:
            d.fail(f"verl's {key}={value!r} cannot be honoured here: the reference runs inside the actor's ranks, with "
                   f"actor.layout.{ours}={actor!r}; expected the same value")  # fmt: skip
        else:
            d.lines.append(f"{key}={value!r}: the actor's layout (the reference runs inside the actor's ranks)")


def _ref_placement(d: _Derivation, megatron: bool) -> None:
    """verl's param_offload of the reference (its weights on the host between its passes, loaded onto the GPU for
    each) is actor.ref_placement=host; false keeps them on the GPU: resident. ref.megatron.param_offload defaults to
    actor.megatron.param_offload in verl's Megatron config; an FSDP reference has its own fsdp_config.param_offload.
    None given: our default (null: host on CUDA; compat/verl/keys.py KEPT_DEFAULTS)."""
    keys = [f"{AR}.ref.megatron.param_offload", f"{AR}.ref.fsdp_config.param_offload"]
    actor_key = f"{AR}.actor.megatron.param_offload"
    if actor_key in d.given:
        d.lines.append(f"{actor_key}={d.given[actor_key]!r}: the actor's own weights: {V._OFFLOAD}")
    if megatron:
        keys.append(actor_key)
    for key in keys:
        if key not in d.given:
            continue
        value = d.given[key]
        if not isinstance(value, bool):
            d.fail(f"verl's {key}={value!r} (our actor.ref_placement) is invalid: expected True (host) or False "
                   "(resident)")  # fmt: skip
        else:
            why = f"{key}={value!r}" + ("" if key.startswith(f"{AR}.ref.") else " (verl's default for the reference's)")
            d.set("actor.ref_placement", "host" if value else "resident", why)
        return
