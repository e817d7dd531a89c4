"""The `distributed` transport: each bucket is broadcast from its stream's leader to every engine rank.

```
leader (rank 0 of group "<stream name>")        engine ranks 1..N (joined with /init_weights_update_group)
  POST /update_weights_from_distributed  ---->  each engine: receive one flattened bucket (names, dtypes, shapes)
  broadcast(bucket)                      ====>  ... stage it; the POST answers once the bytes are in
```
The POSTs go out first and the broadcast follows (the engines join it from their request handlers), as in slime.
One group per stream, so pipeline stages and EP ranks stream to the engines in parallel. NCCL on GPU, gloo on CPU;
vLLM engines on GPU: one group for every stream, vLLM's own NCCL weight-transfer communicator, whose rank 0 is
rollout/vllm_nccl.py's NcclSender (the same `broadcast([bucket], options)` and completion polling).
"""

from __future__ import annotations

from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from mcore_rl.parallel.update_group import UpdateGroup
from mcore_rl.resharding.sync.plan import Bucket, Stream
from mcore_rl.resharding.sync.transports.base import (
    BackgroundSender,
    TransportError,
    UpdateReceiver,
    http_post,
)


class DistributedTransport:
    """See the module docstring. `groups` maps stream names to the leader's joined update groups."""

    every_rank = False  #: only stream leaders send (each in its stream's broadcast group)

    def __init__(
        self,
        groups: dict[str, UpdateGroup],
        engine_urls: list[str],
        *,
        api_key: str | None,
        weight_version: str,
        receiver: UpdateReceiver,
        timeout_s: float = 300.0,
        device: torch.device | str = "cpu",
    ) -> None:
        """`receiver`: the engine kind's (`EngineKind.receiver()`: the route and body announcing each bucket)."""
        self.groups = groups
        self.receiver = receiver
        self.engine_urls = list(engine_urls)
        self.api_key = api_key
        self.weight_version = weight_version
        self.timeout_s = timeout_s
        self.device = device
        self.memory = str(torch.device(device))  #: where allocate puts buffers (reused while this stays the same)
        self._http = ThreadPoolExecutor(max_workers=max(1, len(self.engine_urls)), thread_name_prefix="sync-http")
        self._sender = BackgroundSender(self._send)

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def send(self, stream: Stream, bucket: Bucket, buffer: torch.Tensor) -> None:
        self._sender.submit((stream, bucket, buffer))

    def _send(self, item: tuple[Stream, Bucket, torch.Tensor]) -> None:
        stream, bucket, buffer = item
        group = self.groups.get(stream.name)
        if group is None:
            raise TransportError(f"no update group {stream.name!r} on the leader: connect the engines first")
        route, body = self.receiver.distributed_update(stream.name, bucket.entries, self.weight_version)
        calls = [
            self._http.submit(http_post, url + route, body, self.api_key, self.timeout_s) for url in self.engine_urls
        ]
        abandoned = False
        try:
            abandoned = not _broadcast_unless_refused(group, buffer, calls)
        finally:
            errors = []
            for url, call in zip(self.engine_urls, calls):
                if abandoned and not call.done():
                    continue  # an engine inside the abandoned broadcast answers when its group times out
                try:
                    call.result()
                except TransportError as err:
                    errors.append(f"bucket {bucket.index} of {stream.name} -> {url}: {err}")
        if abandoned:
            errors.append(f"the broadcast of bucket {bucket.index} of {stream.name} was abandoned")
        if errors:
            raise TransportError("; ".join(errors))

    def wait(self) -> None:
        self._sender.wait()

    def close(self) -> None:
        self._sender.close()
        self._http.shutdown(wait=False)


def _broadcast_unless_refused(group: UpdateGroup, buffer: torch.Tensor, calls: list[Future]) -> bool:
    """Broadcast `buffer` from rank 0; False (the broadcast abandoned) as soon as an engine refuses the bucket before
    it ends. A refusing engine never joins the broadcast (SGLang answers at once without a session, and so does our
    server), so waiting for it would wedge this sender until the group's timeout. An abandoned group is out of step:
    the controller rebuilds the groups before the next push."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    work = group.group.broadcast([buffer], options)
    pause = 1e-4  # the answers are polled while the broadcast runs; at most 5 ms late once it ended
    while not work.is_completed():
        done, pending = futures.wait(calls, timeout=pause, return_when=futures.FIRST_EXCEPTION)
        if any(call.exception() is not None for call in done):
            return False
        if not pending:  # every engine has its bytes: the rest of the broadcast is the leader's own completion
            break
        pause = min(2 * pause, 0.005)
    work.wait()  # raises what the broadcast raised (a timeout)
    return True
