"""Run this rank's part of a sync plan: gather, transform into the flat bucket, hand it to the transport.

```
for each stream this rank is in, for each bucket (same order on every rank of the stream's group):
    gather   one all_gather_into_tensor over the group (tp or etp) of this rank's shard bytes of the bucket's
             sharded tensors (one collective per bucket, not per tensor)
    pack     leader only: the gathered tensors go into the bucket buffer at their planned offsets in HF layout (QKV
             split per query group, GLU halves, vocab padding trimmed, row/column joins) by ONE block copy
             (kernels/block_copy.py: Triton on GPU) whose table the plan traced from the transforms (blocks.py);
             tensors that need no gather are copied by their transform's to_hf views
    send     leader only: transport.send(bucket, buffer); the transport works while the next bucket is gathered
```
Memory: a leader holds at most two buckets at once (the one in flight and the one being built), plus the gather
buffer of the bucket being built, which holds its sharded tensors' bytes (at most one bucket); the executor counts
every buffer it allocates (`Allocations`), so a test can assert the bound from the counts.

Double buffering: while bucket k is in flight, bucket k+1 is gathered (its collective overlaps the transport);
packing k+1 waits for k's send to complete when a new buffer would exceed two buckets.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from mcore_rl.kernels.block_copy import copy_blocks
from mcore_rl.kernels.fp8_blockwise import quantize_blockwise
from mcore_rl.resharding.sync.blocks import blocks_of, trace_outputs
from mcore_rl.resharding.sync.inventory import global_name
from mcore_rl.resharding.sync.plan import FP8_BLOCK, Bucket, Stream, SyncPlan
from mcore_rl.resharding.weight_map import Rule, ShardContext, WeightMap, exported_tensors


class Transport(Protocol):
    """Where buckets go (see resharding/sync/transports/). `send` may return before the bytes have left; the buffer
    must then stay untouched until `wait()` returns."""

    def allocate(self, nbytes: int) -> torch.Tensor: ...

    def send(self, stream: Stream, bucket: Bucket, buffer: torch.Tensor) -> None: ...

    def wait(self) -> None: ...


@dataclass
class Allocations:
    """Bytes of the executor's live buffers, and the peak (counted from the buffers themselves, freed by GC)."""

    current: int = 0
    peak: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        weakref.finalize(tensor, self._free, nbytes)
        return tensor

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self.current -= nbytes


@dataclass
class SyncStats:
    buckets: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    gather_s: float = 0.0
    pack_s: float = 0.0
    wait_s: float = 0.0
    peak_extra_bytes: int = 0


class SyncExecutor:
    """One actor rank's executor for one plan (built once, run once per weight version)."""

    def __init__(
        self,
        plan: SyncPlan,
        rank: int,
        chunks: list[torch.nn.Module],
        contexts: list[ShardContext],
        weight_map: WeightMap,
        groups: dict[str, dist.ProcessGroup | None],
    ) -> None:
        """`groups` maps "tp" and "etp" to this rank's Megatron TP / expert-TP groups (None when of size 1)."""
        self.plan = plan
        self.rank = rank
        self.groups = groups
        self.alloc = Allocations()
        self._tensors: dict[str, tuple[Rule, torch.Tensor]] = {}
        for chunk, ctx in zip(chunks, contexts):
            for name, tensor in exported_tensors(chunk):
                rule, local = weight_map.match(name)
                self._tensors[global_name(rule, local, ctx)] = (rule, tensor)
        self._streams = plan.streams_of(rank)
        for stream in self._streams:
            for bucket in plan.buckets_of(stream.index):
                for i in bucket.sources:
                    name = plan.sources[i].mcore
                    if name not in self._tensors:
                        raise ValueError(f"sync plan stream {stream.name} needs {name!r}, which rank {rank} lacks")
        self._tables = self._block_tables()

    def _block_tables(self) -> dict[tuple[int, int], torch.Tensor]:
        """Per (stream, bucket) this rank leads with a gather: the block-copy table that packs its gathered bytes
        into the bucket (resharding/sync/blocks.py), built once per plan."""
        tables = {}
        for stream in self._streams:
            if stream.leader != self.rank or len(stream.group) == 1:
                continue
            g = len(stream.group)
            for bucket in self.plan.buckets_of(stream.index):
                sharded = [i for i in bucket.sources if self.plan.sources[i].axis is not None]
                if not sharded:
                    continue
                row = sum(self.plan.sources[i].shard_bytes for i in sharded)
                fp8 = {e.source for e in bucket.entries if e.quant}
                rows: list[tuple[int, ...]] = []
                offset = 0
                for i in sharded:
                    source = self.plan.sources[i]
                    if i in fp8:  # quantised on the way: packed through its transform and the FP8 kernel instead
                        offset += source.shard_bytes
                        continue
                    rule = self._tensors[source.mcore][0]
                    size = torch.empty((), dtype=getattr(torch, source.dtype)).element_size()
                    outputs = trace_outputs(
                        rule.transform, source.shard_shape, size, [k * row + offset for k in range(g)]
                    )
                    for entry in bucket.entries:
                        if entry.source == i:
                            rows += blocks_of(outputs[entry.output], size, entry.offset)
                    offset += source.shard_bytes
                tables[(stream.index, bucket.index)] = torch.tensor(rows, dtype=torch.int64).reshape(-1, 6)
        return tables

    def run(self, transport: Transport) -> SyncStats:
        """Send every bucket of this rank's streams through `transport` (collective within each stream's group)."""
        stats = SyncStats()
        with self.alloc._lock:  # this run's peak, not the largest of every run so far
            self.alloc.peak = self.alloc.current
        start = time.perf_counter()
        for stream in self._streams:
            leader = stream.leader == self.rank
            for bucket, gathered, offsets in self._gathered(stream, stats):
                if not leader:
                    continue
                t0 = time.perf_counter()
                if gathered is not None:  # the gather buffer is alive: let the bucket in flight land first
                    transport.wait()
                stats.wait_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                buffer = self._pack(bucket, gathered, offsets, transport)
                del gathered
                stats.pack_s += time.perf_counter() - t0
                transport.send(stream, bucket, buffer)
                del buffer  # the transport holds it while in flight; no reference here may keep it longer
                stats.buckets += 1
                stats.bytes_sent += bucket.nbytes
        t0 = time.perf_counter()
        transport.wait()
        stats.wait_s += time.perf_counter() - t0
        stats.seconds = time.perf_counter() - start
        stats.peak_extra_bytes = self.alloc.peak
        return stats

    # ------------------------------------------------------------------ gather
    def _gathered(
        self, stream: Stream, stats: SyncStats
    ) -> Iterator[tuple[Bucket, torch.Tensor | None, dict[int, int]]]:
        """Per bucket: the gathered shard bytes [group, bytes] (None when nothing is sharded) and each sharded
        source's byte offset in a row."""
        axis = "tp" if stream.ep_rank is None else "etp"
        group = self.groups.get(axis) if len(stream.group) > 1 else None
        for bucket in self.plan.buckets_of(stream.index):
            sharded = [i for i in bucket.sources if self.plan.sources[i].axis is not None]
            if group is None or not sharded:
                yield bucket, None, {}
                continue
            t0 = time.perf_counter()
            offsets, pieces, size = {}, [], 0
            for i in sharded:
                tensor = self._tensors[self.plan.sources[i].mcore][1].detach()
                offsets[i] = size
                pieces.append(tensor)
                size += tensor.numel() * tensor.element_size()
            # In place: this rank's shard bytes go straight into its row of the output, which is the collective's
            # input, so no separate send buffer exists (Megatron gathers its distributed optimizer's params alike).
            out = self.alloc.track(torch.empty(len(stream.group) * size, dtype=torch.uint8, device=pieces[0].device))
            mine = out[stream.group.index(self.rank) * size : (stream.group.index(self.rank) + 1) * size]
            for i, tensor in zip(sharded, pieces):
                mine[offsets[i] : offsets[i] + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(
                    tensor.shape
                ).copy_(tensor)
            dist.all_gather_into_tensor(out, mine, group=group)
            del pieces, mine
            stats.gather_s += time.perf_counter() - t0
            yield bucket, out.view(len(stream.group), size), offsets
            del out  # before the next bucket's gather: one gather buffer alive at a time

    # ------------------------------------------------------------------ pack
    def _pack(
        self, bucket: Bucket, gathered: torch.Tensor | None, offsets: dict[int, int], transport: Transport
    ) -> torch.Tensor:
        buffer = self.alloc.track(transport.allocate(bucket.nbytes))
        by_source: dict[int, list[Any]] = {}
        for entry in bucket.entries:
            by_source.setdefault(entry.source, []).append(entry)
        table = self._tables.get((bucket.stream, bucket.index))
        if gathered is not None and table is not None and len(table):
            # every gathered tensor of the bucket in one block copy (one launch on GPU)
            copy_blocks(gathered.reshape(-1), buffer, table)
        with torch.no_grad():
            for i, entries in by_source.items():
                quantised = any(e.quant for e in entries)
                if gathered is not None and i in offsets and not quantised:
                    continue  # done by the block copy
                source = self.plan.sources[i]
                rule, tensor = self._tensors[source.mcore]
                dtype = tensor.dtype
                if gathered is not None and i in offsets:
                    n = source.shard_bytes
                    shards = [
                        gathered[g, offsets[i] : offsets[i] + n].view(dtype).view(source.shard_shape)
                        for g in range(gathered.shape[0])
                    ]
                else:
                    shards = [tensor.detach()]
                values = rule.transform.to_hf(shards)
                scales = {e.name.removesuffix("_scale_inv"): e for e in entries if e.quant == "scale"}
                for entry in entries:
                    if entry.quant == "scale":
                        continue
                    target = buffer[entry.offset : entry.offset + entry.nbytes]
                    if entry.quant == "fp8":  # the family's FP8 layout: 128x128 e4m3 blocks + weight_scale_inv
                        q, scale_inv = quantize_blockwise(values[entry.output].contiguous(), (FP8_BLOCK, FP8_BLOCK))
                        target.view(q.dtype).view(entry.shape).copy_(q)
                        s = scales[entry.name]
                        buffer[s.offset : s.offset + s.nbytes].view(torch.float32).view(s.shape).copy_(scale_inv)
                    else:
                        target.view(dtype).view(entry.shape).copy_(values[entry.output])
        return buffer
