"""What the transports share: the `Transport` interface the executor drives, the `UpdateReceiver` interface of the
engine side (the routes and bodies a transport posts, which the engine kind provides), a one-deep background sender
(double buffering) and a JSON POST."""

from __future__ import annotations

import json
import queue
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from mcore_rl.resharding.sync.plan import Bucket, Stream


class Transport(Protocol):
    """Where packed buckets go (execute.py's SyncExecutor drives it; distributed.py, tensor.py, disk.py and
    inprocess.py implement it). At most one bucket is in flight: `send` returns once the previous bucket's send has
    completed (the receiver has its bytes) and may return before this one's has; its buffer stays untouched until the
    next `send` or `wait()` returns."""

    #: where `allocate` puts buffers ("cpu", "cpu-shared", "cuda:0"): the executor reuses them while it stays the same
    memory: str
    #: True when `send` is collective over the actor's ranks: called on every rank for every bucket of the plan in
    #: one global order, with None as the buffer where the rank does not lead the stream (the colocated tensor
    #: transport); False when only stream leaders send
    every_rank: bool

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A bucket buffer of `nbytes` in this transport's memory (shared memory, pinned, device)."""
        ...

    def send(self, stream: Stream, bucket: Bucket, buffer: torch.Tensor) -> None:
        """Deliver `bucket` of `stream` (its bytes in `buffer`, HF layout at the planned offsets)."""
        ...

    def wait(self) -> None:
        """Return once every bucket sent so far has been delivered (raises the first failure)."""
        ...

    def close(self) -> None:
        """Stop the background sender and free what the transport holds (after `wait`, or on an error)."""
        ...


class UpdateReceiver(Protocol):
    """The engine's side of a push as a transport sees it: what to POST around the bytes it moves. The engine kind
    provides it (`EngineKind.receiver()`; SGLangReceiver and VLLMReceiver in rollout/engines/receivers.py) and the
    caller passes it to every transport that posts: resharding knows no engine and imports no rollout code."""

    #: the colocated tensor transport shares one copy per engine GPU as a handle (`share`) and posts an engine's
    #: handles in one request; False: one pickled payload per engine rank (resharding/sync/wire.py `encode`)
    gpu_handles: bool

    def distributed_update(
        self, group_name: str, entries: Sequence[Any], weight_version: str
    ) -> tuple[str, dict[str, Any]]:
        """(route, body) announcing one bucket (its entries' name, dtype, shape) before its broadcast in
        `group_name`."""
        ...

    def tensor_init(self) -> tuple[str, dict[str, Any]] | None:
        """(route, body) posted to an engine once per push before its first tensor bucket, or None."""
        ...

    def share(self, tensor: torch.Tensor) -> Any:
        """`tensor` (a copy on an engine GPU) shared as the engine's handle (`gpu_handles` only)."""
        ...

    def tensor_update(
        self, url: str, bucket: Any, payloads: list[Any], weight_version: str
    ) -> tuple[str, dict[str, Any]]:
        """(route, body) handing engine `url` one bucket as `payloads`, one per engine rank in rank order."""
        ...


class TransportError(RuntimeError):
    """A bucket could not be delivered; the message names the engine, the bucket and the reason."""


def http_post(url: str, body: dict[str, Any], api_key: str | None, timeout_s: float) -> dict[str, Any]:
    """POST JSON to an engine and return its JSON answer; TransportError unless it says success."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            message = json.loads(raw).get("message", raw.decode(errors="replace"))
        except (ValueError, AttributeError):
            message = raw.decode(errors="replace")
        raise TransportError(f"{url} answered {err.code}: {message}") from None
    except OSError as err:
        raise TransportError(f"{url} did not answer: {err}") from err
    answer = json.loads(raw) if raw.strip() else {}
    if isinstance(answer, dict) and answer.get("success") is False:
        raise TransportError(f"{url} refused: {answer.get('message')}")
    return answer


class BackgroundSender:
    """Runs `send_fn(item)` on one worker thread with at most one item in flight: `submit` waits for the previous
    item to finish, so the caller builds bucket k+1 while bucket k is sent and never holds more than two."""

    def __init__(self, send_fn: Callable[[Any], None]) -> None:
        self._send_fn = send_fn
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="sync-sender", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if self._error is None:
                    self._send_fn(item)
            except BaseException as err:  # noqa: BLE001 (re-raised by wait/submit on the caller's thread)
                self._error = err
            finally:
                del item  # the bucket's buffer must not outlive its send (the memory bound counts it)
                self._idle.set()

    def submit(self, item: Any) -> None:
        self.wait()
        self._idle.clear()
        self._queue.put(item)

    def wait(self) -> None:
        self._idle.wait()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


def allocate_plain(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)
