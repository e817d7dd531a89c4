"""The `tensor` transport: the bucket goes to engines on this node as one `/update_weights_from_tensor` payload per
engine TP rank.

The payload is SGLang's flattened bucket, in the format resharding/sync/wire.py writes and our receiver reads
(`{"flattened_tensor": uint8 buffer, "metadata": [records]}`, pickled with `ForkingPickler`, base64); SGLang's TP
rank r opens element r of `serialized_named_tensors` with its `MultiprocessingSerializer` (after
`monkey_patch_torch_reductions`).

CPU: the buffer is allocated in shared memory (torch's `file_system` strategy: the default `file_descriptor` one
cannot cross between unrelated processes), so the engine maps the same pages and nothing is copied on the way. Each
pickle of a segment hands over one reference (torch's `reduce_storage` increments the segment's count, and the
`rebuild_storage_filename` that opens it decrements once), so every opener gets a pickle of its own: one payload
opened by two engine ranks let the segment's count reach 0 while the sender still held it, and the next bucket packed
into that buffer failed to open ("unable to open shared memory object"). Pickles are cheap (the metadata and a name).

GPU (CUDA IPC), as SGLang 0.5.23 expects it:
- one payload per engine rank, each its own copy of the bucket on the GPU that rank can see (`rank_devices`, the GPU
  colocated with it): a CUDA IPC handle is counted once per share, and SGLang's `deserialize_own_rank` opens only
  its own element, so ranks sharing one payload would release it once each;
- the device index is written as the GPU's UUID, as SGLang's `monkey_patch_torch_reductions` does on its senders
  (`_reduce_tensor_modified`): processes number GPUs by their own CUDA_VISIBLE_DEVICES, a UUID names one GPU
  everywhere, and SGLang's patched `rebuild_cuda_tensor` maps it back to its own index;
- the engine never sees the executor's reused buffer. SGLang answers `/update_weights_from_tensor` after a CPU
  barrier of its ranks, while its copies out of the IPC memory may still be queued on its stream, so repacking that
  buffer (the executor reuses two) could change bytes it has not read yet. Each send therefore shares a fresh copy
  and drops it after the POST: torch keeps a shared block out of reuse until every receiver has released it, and a
  receiver synchronises its stream before releasing (torch's CUDA IPC reference counting). Cost: one device copy per
  engine rank and bucket, and up to that many bucket copies in flight per GPU.

Colocated engines spanning GPUs (`colocation` given: engine i's TP rank r shares a GPU with actor rank
`colocation[i][r]`, from the placement's bundle order), slime's design: rank r's payload must be made on r's own GPU,
and only the actor rank on that GPU can make it. So every actor rank takes part in every bucket (the executor calls
`send` on all of them in one global order; `every_rank`): the stream leader broadcasts the packed bucket over the
actor's process group (NCCL between distinct GPUs, gloo on CPU), each mapped rank shares its own copy (CUDA IPC with
the UUID; shared memory on CPU), `gather_object` brings the payloads to the leader, which posts each engine one
`/update_weights_from_tensor` whose element r came from the rank on r's GPU, and broadcasts the outcome: every rank
raises if an engine refused, and drops its copy only after every engine answered. That last collective makes a
bucket synchronous (the next bucket is packed after this one's POSTs, not during them).

The routes and bodies are the receiver's (`UpdateReceiver`, given by the engine kind: SGLang's API for every kind
but vLLM). A
receiver with `gpu_handles` (vLLM engines colocated on CUDA, started with vLLM's own `ipc` weight-transfer backend:
rollout/engines/receivers.py) gets the same collective per bucket with its own wire format: each mapped rank shares
its own copy through the receiver (`share`: reduce_tensor args keyed by its GPU's UUID), the leader posts an engine's
handles together in one request (`tensor_update`), after the receiver's `tensor_init` once per engine and push. vLLM's
worker answers after its copies out of the IPC memory are done
(`torch.accelerator.synchronize()` after each update) and keeps the mapping open until the next bucket arrives or
the update finishes; the shared copies are dropped as for SGLang and torch frees them once released
(`ipc_collect` at `close`).

Segments are reused on CPU: the executor (resharding/sync/execute.py) packs every bucket of every sync into one of
two buffers this transport allocated once. That is safe because (1) an engine answers the POST only after it has
copied the bucket out of the segment (a copy from host memory has read its source when it returns), (2) `send`
submits to a one-deep BackgroundSender, which waits for the previous bucket's POSTs to be answered, so when bucket k
is packed into the segment of bucket k - 2, every engine has answered for k - 2 already.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.resharding.sync.plan import Bucket, Stream
from mcore_rl.resharding.sync.transports.base import (
    BackgroundSender,
    TransportError,
    UpdateReceiver,
    http_post,
)
from mcore_rl.resharding.sync.wire import encode, encode_cuda, encode_payload, flatten, record

__all__ = ["TensorTransport", "encode", "encode_cuda", "encode_payload", "flatten"]  # the wire's, for senders


class TensorTransport:
    """See the module docstring. Each engine gets `ranks_per_engine` payloads (SGLang's TP rank r reads element r;
    every rank gets the whole bucket, as SGLang's loaders shard it themselves). On GPU `rank_devices[r]` is where
    rank r's copy is made (default: this transport's device for every rank)."""

    def __init__(
        self,
        engine_urls: list[str],
        *,
        api_key: str | None,
        weight_version: str,
        receiver: UpdateReceiver,
        ranks_per_engine: int = 1,
        timeout_s: float = 300.0,
        device: torch.device | str = "cpu",
        rank_devices: list[torch.device | str] | None = None,
        colocation: list[list[int]] | None = None,
        rank: int = 0,
        group: Any = None,
    ) -> None:
        """`colocation[i][r]`: the actor rank on the GPU of engine `engine_urls[i]`'s TP rank r (see the module
        docstring); `rank` is this actor rank, `group` the actor's process group (None: the default one);
        `receiver`: the engine kind's routes and bodies (`EngineKind.receiver()`); one with `gpu_handles` (vLLM's
        ipc update_info) needs `colocation`."""
        self.receiver = receiver
        self.handles = self.receiver.gpu_handles  #: one shared handle per engine GPU instead of pickled payloads
        if self.handles and colocation is None:
            raise ValueError(
                "rollout.engine=vllm with sync.transport=tensor: vLLM's ipc backend takes one handle per engine GPU, "
                "made by the actor rank on that GPU, so the colocation map (trainer.placement=colocated on CUDA) "
                "is needed"
            )
        self._ready: set[str] = set()  # engines given the receiver's tensor_init in this push
        self.engine_urls = list(engine_urls)
        self.api_key = api_key
        self.weight_version = weight_version
        self.ranks_per_engine = ranks_per_engine
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.rank_devices = (
            [torch.device(d) for d in rank_devices] if rank_devices else [self.device] * ranks_per_engine
        )
        if len(self.rank_devices) != ranks_per_engine:
            raise ValueError(f"rank_devices names {len(self.rank_devices)} devices for {ranks_per_engine} engine ranks")
        #: where allocate puts buffers: the executor reuses them while this stays the same, so one pair of shared
        #: segments serves every bucket of every sync (a fresh segment per bucket faulted in 64 MB of pages each time)
        self.memory = "cpu-shared" if self.device.type == "cpu" else str(self.device)
        self.colocation = [list(ranks) for ranks in colocation] if colocation is not None else None
        if self.colocation is not None:
            if len(self.colocation) != len(self.engine_urls):
                raise ValueError(f"colocation names {len(self.colocation)} engines for {len(self.engine_urls)} URLs")
            for url, ranks in zip(self.engine_urls, self.colocation):
                if len(ranks) != ranks_per_engine:
                    raise ValueError(f"colocation of {url} names {len(ranks)} actor ranks for {ranks_per_engine}")
            world = dist.get_world_size(group) if dist.is_initialized() else 1
            outside = sorted({a for ranks in self.colocation for a in ranks if not 0 <= a < world})
            if outside:
                raise ValueError(f"colocation names actor ranks {outside}, outside the actor's {world} ranks")
        #: the executor calls `send` on every actor rank for every bucket (None buffer where it does not lead)
        self.every_rank = self.colocation is not None
        self.rank, self.group = rank, group
        self._slots = [
            (i, r) for i, ranks in enumerate(self.colocation or []) for r, a in enumerate(ranks) if a == rank
        ]  # fmt: skip
        self._receive: torch.Tensor | None = None  # CPU: the shared segment broadcasts land in (synchronous: reused)
        self._http = ThreadPoolExecutor(max_workers=max(1, len(self.engine_urls)), thread_name_prefix="sync-http")
        self._sender = BackgroundSender(self._send)

    def allocate(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buffer.share_memory_() if self.device.type == "cpu" else buffer

    def send(self, stream: Stream, bucket: Bucket, buffer: torch.Tensor | None) -> None:
        if self.colocation is not None:
            self._send_colocated(stream, bucket, buffer)
            return
        self._sender.submit((stream, bucket, buffer))

    def _send_colocated(self, stream: Stream, bucket: Bucket, buffer: torch.Tensor | None) -> None:
        """One bucket, collective over the actor's group (module docstring): broadcast, share, gather, post."""
        leader = stream.leader == self.rank
        if leader:
            if buffer is None:
                raise ValueError(f"stream {stream.name}'s leader (rank {self.rank}) sends without a bucket buffer")
            data = buffer
        elif self.device.type == "cpu":
            if self._receive is None or self._receive.numel() < bucket.nbytes:
                self._receive = torch.empty(bucket.nbytes, dtype=torch.uint8).share_memory_()
            data = self._receive[: bucket.nbytes]
        else:  # fresh per bucket: it is what the engine ranks open (see the module docstring on reuse)
            data = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=stream.leader, group=self.group)
        metadata = [record(e.name, e.shape, getattr(torch, e.dtype), e.offset, e.nbytes) for e in bucket.entries]
        mine: dict[tuple[int, int], Any] = {}
        if self.handles:  # a copy per engine GPU, never a reused buffer, shared as the engine's handle (docstring)
            fresh = not leader and self.device.type != "cpu"  # a non-leader's CUDA receive buffer is new per bucket
            mine = {slot: data if fresh and n == 0 else data.clone() for n, slot in enumerate(self._slots)}
            sent: dict[tuple[int, int], Any] = {slot: self.receiver.share(copy) for slot, copy in mine.items()}
        elif self._slots and self.device.type == "cpu":  # one pickle per opener (module docstring)
            mine = {slot: encode({"flattened_tensor": data, "metadata": metadata}) for slot in self._slots}
        elif self._slots:  # one copy per engine rank: a CUDA IPC share is counted once (module docstring)
            copies = [data.clone() if leader or i else data for i in range(len(self._slots))]
            mine = {
                slot: encode_cuda({"flattened_tensor": c, "metadata": metadata}) for slot, c in zip(self._slots, copies)
            }
        if not self.handles:
            # plain str over the wire (the payloads stay alive in `mine` on this rank until the outcome is known)
            sent = {slot: str(p) for slot, p in mine.items()}
        everyone: list[Any] | None = [None] * dist.get_world_size(self.group) if leader else None
        dist.gather_object(sent, everyone, dst=stream.leader, group=self.group)
        outcome: list[Any] = [None]
        if leader:
            try:
                self._post_colocated(stream, bucket, everyone or [])
            except Exception as err:  # noqa: BLE001 (every rank raises it below)
                outcome = [f"{type(err).__name__}: {err}"]
        dist.broadcast_object_list(outcome, src=stream.leader, group=self.group)
        del mine, data
        if outcome[0] is not None:
            raise TransportError(f"bucket {bucket.index} of stream {stream.name}: {outcome[0]}")

    def _post_colocated(self, stream: Stream, bucket: Bucket, gathered: list[dict[tuple[int, int], Any]]) -> None:
        by_slot = {slot: payload for part in gathered for slot, payload in (part or {}).items()}
        bodies = []
        for i, url in enumerate(self.engine_urls):
            missing = [r for r in range(self.ranks_per_engine) if (i, r) not in by_slot]
            if missing:
                raise TransportError(
                    f"no payload for engine {url} TP rank(s) {missing} (colocation {self.colocation[i]})"
                )
            payloads = [by_slot[(i, r)] for r in range(self.ranks_per_engine)]
            bodies.append((url, self.receiver.tensor_update(url, bucket, payloads, self.weight_version)))
        self._init([url for url, _ in bodies])
        calls = [
            self._http.submit(http_post, url + route, body, self.api_key, self.timeout_s)
            for url, (route, body) in bodies
        ]
        for call in calls:
            call.result()

    def _init(self, urls: list[str]) -> None:
        """The receiver's tensor_init (if it has one) on engines not given it yet in this push (also replaced
        engines, which start without it)."""
        init = self.receiver.tensor_init()
        todo = [url for url in urls if url not in self._ready]
        if init is not None:
            route, body = init
            calls = [
                self._http.submit(http_post, url + route, body, self.api_key, self.timeout_s) for url in todo
            ]  # fmt: skip
            for call in calls:
                call.result()
        self._ready.update(todo)

    def _send(self, item: tuple[Stream, Bucket, torch.Tensor]) -> None:
        stream, bucket, buffer = item
        metadata = [record(e.name, e.shape, getattr(torch, e.dtype), e.offset, e.nbytes) for e in bucket.entries]
        if buffer.device.type == "cpu":
            sources = [buffer] * self.ranks_per_engine
            share = encode
        else:  # one fresh copy per engine rank, never the executor's reused buffer (see the module docstring)
            sources = [buffer.to(device, copy=True) for device in self.rank_devices]
            share = encode_cuda
        # one pickle per opener: each share hands over one reference (module docstring), so every engine's rank
        # gets its own payload even where they all map the same memory
        bodies = [
            self.receiver.tensor_update(
                url,
                bucket,
                [share({"flattened_tensor": s, "metadata": metadata}) for s in sources],
                self.weight_version,
            )
            for url in self.engine_urls
        ]
        self._init(self.engine_urls)
        calls = [
            self._http.submit(http_post, url + route, body, self.api_key, self.timeout_s)
            for url, (route, body) in zip(self.engine_urls, bodies)
        ]
        for call in calls:
            call.result()

    def wait(self) -> None:
        self._sender.wait()

    def close(self) -> None:
        self._sender.close()
        self._http.shutdown(wait=False)
        if self.handles and self.device.type == "cuda":
            torch.cuda.ipc_collect()  # free the shared copies the engines have released (torch keeps them until asked)
