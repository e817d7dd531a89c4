"""A run's memory, estimated from its config before anything starts.

    est = group_estimate(cfg, cfg.actor, hf, engine=None, use_ref=cfg.actor.use_ref)   # one rank's figures
    parts = host_memory_parts(cfg, hf)       # what a CPU run holds on this host, part by part

`group_estimate` is the per-rank estimate of a worker group (mcore_rl/models/estimate.py at the group's layout, from
the settings the ranks build with) that `launch/submit.py --dry-run` prints and checks against the GPUs;
`host_memory_parts` adds up what a CPU run holds on this host (its actor and critic ranks, its embedded or vllm-cpu
engines), which pre-flight compares with the host's available memory (preflight.check_host_memory). Nothing here
imports the controller's run machinery (workers, engines, weight sync), so pre-flight can ask it before they exist.
"""

from __future__ import annotations

from typing import Any

GIB = 1024**3


def micro_batch_samples(cfg: Any, group: Any) -> int:
    """Samples of full length in one micro-batch of a worker group: micro_batch_size, or fewer where a token budget
    (max_tokens_per_microbatch, verl's use_dynamic_bsz + ppo_max_token_len_per_gpu) caps it (one sample at least)."""
    budget = getattr(group, "max_tokens_per_microbatch", None)
    if not budget:
        return group.micro_batch_size
    return max(1, min(group.micro_batch_size, budget // cfg.model.max_sequence_length))


def group_estimate(
    cfg: Any,
    group: Any,
    hf: dict[str, Any],
    engine: Any,
    use_ref: bool,
    fused_attention: bool = True,
    exact_params: bool = True,
) -> Any:
    """models/estimate.py's per-rank figures of one worker group (the actor, or the critic) at its own layout, with
    Transformer Engine's fused attention unless told otherwise. `exact_params`: parameters per rank from the model
    built on the meta device (`rank_params`, what the dry run prints: it imports Megatron and starts a
    torch.distributed world of one in this process); False counts them from the HF config in closed form
    (`count_params`: no padded vocabulary, no norms; within 1% on the recipes here), which pre-flight uses in the
    driver."""
    from mcore_rl.actor.optimizer import optimizer_plan
    from mcore_rl.actor.reference import resolve_placement
    from mcore_rl.models.estimate import estimate_memory, rank_params

    lay = group.layout
    recompute = getattr(group, "recompute", None) or cfg.actor.recompute
    params = None
    if exact_params:
        params = rank_params(hf, lay.to_layout(), cfg.model.make_vocab_size_divisible_by, cfg.model.dtype)
    return estimate_memory(
        hf,
        group.world_size,
        tp=lay.tp,
        pp=lay.pp,
        cp=lay.cp,
        ep=lay.ep,
        etp=lay.etp,
        vpp=lay.vpp,
        first_stage_layers=lay.first_stage_layers,
        last_stage_layers=lay.last_stage_layers,
        micro_batch=micro_batch_samples(cfg, group),
        seq_len=cfg.model.max_sequence_length,
        plan=optimizer_plan(group.optim, cfg.model.dtype, cfg.trainer.runtime),
        recompute=recompute,
        use_ref=use_ref,
        ref_placement=resolve_placement(getattr(group, "ref_placement", None), cfg.trainer.runtime),
        params=params,
        engine=engine,
        fused_attention=fused_attention,
        runtime=cfg.trainer.runtime,
        logprob_micro_batch=getattr(group, "logprob_micro_batch_size", None),
    )


def actor_estimate(cfg: Any, hf: dict[str, Any], exact_params: bool = True) -> Any:
    """The actor's per-rank estimate on cfg's own runtime with the attention its ranks build (Transformer Engine's
    where it is in use, else the local spec's): what the dry run prints for a CPU recipe and what
    tools/bench_memory_estimate.py compares with the ranks."""
    from mcore_rl.models.spec import te_in_use

    fused = te_in_use(cfg.trainer.runtime)
    return group_estimate(cfg, cfg.actor, hf, None, cfg.actor.use_ref, fused_attention=fused, exact_params=exact_params)


def engine_kv_bytes_per_token(hf: dict[str, Any], dtype_bytes: int) -> int:
    """Bytes of transformers' KV cache per token of one sequence: keys and values of every layer (MLA: the
    decompressed per-head keys and values transformers caches)."""
    layers, heads = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
    if hf.get("kv_lora_rank"):
        width = heads * (int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"]) + int(hf["v_head_dim"]))
    else:
        head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
        width = 2 * int(hf.get("num_key_value_heads") or heads) * head_dim
    return layers * width * dtype_bytes


def engine_host_bytes(cfg: Any, hf: dict[str, Any]) -> tuple[float, str]:
    """(bytes, how) one CPU rollout engine holds: the process (models/estimate.py's CPU_PROCESS_IMAGE_MIB), the
    whole model's weights in model.dtype, and its KV cache: the budget the engine's own settings fix
    (rollout.vllm.cpu_kv_cache_bytes), else the embedded server's running sequences (rollout.max_running_requests,
    at most a step's data.batch_size x rollout.n) at model.max_sequence_length tokens each."""
    from mcore_rl.models.estimate import ACTIVATION_BYTES, CPU_PROCESS_IMAGE_MIB, MIB, count_params

    dtype_bytes = ACTIVATION_BYTES.get(cfg.model.dtype, 4)
    weights = count_params(hf).total * dtype_bytes
    own = getattr(cfg.rollout, cfg.rollout.engine, None)  # the chosen engine's settings group, where it has one
    budget = getattr(own, "cpu_kv_cache_bytes", None)
    if budget is not None:
        kv, kv_how = float(budget), f"KV cache {budget / GIB:.2f} GiB (rollout.{cfg.rollout.engine}.cpu_kv_cache_bytes)"
    else:
        running = min(cfg.rollout.max_running_requests, cfg.data.batch_size * max(cfg.rollout.n, cfg.rollout.val_n))
        kv = float(running * cfg.model.max_sequence_length * engine_kv_bytes_per_token(hf, dtype_bytes))
        kv_how = f"KV cache {kv / GIB:.2f} GiB ({running} sequences x {cfg.model.max_sequence_length} tokens)"
    process = CPU_PROCESS_IMAGE_MIB * MIB
    how = f"weights {weights / GIB:.2f} GiB + {kv_how} + process {process / GIB:.2f} GiB"
    return process + weights + kv, how


def host_memory_parts(cfg: Any, hf: dict[str, Any]) -> list[tuple[str, float]]:
    """What a CPU run started on this host (a local Ray) holds there, part by part: (description, bytes). The actor's
    and the critic's per-rank estimates (`group_estimate`, parameters in closed form) times their ranks, and the
    engines' (`engine_host_bytes`) times rollout.num_engines. Not counted: the driver, Ray's own processes, a reward
    model worker."""
    from mcore_rl.models.spec import te_in_use

    actor = actor_estimate(cfg, hf, exact_params=False).total
    parts = [(f"actor {cfg.actor.world_size} ranks x {actor / GIB:.2f} GiB", cfg.actor.world_size * actor)]
    if cfg.critic.enable:
        critic_hf = hf
        if cfg.critic.path:
            import json
            import os

            with open(os.path.join(cfg.critic.path, "config.json")) as f:
                critic_hf = json.load(f)
        fused = te_in_use(cfg.trainer.runtime)
        critic = group_estimate(
            cfg, cfg.critic, critic_hf, None, False, fused_attention=fused, exact_params=False
        ).total
        parts.append((f"critic {cfg.critic.world_size} ranks x {critic / GIB:.2f} GiB", cfg.critic.world_size * critic))
    engine, how = engine_host_bytes(cfg, hf)
    engines = cfg.rollout.num_engines
    parts.append((f"engines {engines} x {engine / GIB:.2f} GiB ({how})", engines * engine))
    return parts
