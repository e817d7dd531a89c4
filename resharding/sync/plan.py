"""The weight-sync plan: pure data, identical on every rank, computed once per (actor layout, engine layout, buckets).

```
sources (inventory.py) -> streams: one per (pipeline stage, dense | EP rank); its leader sends, its TP/ETP group
                                   gathers (dense: the tp ranks of one dp/cp replica; experts: the etp ranks of one
                                   edp replica of the owning EP rank)
                       -> leaders: spread over the ranks that hold each stream (any replica, any rank of the
                                   group), largest stream first, each to the rank that sends the fewest bytes so far;
                                   one_leader (vLLM's one NCCL group on CUDA): all on the lowest rank holding them all
                       -> buckets: each stream's HF tensors packed back to back (4-byte dtypes first, so every offset
                                   is aligned: SGLang's receiving FlattenedTensorBucket requires it) up to bucket_bytes;
                                   tensors an engine must receive together (the family's ReceiveTogether groups) are
                                   one unit, never split; a unit larger than bucket_bytes travels alone in a bucket
                                   of its own size
                       -> receivers: which engine ranks keep which slice of each HF tensor (mode full: everything;
                                   shard_aware: its TP slice, experts only on their EP owner)
```
Bucket size: `bucket_bytes` is a target, not a refusal. A tensor is sent whole, so no bucket size below the largest
tensor (DeepSeek-V3's embedding: 1.85 GB; Qwen3-235B's: 1.24 GB) could work; raising every bucket to it would
coarsen the whole pipeline for one tensor. So the few oversized units get a bucket each, the rest stay within
`bucket_bytes`, and a rank's extra memory is two buffers of `max_bucket_bytes` plus the largest gathered tensor (the
dry run prints both).

Stages and EP ranks stream in parallel (different leaders, different broadcast groups): with leaders spread, no rank
packs and sends two streams while another one idles (TP2 x EP2: the dense stream leaves from a rank that leads no
expert stream). `SyncPlan.digest()` hashes
everything, so ranks can check they agree before any byte moves.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from mcore_rl.resharding.sync.inventory import SourceTensor

MODES = ("full", "shard_aware")
_ITEMSIZE = {"float64": 8, "float32": 4, "int32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "uint8": 1}
# (FP8 entries: e4m3 bytes; their float32 scales come first in a bucket, as the widest dtype)


class PlanError(ValueError):
    """A plan that cannot work (layout does not divide the model, bucket too small, ...); the message says why."""


@dataclass(frozen=True)
class EngineLayout:
    """The rollout engines: how many, and each engine's tensor / expert / attention-data parallelism."""

    num_engines: int = 1
    tp: int = 1  #: ranks per engine
    ep: int = 1  #: expert-parallel size inside an engine (divides tp); experts are TP-split over tp // ep
    dp_attention: int = 1  #: attention data-parallel groups (attention weights TP-split over tp // dp_attention)

    def validate(self, num_heads: int, num_kv_heads: int, num_experts: int) -> None:
        for name in ("num_engines", "tp", "ep", "dp_attention"):
            if getattr(self, name) < 1:
                raise PlanError(f"engine layout {name}={getattr(self, name)}: expected >= 1")
        if self.tp % self.ep or self.tp % self.dp_attention:
            raise PlanError(
                f"engine tp={self.tp} must be divisible by ep={self.ep} and dp_attention={self.dp_attention}"
            )
        attn_tp = self.tp // self.dp_attention
        if num_heads % attn_tp:
            raise PlanError(f"num_attention_heads={num_heads} is not divisible by the engine's attention tp={attn_tp}")
        if num_kv_heads and (num_kv_heads % attn_tp and attn_tp % num_kv_heads):
            raise PlanError(f"num_key_value_heads={num_kv_heads} and engine attention tp={attn_tp} do not divide")
        if num_experts and num_experts % self.ep:
            raise PlanError(f"num_experts={num_experts} is not divisible by the engine's ep={self.ep}")


@dataclass(frozen=True)
class ShardRule:
    """How an engine shards HF tensors whose names match `pattern` (family knowledge: SGLang's loaders).

    kind: replicate | attn (split `dim` over attention tp) | kv (k/v heads: split, or replicated when fewer heads than
    ranks) | dense (split `dim` over the engine's tp) | vocab (rows over tp) | expert (owner EP rank only; split `dim`
    over the expert tp).
    """

    pattern: str
    kind: str
    dim: int = 0


@dataclass(frozen=True)
class ReceiveTogether:
    """HF tensors an engine must receive in one request (family knowledge: SGLang's loaders).

    SGLang's DeepSeek loader, for example, fuses `q_a_proj` with `kv_a_proj_with_mqa` only when both arrive in the
    same `load_weights` call, and drops a half that arrives alone (the layer keeps its old or dummy weights, with no
    error). `pattern` is matched (re.search) against every HF name; names whose match has the same named group
    `key` form one group, which the planner keeps in one bucket.
    """

    pattern: str

    def key(self, name: str) -> str | None:
        """The group `name` belongs to, or None."""
        match = re.search(self.pattern, name)
        return None if match is None else match.group("key")


@dataclass(frozen=True)
class Entry:
    """One HF tensor in a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  #: byte offset in the bucket
    nbytes: int
    source: int  #: index into SyncPlan.sources
    output: int  #: which output of the source's transform (aliases repeat output 0)
    shard: str  #: the ShardRule kind that places it on engine ranks
    dim: int
    #: "" | "fp8": the output quantised to e4m3 (128x128 blocks) | "scale": its weight_scale_inv (of entry `name`
    #: without the suffix)
    quant: str = ""


@dataclass(frozen=True)
class Bucket:
    stream: int
    index: int  #: position in its stream
    nbytes: int
    entries: tuple[Entry, ...]

    @property
    def sources(self) -> list[int]:
        return sorted({e.source for e in self.entries})


@dataclass(frozen=True)
class Stream:
    """The tensors one leader rank sends: a pipeline stage's dense tensors, or one EP rank's experts there."""

    index: int
    pp_rank: int
    ep_rank: int | None
    leader: int  #: actor rank that packs and sends (one of `group`)
    group: tuple[int, ...]  #: actor ranks that gather to the leader, in tp / etp rank order (the gather's row order)
    name: str  #: the broadcast group's name, e.g. "pp0-dense", "pp1-ep3"


@dataclass(frozen=True)
class SyncPlan:
    mode: str
    bucket_bytes: int
    actor: str
    engines: EngineLayout
    sources: tuple[SourceTensor, ...]
    streams: tuple[Stream, ...]
    buckets: tuple[Bucket, ...]
    rules: tuple[ShardRule, ...] = field(repr=False)
    num_experts: int = 0
    num_kv_heads: int = 0
    fp8: bool = False

    def digest(self) -> str:
        """sha256 over the whole plan: equal on every rank that computed the same plan."""
        data = json.dumps(asdict(self), sort_keys=True, default=str).encode()
        return hashlib.sha256(data).hexdigest()

    def streams_of(self, rank: int) -> list[Stream]:
        """The streams `rank` takes part in (as leader or gather peer), in plan order."""
        return [s for s in self.streams if rank in s.group]

    def buckets_of(self, stream: int) -> list[Bucket]:
        return [b for b in self.buckets if b.stream == stream]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        """The largest bucket: `bucket_bytes`, or more where a tensor or a receive-together group is larger."""
        return max((b.nbytes for b in self.buckets), default=0)

    def split_groups(self, together: tuple[ReceiveTogether, ...]) -> list[str]:
        """Receive-together groups whose members are not all in one bucket (a correct plan has none)."""
        where: dict[tuple[int, str], set[int]] = {}
        for i, bucket in enumerate(self.buckets):
            for e in bucket.entries:
                for j, rule in enumerate(together):
                    key = rule.key(e.name)
                    if key is not None:
                        where.setdefault((j, key), set()).add(i)
        return [f"{key}: in buckets {sorted(found)}" for (_, key), found in sorted(where.items()) if len(found) > 1]

    @property
    def largest_tensor_bytes(self) -> int:
        """The largest tensor a sync holds whole: an HF tensor of a bucket, or a sharded Megatron tensor gathered over
        its stream's group (more bytes than its HF outputs where vocab padding is trimmed)."""
        group = {(s.pp_rank, s.ep_rank): len(s.group) for s in self.streams}
        gathered = (s.shard_bytes * group[(s.pp_rank, s.ep_rank)] for s in self.sources if s.axis is not None)
        return max(max((e.nbytes for b in self.buckets for e in b.entries), default=0), max(gathered, default=0))

    # ------------------------------------------------------------------ receivers
    def receive_slice(self, entry: Entry, engine_rank: int) -> tuple[int, int] | None:
        """The rows (start, length along entry.dim) engine rank `engine_rank` keeps of `entry`; None: nothing."""
        return self.receive_slices(entry)[engine_rank]

    def receive_slices(self, entry: Entry) -> list[tuple[int, int] | None]:
        """What each engine rank keeps of `entry`: per rank r, the rows (start, length along entry.dim), or None.

        Mode full: every rank keeps the whole tensor. shard_aware: see ShardRule. One call answers for all ranks (a
        1024-rank plan asks this ~10^5 times per engine rank).
        """
        size = entry.shape[entry.dim] if entry.shape else 1
        eng = self.engines
        if self.mode == "full" or entry.shard == "replicate" or not entry.shape:
            return [(0, size)] * eng.tp
        if entry.shard == "expert":
            expert = int(_EXPERT.search(entry.name)[1])
            moe_tp = eng.tp // eng.ep
            owner = expert // (self.num_experts // eng.ep)
            parts = [_part(size, moe_tp, i) for i in range(moe_tp)]
            return [parts[r % moe_tp] if r // moe_tp == owner else None for r in range(eng.tp)]
        if entry.shard in ("attn", "kv"):
            attn_tp = eng.tp // eng.dp_attention
            heads = (self.num_kv_heads or attn_tp) if entry.shard == "kv" else attn_tp
            if heads >= attn_tp:
                parts = [_part(size, attn_tp, i) for i in range(attn_tp)]
            else:  # fewer kv heads than attention ranks: each head on attn_tp/heads ranks
                parts = [_part(size, heads, i * heads // attn_tp) for i in range(attn_tp)]
            return [parts[r % attn_tp] for r in range(eng.tp)]
        if entry.shard in ("dense", "vocab"):
            return [_part(size, eng.tp, r) for r in range(eng.tp)]
        raise PlanError(f"unknown shard kind {entry.shard!r} for {entry.name}")

    def received_bytes(self, engine_rank: int) -> int:
        """Bytes one engine rank receives (every engine's rank r receives the same)."""
        total = 0
        for bucket in self.buckets:
            for e in bucket.entries:
                got = self.receive_slices(e)[engine_rank]
                if got is not None:
                    total += e.nbytes // max(1, e.shape[e.dim] if e.shape else 1) * got[1]
        return total

    def check_coverage(self) -> list[str]:
        """Problems with the receivers: every byte of every tensor is kept by some rank of each engine, exactly once
        per rank, slices in bounds, and ranks that must not hold a tensor (other EP owners) get none of it."""
        problems = []
        for bucket in self.buckets:
            for e in bucket.entries:
                size = e.shape[e.dim] if e.shape else 1
                slices = list(enumerate(self.receive_slices(e)))
                held = sorted(s for _, s in slices if s is not None)
                if any(start < 0 or start + length > size for start, length in held):
                    problems.append(f"{e.name}: a slice is out of bounds {held}")
                covered, distinct = 0, sorted(set(held))
                for start, length in distinct:
                    if start != covered and start > covered:
                        problems.append(f"{e.name}: rows {covered}..{start} reach no engine rank")
                    covered = max(covered, start + length)
                if covered != size:
                    problems.append(f"{e.name}: rows {covered}..{size} reach no engine rank")
                if self.mode == "shard_aware" and e.shard == "expert":
                    owners = {r // (self.engines.tp // self.engines.ep) for r, s in slices if s is not None}
                    if len(owners) != 1:
                        problems.append(f"{e.name}: held by EP ranks {sorted(owners)}, expected its one owner")
        seen: dict[str, int] = {name: 0 for s in self.sources for name in s.hf}  # what the model exports
        fp8 = {e.name for b in self.buckets for e in b.entries if e.quant == "fp8"}
        scales = [e.name.removesuffix("_scale_inv") for b in self.buckets for e in b.entries if e.quant == "scale"]
        if sorted(scales) != sorted(fp8):
            problems.append(f"FP8 tensors and their scales do not pair up: {sorted(set(fp8) ^ set(scales))[:5]}")
        for bucket in self.buckets:
            for e in bucket.entries:
                if e.quant == "scale":
                    continue
                if e.name not in seen:
                    problems.append(f"{e.name}: sent, but the model exports no such tensor")
                seen[e.name] = seen.get(e.name, 0) + 1
        problems += [f"{name}: sent {n} times, expected once" for name, n in seen.items() if n != 1]
        return problems


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _part(size: int, parts: int, index: int) -> tuple[int, int]:
    """Part `index` of `parts` near-equal parts of `size` rows (the last takes the remainder; vocab rows need not
    divide)."""
    step = -(-size // parts)
    start = min(size, index * step)
    return start, max(0, min(size, start + step) - start)


def shard_kind(rules: tuple[ShardRule, ...], name: str) -> tuple[str, int]:
    for rule in rules:
        if re.search(rule.pattern, name):
            return rule.kind, rule.dim
    return "replicate", 0


def build_plan(
    sources: list[SourceTensor],
    *,
    actor_layout,  # noqa: ANN001 (ParallelLayout; resharding takes it as data)
    world_size: int,
    engines: EngineLayout,
    rules: tuple[ShardRule, ...],
    bucket_bytes: int,
    mode: str = "full",
    num_experts: int = 0,
    num_kv_heads: int = 0,
    num_heads: int = 0,
    fp8_targets: re.Pattern | None = None,
    receive_together: tuple[ReceiveTogether, ...] = (),
    one_leader: bool = False,
) -> SyncPlan:
    """The plan (see the module docstring). PlanError when the engine layout does not divide the model, a
    receive-together group spans two streams, `bucket_bytes` is not positive or a mode is unknown. With
    `fp8_targets`, the HF tensors it matches (2-D) travel as 128x128-blockwise e4m3 plus a float32
    `<name>_scale_inv` (the family's FP8 release layout). `receive_together`: the family's groups of HF tensors an
    engine must receive in one bucket (ModelFamily.engine_receive_together). `one_leader`: every stream leaves from
    one rank (vLLM's NCCL weight-transfer group has one sender; `_place_streams`), PlanError when no rank holds them
    all (actor pp > 1 or ep > 1); buckets and bytes are the same as without."""
    if mode not in MODES:
        raise PlanError(f"sync mode {mode!r} is invalid: expected one of {MODES}")
    if bucket_bytes < 1:
        raise PlanError(f"sync.bucket_bytes={bucket_bytes} is invalid: expected a positive number of bytes")
    engines.validate(num_heads or engines.tp, num_kv_heads, num_experts)
    stream_bytes: dict[tuple[int, int | None], int] = {}  # in order of first appearance
    for s in sources:
        key = (s.pp_rank, s.ep_rank)
        stream_bytes[key] = stream_bytes.get(key, 0) + s.hf_bytes
    streams = _place_streams(list(stream_bytes), stream_bytes, actor_layout, world_size, one_leader)
    buckets: list[Bucket] = []
    for key, stream in streams.items():
        members = [(i, s) for i, s in enumerate(sources) if (s.pp_rank, s.ep_rank) == key]
        pending: list[tuple[int, SourceTensor]] = []
        size = 0
        for unit in _units(members, receive_together, stream.name):
            nbytes = sum(s.hf_bytes for _, s in unit)
            if pending and size + nbytes > bucket_bytes:  # an oversized unit also closes the bucket before it
                buckets.append(_bucket(stream.index, len(buckets), pending, rules, fp8_targets))
                pending, size = [], 0
            pending += unit
            size += nbytes
        if pending:
            buckets.append(_bucket(stream.index, len(buckets), pending, rules, fp8_targets))
    _check_groups_in_one_stream(sources, receive_together)
    # bucket index inside its stream
    counters: dict[int, int] = {}
    numbered = []
    for b in buckets:
        numbered.append(Bucket(b.stream, counters.get(b.stream, 0), b.nbytes, b.entries))
        counters[b.stream] = counters.get(b.stream, 0) + 1
    return SyncPlan(
        mode=mode,
        bucket_bytes=bucket_bytes,
        actor=actor_layout.describe(),
        engines=engines,
        sources=tuple(sources),
        streams=tuple(streams.values()),
        buckets=tuple(numbered),
        rules=tuple(rules),
        num_experts=num_experts,
        num_kv_heads=num_kv_heads,
        fp8=fp8_targets is not None,
    )


def _units(
    members: list[tuple[int, SourceTensor]], together: tuple[ReceiveTogether, ...], stream: str
) -> list[list[tuple[int, SourceTensor]]]:
    """A stream's sources as packing units, in stream order: a receive-together group is one unit, at the position
    of its first member (its later members move up to it)."""
    units: list[list[tuple[int, SourceTensor]]] = []
    group_unit: dict[tuple[int, str], int] = {}
    for i, s in members:
        keys = {(j, k) for j, rule in enumerate(together) for k in [rule.key(n) for n in s.hf] if k is not None}
        found = sorted({group_unit[k] for k in keys if k in group_unit})
        if len(found) > 1:  # a source that joins two groups would merge them: a family rule this planner refuses
            raise PlanError(f"{s.mcore} in stream {stream} belongs to two receive-together groups {sorted(keys)}")
        if found:
            units[found[0]].append((i, s))
            index = found[0]
        else:
            units.append([(i, s)])
            index = len(units) - 1
        for k in keys:
            group_unit[k] = index
    return units


def _check_groups_in_one_stream(sources: list[SourceTensor], together: tuple[ReceiveTogether, ...]) -> None:
    """PlanError when a receive-together group's members leave from two streams (they could never share a bucket)."""
    streams: dict[str, set[tuple[int, int | None]]] = {}
    for s in sources:
        for rule in together:
            for name in s.hf:
                key = rule.key(name)
                if key is not None:
                    streams.setdefault(key, set()).add((s.pp_rank, s.ep_rank))
    for key, found in sorted(streams.items()):
        if len(found) > 1:
            raise PlanError(
                f"the tensors of {key} must reach an engine in one request, but leave from streams "
                f"{sorted(found, key=str)} (pipeline stage, EP rank)"
            )


def _place_streams(
    keys: list[tuple[int, int | None]],
    stream_bytes: dict[tuple[int, int | None], int],
    layout,  # noqa: ANN001
    world_size: int,
    one_leader: bool = False,
) -> dict[tuple[int, int | None], Stream]:
    """A group and a leader for every (pp stage, EP rank | None) stream. Candidates: the TP group of every dp/cp
    replica of the stage (dense), the ETP group of every edp replica of the EP owner (experts); they all hold the same
    weights. Largest stream first, the leader is the candidate rank with the fewest bytes to send so far (ties: the
    lowest rank), so leaders spread and their sends run in parallel. `one_leader`: the lowest rank that is a
    candidate of every stream leads them all (with pp=1 and ep=1 every rank holds a shard of every stream), each
    stream's group the one that rank is in; PlanError naming the streams when no rank is."""
    coords = [layout.coords(r, world_size) for r in range(world_size)]
    by_stage: dict[int, list[Any]] = {}
    for c in coords:
        by_stage.setdefault(c.pp_rank, []).append(c)
    candidates: dict[tuple[int, int | None], list[tuple[int, ...]]] = {}  # each stream's gather groups
    for key in keys:
        pp_rank, ep_rank = key
        replicas: dict[tuple[int, ...], list[int]] = {}
        for c in by_stage[pp_rank]:
            if ep_rank is None:
                replicas.setdefault((c.dp_rank, c.cp_rank), []).append(c.rank)
            elif c.ep_rank == ep_rank:
                replicas.setdefault((c.edp_rank,), []).append(c.rank)
        axis = "tp_rank" if ep_rank is None else "etp_rank"
        candidates[key] = [
            tuple(sorted(g, key=lambda r: getattr(coords[r], axis))) for _, g in sorted(replicas.items())
        ]
    chosen: dict[tuple[int, int | None], tuple[int, tuple[int, ...]]] = {}
    if one_leader:
        common = set(range(world_size))
        for groups in candidates.values():
            common &= {r for g in groups for r in g}
        if not common:
            names = [_stream_name(k) for k in keys]
            raise PlanError(
                f"one sync leader asked for (vLLM's one NCCL weight-transfer group), but no actor rank holds every "
                f"stream of {names} (pipeline stages and EP ranks hold different weights): expected actor.layout.pp=1 "
                f"and actor.layout.ep=1"
            )
        leader = min(common)
        chosen = {key: (leader, next(g for g in groups if leader in g)) for key, groups in candidates.items()}
    load = [0] * world_size
    for _, _, key in [] if one_leader else sorted((-stream_bytes[k], i, k) for i, k in enumerate(keys)):
        # i is unique: k is never compared
        groups = candidates[key]
        leader, group = min(((r, g) for g in groups for r in g), key=lambda rg: (load[rg[0]], rg[0]))
        load[leader] += stream_bytes[key]
        chosen[key] = (leader, group)
    streams = {}
    for index, key in enumerate(keys):
        pp_rank, ep_rank = key
        leader, group = chosen[key]
        streams[key] = Stream(index, pp_rank, ep_rank, leader, group, _stream_name(key))
    return streams


def _stream_name(key: tuple[int, int | None]) -> str:
    """The broadcast group's name of stream (pp stage, EP rank | None)."""
    pp_rank, ep_rank = key
    return f"pp{pp_rank}-dense" if ep_rank is None else f"pp{pp_rank}-ep{ep_rank}"


def _bucket(
    stream: int,
    index: int,
    members: list[tuple[int, SourceTensor]],
    rules: tuple[ShardRule, ...],
    fp8_targets: re.Pattern | None,
) -> Bucket:
    items = []
    for i, s in members:
        for out, (name, shape) in enumerate(zip(s.hf, s.hf_shapes)):
            kind, dim = shard_kind(rules, name)
            output = out if out < s.num_outputs else 0  # an alias is a copy of the first output
            if fp8_targets is not None and len(shape) == 2 and fp8_targets.match(name):
                grid = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))
                items.append((name, tuple(shape), "float8_e4m3fn", _numel(shape), i, output, kind, dim, "fp8"))
                # scales are tiny: every engine rank gets all of them, whatever its slice of the weight
                items.append(
                    (name + "_scale_inv", grid, "float32", 4 * _numel(grid), i, output, "replicate", 0, "scale")
                )
            else:
                items.append(
                    (name, tuple(shape), s.dtype, _numel(shape) * _ITEMSIZE[s.dtype], i, output, kind, dim, "")
                )
    # widest dtype first: every offset stays a multiple of its tensor's item size
    items.sort(key=lambda t: -_ITEMSIZE[t[2]])
    entries, offset = [], 0
    for name, shape, dtype, nbytes, source, out, kind, dim, quant in items:
        entries.append(Entry(name, shape, dtype, offset, nbytes, source, out, kind, dim, quant))
        offset += nbytes
    return Bucket(stream, index, offset, tuple(entries))


FP8_BLOCK = 128  #: DeepSeek-V3's blockwise FP8: 128 x 128 tiles, one float32 weight_scale_inv each


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
