"""One global order of the distributed transport's broadcasts across stream leaders, so engines cannot deadlock.

```
leader of stream s, bucket k (global position p):
    wait until position p-1 is done (a key in a store every actor rank shares)
    POST /update_weights_from_distributed to every engine -> broadcast -> every engine answered
    mark position p done (or failed: the later ones fail at once instead of waiting)
```
Why: SGLang 0.5.23 serves update requests one at a time per engine (its scheduler takes one control request, and
`/update_weights_from_distributed` blocks in the broadcast until the leader sends). With two streams (pipeline stages,
EP ranks) each leader posting on its own, engine A can take stream 0's bucket first and wait in group 0 while engine
B takes stream 1's first and waits in group 1; each broadcast needs every engine, so neither ends (slime holds a lock
around each bucket for the same reason). Here every engine sees the same sequence of buckets, one at a time. The
leaders still gather and pack in parallel; only their transports take turns.

The order is the executor's schedule (resharding/sync/execute.py): bucket k of every stream at about k / its bucket
count, then by stream; every rank handles its own buckets in that order, so a leader waiting for its turn has already
done its part (gathers) of every earlier position, and the wait cannot close a cycle.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from mcore_rl.resharding.sync.plan import Bucket, Stream, SyncPlan
from mcore_rl.resharding.sync.transports.base import BackgroundSender, TransportError


def global_order(plan: SyncPlan) -> list[tuple[int, int]]:
    """Every (stream, bucket index) of `plan`, in the one order all leaders send them."""
    counts: dict[int, int] = {}
    for b in plan.buckets:
        counts[b.stream] = counts.get(b.stream, 0) + 1
    return [(s, i) for _, s, i in sorted((b.index / counts[b.stream], b.stream, b.index) for b in plan.buckets)]


class InGlobalOrder:
    """A transport wrapper (allocate / send / wait / close) that sends its buckets in their turn of `order`.

    `streams` are the streams this rank leads; `store` is shared by every leader of the sync (the actor ranks'
    default store; a `HashStore` in one process), `prefix` names this sync in it (every rank the same), `timeout_s`
    bounds one bucket's send: a wait for a turn allows it for each position in between."""

    def __init__(
        self,
        inner: Any,
        order: list[tuple[int, int]],
        streams: set[int],
        store: Any,
        prefix: str,
        timeout_s: float = 300.0,
    ) -> None:
        self.inner, self.store, self.prefix, self.timeout_s = inner, store, prefix, timeout_s
        self.position = {item: p for p, item in enumerate(order)}
        self.memory, self.every_rank = inner.memory, inner.every_rank  # the inner transport's (base.Transport)
        self._mine = [p for (stream, _), p in self.position.items() if stream in streams]
        self._marked: set[int] = set()
        self._last = -1
        self._sender = BackgroundSender(self._send)

    def allocate(self, nbytes: int) -> torch.Tensor:
        return self.inner.allocate(nbytes)

    def send(self, stream: Stream, bucket: Bucket, buffer: torch.Tensor) -> None:
        p = self.position[(stream.index, bucket.index)]
        self._sender.submit((p, stream, bucket, buffer))

    def _key(self, p: int) -> str:
        return f"{self.prefix}/{p}"

    def _send(self, item: tuple[int, Stream, Bucket, torch.Tensor]) -> None:
        p, stream, bucket, buffer = item
        try:
            if p > 0:
                waited = datetime.timedelta(seconds=self.timeout_s * max(1, p - self._last))
                try:
                    self.store.wait([self._key(p - 1)], waited)
                except RuntimeError as err:  # torch: "Wait timeout" (DistStoreError)
                    raise TransportError(
                        f"bucket {bucket.index} of {stream.name} waited {waited.total_seconds():g} s for its turn "
                        f"(position {p} of the global order; position {p - 1} never finished): {err}"
                    ) from err
                before = self.store.get(self._key(p - 1))
                if before != b"ok":
                    raise TransportError(
                        f"bucket {bucket.index} of {stream.name} not sent: an earlier bucket failed ({before.decode()})"
                    )
            self.inner.send(stream, bucket, buffer)
            self.inner.wait()
        except BaseException as err:
            self._mark(p, f"failed at bucket {bucket.index} of {stream.name}: {err}"[:500])
            raise
        self._mark(p, "ok")
        self._last = p

    def _mark(self, p: int, value: str) -> None:
        self._marked.add(p)
        self.store.set(self._key(p), value)

    def wait(self) -> None:
        self._sender.wait()

    def close(self) -> None:
        """Stop; the positions this leader never sent are marked failed, so no other leader waits for them."""
        self._sender.close()
        for p in self._mine:
            if p not in self._marked:
                self._mark(p, "failed: its leader stopped before sending it")
        self.inner.close()
