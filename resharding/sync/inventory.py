"""What the actor holds, as data: every Megatron tensor that weight sync exports, where it lives and what it becomes.

A `SourceTensor` names one Megatron tensor by its *global* name (layer and expert indices as in a tp=pp=ep=1 model),
with its per-rank shard shape, the mesh axis its shards are gathered over, the pipeline stage (and EP rank, for
experts) that holds it, and the HF tensors it exports to (names and shapes). The sync plan is computed from a list
of them. Two ways to get that list, which agree (a test compares them):

```
live ranks:  each rank's chunks (local names, shard shapes, ShardContext) -> all_gather_object -> union, deduplicated
meta model:  one model built on the meta device at tp=pp=ep=1 (no ranks, no memory; for tools/plan_sync.py at cluster
             scale) -> stage/EP owner from the actor layout -> shard shape at the actor's tp/etp via the transform
```
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_rl.resharding.weight_map import Rule, ShardContext, WeightMap, exported_tensors


@dataclass(frozen=True)
class SourceTensor:
    """One exported Megatron tensor (see the module docstring)."""

    mcore: str  #: global Megatron name
    pp_rank: int  #: the pipeline rank holding it
    vstage: int  #: its virtual stage on that rank
    ep_rank: int | None  #: the EP rank owning it (experts), None for dense tensors
    axis: str | None  #: "tp" | "etp": its shards are gathered over that group (of more than one rank); else None
    shard_shape: tuple[int, ...]  #: one rank's shard
    dtype: str  #: torch dtype name, e.g. "bfloat16"
    hf: tuple[str, ...]  #: HF names it exports to (transform outputs, then aliases)
    hf_shapes: tuple[tuple[int, ...], ...]
    num_outputs: int = 1  #: how many of `hf` the transform produces; the rest are aliases (copies of output 0)
    #: position in its model chunk: sorts tensors in model order (a stage's own chunk on live ranks, the whole model
    #: on the meta path: the same relative order, so it takes no part in equality)
    order: int = field(default=0, compare=False)

    @property
    def shard_bytes(self) -> int:
        return _numel(self.shard_shape) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def hf_bytes(self) -> int:
        size = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return sum(_numel(s) for s in self.hf_shapes) * size


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def global_name(rule: Rule, local: dict[str, int], ctx: ShardContext) -> str:
    """The rule's Megatron template with this chunk's local layer/expert indices made global."""
    fields = {}
    if "layer" in local:
        fields["layer"] = local["layer"] + ctx.layer_offset
    if "expert" in local:
        fields["expert"] = local["expert"] + ctx.ep_rank * ctx.num_local_experts
    return rule.mcore.format(**fields)


def hf_outputs(
    rule: Rule,
    weight_map: WeightMap,
    local: dict[str, int],
    ctx: ShardContext,
    shard: torch.Tensor,
    num_shards: int,
    shapes_seen: dict | None = None,
) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """HF names and shapes a tensor exports to, computed on meta shards (no data moves). `shapes_seen` (a dict the
    caller keeps for one inventory) remembers the transform's output shapes per input shape: a MoE model repeats one
    expert's shapes thousands of times, and each meta `to_hf` costs a torch.cat decomposition."""
    key = (id(rule.transform), tuple(shard.shape), shard.dtype, num_shards)
    found = None if shapes_seen is None else shapes_seen.get(key)
    if found is None:
        meta = torch.empty(shard.shape, dtype=shard.dtype, device="meta")
        found = (rule.transform, [tuple(v.shape) for v in rule.transform.to_hf([meta] * num_shards)])
        if shapes_seen is not None:
            shapes_seen[key] = found  # the transform is kept with its shapes, so its id is not reused meanwhile
    values = found[1]
    names = weight_map.hf_names(rule, local, ctx) + weight_map.hf_names(rule, local, ctx, aliases=True)
    shapes = list(values) + [values[0]] * len(rule.aliases)
    return tuple(names), tuple(shapes)


def local_sources(
    chunks: list[torch.nn.Module],
    contexts: list[ShardContext],
    weight_map: WeightMap,
    pp_rank: int,
    tp_size: int,
    etp_size: int,
    keep_axis: bool = False,
) -> list[SourceTensor]:
    """The exported tensors of this rank's chunks (the same selection `export_hf_weights` makes). `keep_axis`
    records each tensor's split axis even where its group has one rank (the meta path builds at tp=1)."""
    out = []
    shapes_seen: dict = {}
    for vstage, (chunk, ctx) in enumerate(zip(chunks, contexts)):
        order = 0
        for name, tensor in exported_tensors(chunk):
            rule, local = weight_map.match(name)
            if not rule.export:
                continue
            axis = rule.transform.axis_for(tensor.shape)
            size = {"tp": tp_size, "etp": etp_size}.get(axis or "", 1)
            names, shapes = hf_outputs(rule, weight_map, local, ctx, tensor, size, shapes_seen)
            out.append(
                SourceTensor(
                    mcore=global_name(rule, local, ctx),
                    pp_rank=pp_rank,
                    vstage=vstage,
                    ep_rank=ctx.ep_rank if rule.is_expert else None,
                    axis=axis if size > 1 or keep_axis else None,
                    shard_shape=tuple(tensor.shape),
                    dtype=str(tensor.dtype).removeprefix("torch."),
                    hf=names,
                    hf_shapes=shapes,
                    num_outputs=len(shapes) - len(rule.aliases),
                    order=order,
                )
            )
            order += 1
    return out


def merge_sources(per_rank: Iterable[list[SourceTensor]]) -> list[SourceTensor]:
    """The union of every rank's sources (data-parallel replicas and TP peers hold the same entries), in a stable
    order: stage, virtual stage, dense before experts, EP rank, model order."""
    seen: dict[str, SourceTensor] = {}
    for sources in per_rank:
        for s in sources:
            prior = seen.setdefault(s.mcore, s)
            if prior != s:
                raise ValueError(f"ranks disagree about Megatron tensor {s.mcore!r}: {prior} vs {s}")
    return sorted(seen.values(), key=lambda s: (s.pp_rank, s.vstage, s.ep_rank is not None, s.ep_rank or 0, s.order))


def meta_sources(
    build_whole_model: Callable[[], tuple[list[torch.nn.Module], list[ShardContext]]],
    weight_map: WeightMap,
    actor_layout: Any,
    num_layers: int,
    num_experts: int,
) -> list[SourceTensor]:
    """The sources of an actor layout without its ranks: `build_whole_model()` builds the model at tp=pp=ep=1 on the
    meta device (with the actor's padded vocabulary, which depends on its tp); stage and EP owner come from
    `actor_layout`, shard shapes from the transforms at its tp/etp."""
    chunks, contexts = build_whole_model()
    stage_layers = actor_layout.pp_stage_layers(num_layers)
    vpp = actor_layout.virtual_stages
    owner = {layer: divmod(i, vpp) for i, layers in enumerate(stage_layers) for layer in layers}
    per_expert = num_experts // actor_layout.ep if num_experts else 0
    whole = local_sources(chunks, contexts, weight_map, 0, 1, 1, keep_axis=True)
    out = []
    last = (actor_layout.pp - 1, vpp - 1)
    shard_shapes: dict = {}  # (transform, HF shapes, dtype, shards) -> shard shape: experts repeat a few shapes
    for s in whole:
        rule, local = weight_map.match(s.mcore)
        if "layer" in local and s.mcore.startswith("decoder."):
            pp_rank, vstage = owner[local["layer"]]
        elif s.mcore.startswith(("embedding.",)):
            pp_rank, vstage = 0, 0
        else:  # final norm, output layer, MTP layers
            pp_rank, vstage = last
        ep_rank = local["expert"] // per_expert if rule.is_expert else None
        size = {"tp": actor_layout.tp, "etp": actor_layout.expert_tp}.get(s.axis or "", 1)
        key = (id(rule.transform), s.hf_shapes[: s.num_outputs], s.dtype, size)
        if key not in shard_shapes:
            hf = [torch.empty(shape, dtype=getattr(torch, s.dtype), device="meta") for shape in s.hf_shapes]
            shard_shapes[key] = (rule.transform, tuple(rule.transform.to_megatron(hf[: s.num_outputs], 0, size).shape))
        shard_shape = shard_shapes[key][1]
        out.append(
            SourceTensor(
                mcore=s.mcore,
                pp_rank=pp_rank,
                vstage=vstage,
                ep_rank=ep_rank,
                axis=s.axis if size > 1 else None,
                shard_shape=shard_shape,
                dtype=s.dtype,
                hf=s.hf,
                hf_shapes=s.hf_shapes,
                num_outputs=s.num_outputs,
                order=s.order,
            )
        )
    return merge_sources([out])
