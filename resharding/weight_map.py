"""Declarative HF <-> Megatron weight maps and the machinery that applies them to a sharded model.

A model family (mcore_rl/models/<family>.py) states its map as data:

    Rule("decoder.layers.{layer}.self_attention.linear_qkv.weight",
         ("model.layers.{layer}.self_attn.q_proj.weight", "...k_proj.weight", "...v_proj.weight"), QKV(...))

`{layer}` is the *local* layer index in the Megatron name and the *global* one in the HF name (PP/VPP offset added);
`{expert}` likewise for expert indices under EP. This module interprets any such map:

    load:   read HF tensors by name -> transform -> this rank's shard -> copy into the parameter/buffer
    export: every rank's shard -> all-gather over the rule's axis (tp / etp) -> transform -> HF tensors, emitted once
            (by tp/etp rank 0 of data-parallel replica 0; experts by their owning EP rank, layers by their PP stage)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.resharding.transforms import Transform


class WeightMapError(ValueError):
    """A tensor is missing, unexpected, or has the wrong shape; the message names it."""


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor <-> one or more HF tensors."""

    mcore: str
    hf: tuple[str, ...]
    transform: Transform
    #: skip this tensor on export (e.g. an output layer tied to the embedding)
    export: bool = True
    #: HF names holding copies of hf[0]: written on export, never read on load (DeepSeek's MTP layers repeat the
    #: embedding and the output head under their own names)
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))

    @property
    def is_expert(self) -> bool:
        return "{expert}" in self.mcore


@dataclass(frozen=True)
class ShardContext:
    """Where one model chunk sits: the sizes/ranks the transforms and index offsets need."""

    tp_rank: int = 0
    tp_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    ep_rank: int = 0
    num_local_experts: int = 0
    layer_offset: int = 0
    #: emit dense tensors on export (tp/cp rank 0 of data-parallel replica 0)
    owns_dense: bool = True
    #: emit expert tensors on export (etp rank 0 of expert-data-parallel replica 0)
    owns_experts: bool = True

    def shard_of(self, axis: str | None) -> tuple[int, int]:
        if axis == "tp":
            return self.tp_rank, self.tp_size
        if axis == "etp":
            return self.etp_rank, self.etp_size
        return 0, 1


def _pattern(template: str) -> re.Pattern:
    escaped = re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    return re.compile(f"^{escaped}$")


_DIGITS = re.compile(r"\d+")
_HASHES = re.compile(r"#+")


def _shape_of(text: str) -> str:
    """A name or name template with its numbers and index fields as '#': a name can only match a template of the
    same shape, so a lookup scans those few instead of every rule (46k names x ~30 rules in a big checkpoint)."""
    return _HASHES.sub("#", _DIGITS.sub("#", text.replace("{layer}", "#").replace("{expert}", "#")))


def _by_shape(compiled: list[tuple[re.Pattern, Any]], templates: list[str]) -> dict[str, list[tuple[re.Pattern, Any]]]:
    index: dict[str, list[tuple[re.Pattern, Any]]] = {}
    for item, template in zip(compiled, templates):
        index.setdefault(_shape_of(template), []).append(item)  # rule order kept: the first match still wins
    return index


@dataclass
class WeightMap:
    """A family's rules, plus HF names that are known and deliberately not loaded (e.g. rotary caches)."""

    rules: list[Rule]
    ignore_hf: tuple[str, ...] = ()
    _compiled: list[tuple[re.Pattern, Rule]] = field(default_factory=list, init=False, repr=False)
    _compiled_hf: list[tuple[re.Pattern, Rule]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._compiled = [(_pattern(r.mcore), r) for r in self.rules]
        hf_templates = [name for r in self.rules for name in r.hf + r.aliases]
        self._compiled_hf = [(_pattern(name), r) for r in self.rules for name in r.hf + r.aliases]
        self._ignored = [re.compile(p) for p in self.ignore_hf]
        self._mcore_by_shape = _by_shape(self._compiled, [r.mcore for r in self.rules])
        self._hf_by_shape = _by_shape(self._compiled_hf, hf_templates)

    def match(self, mcore_name: str) -> tuple[Rule, dict[str, int]]:
        """The rule for a local Megatron tensor name and its captured local indices."""
        for pattern, rule in self._mcore_by_shape.get(_shape_of(mcore_name), ()):
            m = pattern.match(mcore_name)
            if m:
                return rule, {k: int(v) for k, v in m.groupdict().items()}
        raise WeightMapError(f"Megatron tensor {mcore_name!r} has no rule in the weight map")

    def hf_names(self, rule: Rule, local: dict[str, int], ctx: ShardContext, aliases: bool = False) -> list[str]:
        """HF names for a rule (or its aliases), with local layer/expert indices turned global."""
        fields: dict[str, int] = {}
        if "layer" in local:
            fields["layer"] = local["layer"] + ctx.layer_offset
        if "expert" in local:
            fields["expert"] = local["expert"] + ctx.ep_rank * ctx.num_local_experts
        return [name.format(**fields) for name in (rule.aliases if aliases else rule.hf)]

    def is_known_hf(self, name: str, num_layers: int, num_experts: int) -> bool:
        """Whether an HF checkpoint name belongs to this model (right pattern, indices in range) or is ignored."""
        if any(p.match(name) for p in self._ignored):
            return True
        for pattern, _ in self._hf_by_shape.get(_shape_of(name), ()):
            m = pattern.match(name)
            if m:
                idx = m.groupdict()
                # Out of range for this pattern; another may still match (an MTP layer's literal index).
                if "layer" in idx and int(idx["layer"]) >= num_layers:
                    continue
                if "expert" in idx and int(idx["expert"]) >= num_experts:
                    continue
                return True
        return False


def _local_tensors(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers of a model chunk, by local Megatron name (TE extra state skipped)."""
    for name, tensor in chunk.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or tensor is None:
            continue
        yield name, tensor


def exported_tensors(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The local tensors of a chunk that export to HF: all but the MTP stage's copy of the first stage's embedding
    (Megatron ties the two; the first stage exports it). Export and weight sync both iterate these."""
    for name, tensor in _local_tensors(chunk):
        if name == "embedding.word_embeddings.weight" and not getattr(chunk, "pre_process", True):
            continue
        yield name, tensor


def hf_to_megatron(
    weight_map: WeightMap,
    name: str,
    shape: tuple[int, ...],
    ctx: ShardContext,
    read_hf: Callable[[str], torch.Tensor],
) -> tuple[torch.Tensor, list[str]]:
    """One Megatron tensor (this rank's shard, of `shape`) built from the HF tensors its rule names.

    Returns the value and the HF names read. A missing HF tensor or a shape that disagrees is a WeightMapError naming
    both sides.
    """
    rule, local = weight_map.match(name)
    names = weight_map.hf_names(rule, local, ctx)
    hf = []
    for hf_name in names:
        try:
            hf.append(read_hf(hf_name))
        except KeyError:
            raise WeightMapError(f"HF tensor {hf_name!r} is missing (needed for Megatron {name!r})") from None
    shard, num_shards = ctx.shard_of(rule.transform.axis_for(torch.Size(shape)))
    try:
        value = rule.transform.to_megatron(hf, shard, num_shards)
    except ValueError as err:
        raise WeightMapError(f"{', '.join(names)} -> {name}: {err}") from None
    if tuple(value.shape) != tuple(shape):
        raise WeightMapError(
            f"HF tensor(s) {', '.join(names)} give shape {tuple(value.shape)} for Megatron {name!r}, "
            f"which expects {tuple(shape)}"
        )
    return value, names


def megatron_to_hf(
    weight_map: WeightMap, name: str, shards: list[torch.Tensor], ctx: ShardContext
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors (aliases included) of one Megatron tensor, from all its shards along the rule's axis."""
    rule, local = weight_map.match(name)
    if not rule.export:
        return []
    values = rule.transform.to_hf(shards)
    out = list(zip(weight_map.hf_names(rule, local, ctx), values))
    return out + [(alias, values[0]) for alias in weight_map.hf_names(rule, local, ctx, aliases=True)]


def load_hf_weights(
    chunks: list[torch.nn.Module],
    contexts: list[ShardContext],
    weight_map: WeightMap,
    read_hf: Callable[[str], torch.Tensor],
) -> set[str]:
    """Fill every local tensor of `chunks` from HF tensors; return the HF names this rank read.

    `read_hf(name)` returns an HF tensor or raises KeyError; a missing tensor becomes a WeightMapError naming it.
    """
    used: set[str] = set()
    for chunk, ctx in zip(chunks, contexts):
        for name, tensor in _local_tensors(chunk):
            value, names = hf_to_megatron(weight_map, name, tuple(tensor.shape), ctx, read_hf)
            with torch.no_grad():
                tensor.copy_(value.to(tensor.dtype))
            used.update(names)
    return used


def export_hf_weights(
    chunks: list[torch.nn.Module],
    contexts: list[ShardContext],
    weight_map: WeightMap,
    tp_group: dist.ProcessGroup | None,
    etp_group: dist.ProcessGroup | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the tensors this rank owns, gathering TP/ETP shards.

    Collective: every rank of a TP (ETP) group must iterate in step, since each sharded tensor is all-gathered. The
    order is the model's own parameter order, identical on all ranks of a group (same structure, same names).
    """
    for chunk, ctx in zip(chunks, contexts):
        for name, tensor in exported_tensors(chunk):
            rule, local = weight_map.match(name)
            axis = rule.transform.axis_for(tensor.shape)
            group, size = (tp_group, ctx.tp_size) if axis == "tp" else (etp_group, ctx.etp_size)
            local_value = tensor.detach()
            if axis is not None and size > 1:
                shards = [torch.empty_like(local_value) for _ in range(size)]
                dist.all_gather(shards, local_value.contiguous(), group=group)
            else:
                shards = [local_value]
            owner = ctx.owns_experts if rule.is_expert else ctx.owns_dense
            if owner:
                yield from megatron_to_hf(weight_map, name, shards, ctx)
