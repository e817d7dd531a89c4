"""Run this rank's part of a sync plan: gather, transform into the flat bucket, hand it to the transport.

```
for each bucket of the streams this rank is in, interleaved across streams (one global order on every rank):
    gather   the bucket's sharded tensors to the stream leader, in chunks of at most the largest tensor's bytes:
             each rank copies its shards side by side into its gather buffer, then on CPU each peer sends that row
             to the leader (one message per chunk; only the leader receives), on GPU one all_gather_into_tensor
    pack     leader only: the gathered tensors go into the bucket buffer at their planned offsets in HF layout (QKV
             split per query group, GLU halves, vocab padding trimmed, row/column joins) by ONE block copy per chunk
             (kernels/block_copy.py: Triton on GPU) whose table the plan traced from the transforms (blocks.py);
             tensors that need no gather are copied by their transform's to_hf views
    send     leader only: transport.send(bucket, buffer); the transport works while the next bucket is packed
```
Buffers are allocated once per plan and reused by every bucket of every sync (fresh pages cost more than the copies
into them: the first sync faults them in, later ones do not): two bucket buffers on a rank that leads a stream
(double buffering: bucket k packs into one while k-1 is in flight from the other), and one gather buffer of the
largest tensor's bytes on a rank of a stream that gathers (its streams run one after another: one serves them all).
They stay resident between syncs: at most 2 buckets + the largest tensor per rank, counted by `Allocations` (the
tests assert the bound from the counts; SyncStats reports the peak and what stays resident), dropped by `release()`
(after every sync with sync.keep_buffers=false).

Gather on CPU is point-to-point to the leader rather than gloo's all_gather: only the leader packs and sends, so an
all-gather would copy every byte to g - 1 ranks that drop it (gloo moves them through loopback TCP, on the same
cores that pack and send). On GPU NCCL's all_gather_into_tensor stays: one NVLink collective per chunk, whose extra
receives use links that are otherwise idle during a sync, against g - 1 send/recv pairs that NCCL would have to
group (batch_isend_irecv) to run concurrently.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.kernels.block_copy import copy_blocks
from mcore_rl.kernels.fp8_blockwise import quantize_blockwise
from mcore_rl.resharding.sync.blocks import blocks_of, trace_outputs
from mcore_rl.resharding.sync.inventory import global_name
from mcore_rl.resharding.sync.plan import FP8_BLOCK, Bucket, Stream, SyncPlan
from mcore_rl.resharding.sync.transports.base import Transport
from mcore_rl.resharding.weight_map import Rule, ShardContext, WeightMap, exported_tensors


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
    peak_extra_bytes: int = 0  #: the executor's buffers at their peak during this run (resident ones included)
    resident_bytes: int = 0  #: the executor's buffers kept after the run for the next one (see `release`)


@dataclass(frozen=True)
class _Chunk:
    """Sharded tensors of one bucket gathered together (at most the largest tensor's bytes in all)."""

    sources: tuple[int, ...]  #: indices into plan.sources
    offsets: tuple[int, ...]  #: each one's byte offset in a rank's row
    row: int  #: bytes per rank
    table: torch.Tensor | None  #: block-copy table into the bucket (leader), None when everything is quantised


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
        self._device = next(iter(self._tensors.values()))[1].device if self._tensors else torch.device("cpu")
        self._chunks = {
            (stream.index, bucket.index): self._chunk(stream, bucket)
            for stream in self._streams
            if len(stream.group) > 1
            for bucket in plan.buckets_of(stream.index)
        }
        # The order this rank handles its buckets in: the streams' buckets interleaved (bucket k of every stream at
        # about k / its bucket count), one global order on every rank. Stream by stream, a rank that leads one
        # stream and gathers for another would keep the other's leader waiting until its own stream is done (TP2 x
        # EP2: the dense stream's leader is an expert stream's peer); interleaved, both leaders' transports run at
        # once. Every rank takes its gathers in the same global order, so no two ranks wait on each other in a cycle.
        counts: dict[int, int] = {}
        for b in plan.buckets:
            counts[b.stream] = counts.get(b.stream, 0) + 1
        mine = {s.index: s for s in self._streams}
        order = sorted((b.index / counts[b.stream], b.stream, b.index) for b in plan.buckets if b.stream in mine)
        buckets = {(b.stream, b.index): b for b in plan.buckets if b.stream in mine}
        self._schedule = [(mine[stream], buckets[(stream, index)]) for _, stream, index in order]
        # a transport whose every rank takes part in every bucket (the tensor transport with colocated engines: it
        # broadcasts the bucket to the ranks on the engine ranks' GPUs) walks all buckets in the same global order
        every = {s.index: s for s in plan.streams}
        order = sorted((b.index / counts[b.stream], b.stream, b.index) for b in plan.buckets)
        by_key = {(b.stream, b.index): b for b in plan.buckets}
        self._every_schedule = [(every[stream], by_key[(stream, index)]) for _, stream, index in order]
        # reused buffers (see the module docstring): two bucket buffers, one gather buffer
        self._buffers: list[torch.Tensor] = []
        self._buffer_memory: str | None = None
        self._gather_buffer: torch.Tensor | None = None
        self._next_slot = 0

    def _chunk(self, stream: Stream, bucket: Bucket) -> list[_Chunk]:
        """The bucket's sharded tensors in chunks of at most plan.largest_tensor_bytes gathered bytes, each with the
        block-copy table that packs it into the bucket (resharding/sync/blocks.py), built once per plan."""
        g, cap, leader = len(stream.group), self.plan.largest_tensor_bytes, stream.leader == self.rank
        fp8 = {e.source for e in bucket.entries if e.quant}
        groups: list[list[int]] = [[]]
        size = 0
        for i in (i for i in bucket.sources if self.plan.sources[i].axis is not None):
            n = self.plan.sources[i].shard_bytes
            if groups[-1] and (size + n) * g > cap:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += n
        chunks = []
        for sources in (s for s in groups if s):
            offsets = []
            row = 0
            for i in sources:
                offsets.append(row)
                row += self.plan.sources[i].shard_bytes
            rows: list[tuple[int, ...]] = []
            for i, offset in zip(sources, offsets):
                if not leader or i in fp8:  # quantised on the way: packed through its transform and the FP8 kernel
                    continue
                source = self.plan.sources[i]
                rule = self._tensors[source.mcore][0]
                itemsize = torch.empty((), dtype=getattr(torch, source.dtype)).element_size()
                shard_offsets = [k * row + offset for k in range(g)]
                outputs = trace_outputs(rule.transform, source.shard_shape, itemsize, shard_offsets)
                for entry in bucket.entries:
                    if entry.source == i:
                        rows += blocks_of(outputs[entry.output], itemsize, entry.offset)
            table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 6) if rows else None
            chunks.append(_Chunk(tuple(sources), tuple(offsets), row, table))
        return chunks

    def release(self) -> None:
        """Drop the reused buffers (colocated offload, or a plan that changes); the next run allocates them again."""
        self._buffers, self._buffer_memory, self._gather_buffer = [], None, None

    @property
    def resident_bytes(self) -> int:
        """Bytes of the buffers this executor keeps between runs."""
        gather = 0 if self._gather_buffer is None else self._gather_buffer.numel()
        return sum(b.numel() for b in self._buffers) + gather

    def run(self, transport: Transport) -> SyncStats:
        """Send every bucket of this rank's streams through `transport` (collective within each stream's group)."""
        stats = SyncStats()
        with self.alloc._lock:  # this run's peak, not the largest of every run so far
            self.alloc.peak = self.alloc.current
        start = time.perf_counter()
        every_rank = transport.every_rank
        for stream, bucket in self._every_schedule if every_rank else self._schedule:
            buffer = self._bucket_buffer(bucket.nbytes, transport) if stream.leader == self.rank else None
            for chunk in self._chunks.get((stream.index, bucket.index), []):
                t0 = time.perf_counter()
                gathered = self._gather(stream, chunk)
                stats.gather_s += time.perf_counter() - t0
                if buffer is not None:
                    t0 = time.perf_counter()
                    self._pack_chunk(bucket, chunk, gathered, buffer)
                    stats.pack_s += time.perf_counter() - t0
            if buffer is None:
                if every_rank:  # its part of the bucket's collective send (not counted: the leader sends it)
                    t0 = time.perf_counter()
                    transport.send(stream, bucket, None)
                    stats.wait_s += time.perf_counter() - t0
                continue
            t0 = time.perf_counter()
            self._pack_local(bucket, buffer)
            stats.pack_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            transport.send(stream, bucket, buffer)  # returns once bucket k-1 has landed (see _bucket_buffer)
            stats.wait_s += time.perf_counter() - t0
            stats.buckets += 1
            stats.bytes_sent += bucket.nbytes
        t0 = time.perf_counter()
        transport.wait()
        stats.wait_s += time.perf_counter() - t0
        stats.seconds = time.perf_counter() - start
        stats.peak_extra_bytes = self.alloc.peak
        stats.resident_bytes = self.resident_bytes
        return stats

    def _bucket_buffer(self, nbytes: int, transport: Transport) -> torch.Tensor:
        """The next of the two bucket buffers, as `nbytes` of it.

        Ordering: bucket k goes into buffer k % 2, which last held bucket k - 2. The transport has at most one
        bucket in flight: `send(k - 1)` returned only after bucket k - 2's send completed, and a send completes only
        when every receiver has its bytes (the tensor transport's POST is answered after the engine copied the bucket
        out of the shared segment; a broadcast returns after the bytes left; the disk file is written). So packing
        bucket k never touches bytes a receiver still reads; across runs, `run` ends with `transport.wait()`."""
        if self._buffer_memory != transport.memory:
            self._buffers, self._buffer_memory = [], transport.memory  # another medium: drop before allocating
        if not self._buffers:
            size = max(b.nbytes for s in self._streams if s.leader == self.rank for b in self.plan.buckets_of(s.index))
            self._buffers = [self.alloc.track(transport.allocate(size)) for _ in range(2)]
        buffer = self._buffers[self._next_slot]
        self._next_slot ^= 1
        return buffer[:nbytes]

    # ------------------------------------------------------------------ gather
    def _gather(self, stream: Stream, chunk: _Chunk) -> torch.Tensor | None:
        """One chunk's shard bytes gathered to the leader: [group, chunk.row] (None on the other ranks on CPU)."""
        axis = "tp" if stream.ep_rank is None else "etp"
        group = self.groups.get(axis)
        if group is None:
            raise ValueError(f"sync stream {stream.name} gathers over {axis}, but rank {self.rank} has no {axis} group")
        g, me, leader = len(stream.group), stream.group.index(self.rank), stream.leader == self.rank
        if self._gather_buffer is None:  # one per rank: its streams run one after another
            self._gather_buffer = self.alloc.track(
                torch.empty(self.plan.largest_tensor_bytes, dtype=torch.uint8, device=self._device)
            )
        out = self._gather_buffer[: g * chunk.row].view(g, chunk.row)
        row = out[me] if leader or self._device.type == "cuda" else out[0]
        for i, offset in zip(chunk.sources, chunk.offsets):  # this rank's shards, side by side
            tensor = self._tensors[self.plan.sources[i].mcore][1].detach()
            row[offset : offset + _nbytes(tensor)].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        if self._device.type == "cuda":
            dist.all_gather_into_tensor(out.view(-1), row, group=group)  # in place: the input is our own row
            return out
        # CPU: one message per peer and chunk, not per tensor: gloo pays a rendezvous per message, and on a loaded
        # machine each costs scheduling delays on both sides
        if not leader:
            dist.send(row, dst=stream.leader, group=group)
            return None
        peers = [(k, peer) for k, peer in enumerate(stream.group) if peer != self.rank]
        requests = [dist.irecv(out[k], src=peer, group=group) for k, peer in peers]
        for request in requests:
            request.wait()
        return out

    # ------------------------------------------------------------------ pack
    def _pack_chunk(self, bucket: Bucket, chunk: _Chunk, gathered: torch.Tensor, buffer: torch.Tensor) -> None:
        """A gathered chunk into the bucket: one block copy, then the FP8-quantised tensors through their transform."""
        if chunk.table is not None and len(chunk.table):
            # every unquantised tensor of the chunk in one block copy (one launch on GPU)
            copy_blocks(gathered.reshape(-1), buffer, chunk.table)
        if not self.plan.fp8:
            return
        for i, offset in zip(chunk.sources, chunk.offsets):
            entries = [e for e in bucket.entries if e.source == i]
            if any(e.quant for e in entries):
                source = self.plan.sources[i]
                rule, tensor = self._tensors[source.mcore]
                n = source.shard_bytes
                shards = [
                    gathered[g, offset : offset + n].view(tensor.dtype).view(source.shard_shape)
                    for g in range(gathered.shape[0])
                ]
                self._write(buffer, entries, rule.transform.to_hf(shards), tensor.dtype)

    def _pack_local(self, bucket: Bucket, buffer: torch.Tensor) -> None:
        """The bucket's tensors that need no gather, through their transform's to_hf views."""
        by_source: dict[int, list[Any]] = {}
        for entry in bucket.entries:
            if self.plan.sources[entry.source].axis is None or (bucket.stream, bucket.index) not in self._chunks:
                by_source.setdefault(entry.source, []).append(entry)
        for i, entries in by_source.items():
            rule, tensor = self._tensors[self.plan.sources[i].mcore]
            self._write(buffer, entries, rule.transform.to_hf([tensor.detach()]), tensor.dtype)

    @torch.no_grad()
    def _write(self, buffer: torch.Tensor, entries: list[Any], values: list[torch.Tensor], dtype: torch.dtype) -> None:
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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
