"""A run's weight sync checked before anything starts: the real plan, built from the model on the meta device at the
actor's layout for the engines the run will start, and what it implies on the cluster.

    lines = check_sync(cfg, gpus_per_node)      # launch/submit.py --dry-run; RecipeError (exit 2) names the key

```
config -> meta model (no weights, no ranks) -> sources at actor.layout -> build_plan(engine layout, sync.bucket_bytes,
          sync.mode, the family's shard rules and receive-together groups)
       -> checked: the engine layout divides the model, every byte reaches every engine rank once, no receive-together
          group is split, buckets (the largest, and why), NCCL groups per engine GPU (sync.max_update_groups)
       -> printed: streams, buckets, bytes, the sending rank's extra memory, the predicted sync time
          (resharding/sync/forecast.py, the model tools/plan_sync.py prints)
```
The placement (controller/gpu_plan.py) and the GPU packages (mcore_rl/gpu_extra.py) are checked by their callers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_rl.controller.gpu_plan import engine_shape
from mcore_rl.resharding.sync.plan import EngineLayout

GIB = 1024**3


class RecipeError(ValueError):
    """What would fail at run time, found before anything starts; the message names the key and what was expected."""


@dataclass(frozen=True)
class SyncCheck:
    """The plan of a run and the figures the dry run prints."""

    plan: Any
    lines: tuple[str, ...]
    sender_extra_bytes: int  #: a sending rank's extra memory: two bucket buffers + the largest gathered tensor


def engine_layout(cfg: Any) -> EngineLayout:
    """The engines the run starts, as the plan sees them (controller/gpu_plan.py engine_shape: the chosen engine's
    own settings; our embedded server is one rank)."""
    return engine_shape(cfg.rollout, cfg.trainer.runtime).layout(cfg.rollout.num_engines)


def meta_inventory(hf_dict: dict, layout: Any, divisible_by: int, dtype: str) -> tuple[list, Any, Any]:
    """(the sources at `layout`, the model's shape, its family), from a meta-device model built in this process (a
    torch.distributed world of one, created here if none is)."""
    import torch
    import torch.distributed as dist

    from mcore_rl.models.base import HFConfig
    from mcore_rl.models.builder import ModelSpec, build_gpt_chunks
    from mcore_rl.parallel.groups import free_port, init_distributed, initialize_model_parallel
    from mcore_rl.parallel.layout import ParallelLayout
    from mcore_rl.resharding.sync.inventory import meta_sources

    if not dist.is_initialized():
        init_distributed("cpu", 0, 1, "127.0.0.1", free_port())
    pg = initialize_model_parallel(ParallelLayout())
    hf = HFConfig(hf_dict)
    spec = ModelSpec(
        hf,
        ParallelLayout(),
        dtype=getattr(torch, dtype),
        make_vocab_size_divisible_by=divisible_by * layout.tp,
        config_overrides={"perform_initialization": False},
    )
    shape = spec.family.shape(hf)
    sources = meta_sources(
        lambda: build_gpt_chunks(spec, pg, meta=True), spec.weight_map(), layout, shape.num_layers, shape.num_experts
    )
    return sources, shape, spec.family


def compose_recipe(name: str, overrides: list[str] | None = None) -> Any:
    """The validated config of configs/<name>.yaml with Hydra `overrides`, as `python -m mcore_rl.train` composes it."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from mcore_rl.config import register_schema, to_config

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_module("mcore_rl.configs", version_base=None):
        return to_config(compose(config_name=name, overrides=list(overrides or [])))


def build_run_plan(
    cfg: Any, hf: dict, engines: EngineLayout | None = None, inventory: tuple | None = None, **overrides: Any
) -> Any:
    """The sync plan the run's actor ranks will compute (SyncSender.plan), from the meta model (or `inventory`, a
    meta_inventory result to reuse); `overrides` replace build_plan's arguments (another bucket size, mode, ...).
    One leader for every stream where the run's WeightSync asks the ranks for it (weight_sync.one_sync_leader)."""
    from mcore_rl.controller.weight_sync import one_sync_leader
    from mcore_rl.resharding.sync.plan import build_plan

    layout = cfg.actor.layout.to_layout()
    sources, shape, family = inventory or meta_inventory(
        hf, layout, cfg.model.make_vocab_size_divisible_by, cfg.model.dtype
    )
    args = dict(
        actor_layout=layout,
        world_size=cfg.actor.world_size,
        engines=engines or engine_layout(cfg),
        rules=family.engine_shards,
        receive_together=family.engine_receive_together,
        bucket_bytes=cfg.sync.bucket_bytes,
        mode=cfg.sync.mode,
        num_experts=shape.num_experts,
        num_kv_heads=shape.num_query_groups,
        num_heads=shape.num_attention_heads,
        fp8_targets=family.fp8_targets if cfg.sync.fp8 else None,
        one_leader=one_sync_leader(cfg.rollout.engine, cfg.trainer.runtime, cfg.sync.transport),
    )
    return build_plan(sources, **{**args, **overrides})


def check_sync(cfg: Any, hf: dict, gpus_per_node: int, bandwidths: dict[str, float] | None = None) -> SyncCheck:
    """The run's sync plan, checked (module docstring); RecipeError naming the key when it would fail at run time."""
    from mcore_rl.controller.weight_sync import SyncError, one_sync_leader, update_groups_per_engine_gpu
    from mcore_rl.models.registry import get_family
    from mcore_rl.resharding.sync.forecast import DEFAULT_BW, link_loads, predict
    from mcore_rl.resharding.sync.plan import PlanError

    engines = engine_layout(cfg)
    try:
        plan = build_run_plan(cfg, hf, engines)
    except PlanError as err:  # the engine layout does not divide the model, a group spans streams, ...
        shape = engine_shape(cfg.rollout, cfg.trainer.runtime)
        raise RecipeError(
            f"{shape.key} (tp={shape.tp} ep={shape.ep} dp={shape.dp}) x rollout.num_engines={cfg.rollout.num_engines}: "
            f"the actor cannot feed this engine layout: {err}"
        ) from None
    problems = plan.check_coverage()
    if problems:
        raise RecipeError(f"sync plan: bytes would not reach the engines as SGLang loads them: {problems[:5]}")
    together = get_family(hf["model_type"]).engine_receive_together
    split = plan.split_groups(together)
    if split:
        raise RecipeError(f"sync plan: tensors an engine must receive together are split over buckets: {split[:5]}")
    try:  # the run's own bound (controller/weight_sync.py), so the dry run and the run agree
        groups = update_groups_per_engine_gpu(cfg.sync, len(plan.streams))
    except SyncError as err:
        raise RecipeError(str(err)) from None
    bw = bandwidths or dict(DEFAULT_BW)
    colocated = cfg.trainer.placement == "colocated"
    engine_nodes = 0 if colocated else -(-engines.num_engines * engines.tp // max(1, gpus_per_node))
    loads = link_loads(plan, cfg.actor.world_size, max(1, gpus_per_node), engine_nodes)
    p = predict(plan, loads, bw, engine_nodes, max(1, gpus_per_node))
    oversized = [b for b in plan.buckets if b.nbytes > plan.bucket_bytes]
    extra = 2 * plan.max_bucket_bytes + plan.largest_tensor_bytes
    leaders = len({s.leader for s in plan.streams})
    one_leader = one_sync_leader(cfg.rollout.engine, cfg.trainer.runtime, cfg.sync.transport)
    one = " (all on one: vLLM's one NCCL weight-transfer group)" if one_leader else ""
    lines = (
        f"sync plan: {len(plan.streams)} streams from {leaders} leader rank(s){one}, {len(plan.buckets)} buckets, "
        f"{plan.nbytes / 1e9:.1f} GB per push "
        f"(mode={plan.mode}, transport={cfg.sync.transport}, engines {engines.num_engines} x tp{engines.tp} "
        f"ep{engines.ep} dp-attn{engines.dp_attention}); coverage ok",
        f"  buckets: sync.bucket_bytes={plan.bucket_bytes / GIB:.2f} GiB; largest {plan.max_bucket_bytes / GIB:.2f} GiB"
        + (
            f" ({len(oversized)} larger than sync.bucket_bytes, each one tensor or one receive-together group: "
            + ", ".join(sorted({e.name for b in oversized[:3] for e in b.entries})[:3])
            + ")"
            if oversized
            else ""
        ),
        f"  receive-together groups whole: {len(together)} rule(s) of {hf['model_type']}, none split",
        f"  NCCL broadcast groups per engine GPU: {groups} (bound sync.max_update_groups={cfg.sync.max_update_groups})",
        f"  sender's extra memory: {extra / GIB:.2f} GiB (2 buckets of {plan.max_bucket_bytes / GIB:.2f} GiB + the "
        f"largest gathered tensor {plan.largest_tensor_bytes / GIB:.2f} GiB)",
        f"  predicted sync: {p['predicted_s']:.1f} s (bound {p['bound_s']:.1f} s; gather {p['gather_s']:.1f} s, send "
        f"{p['send_s']:.1f} s, receive {p['receive_s']:.1f} s at NVLink {bw['nvlink_gbps']:.0f} GB/s, IB "
        f"{bw['ib_gbps']:.0f} GB/s per GPU; tools/plan_sync.py --bandwidths for measured links)",
    )
    return SyncCheck(plan, lines, extra)
