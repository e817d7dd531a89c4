"""What the engine pool tracks about each engine between calls: whether a failed /health probe means it is dead, and
which memory it has released.

```
EngineHealth     probes /health only while nothing holds it quiet (a weight push: pause -> update -> continue;
                 released memory: the release waits for a probe already running); an engine is dead after
                 `failures` failed probes in a row, or at once when nothing listens on its port any more (connection
                 refused: the process is gone)
ReleasedMemory   /release_memory_occupation and /resume_memory_occupation per engine; resumes only what that
                 engine released
```
Why (SGLang 0.5.23): `/health` generates one token, answers after at least a second, and does not answer while the
engine is paused (it waits on the scheduler), so a probe during a weight push times out and a short timeout kills a
healthy engine mid-push; after `/release_memory_occupation` the probe's forward would run on released weights. slime
pauses its health monitor for both, as this does. `resume_memory_occupation` of a tag the engine never released
raises KeyError in SGLang's scheduler (`offload_tags.remove`), and the engine dies.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

#: SGLang's memory tags (`srt/constants.py` GPU_MEMORY_ALL_TYPES); a colocated engine releases all three while the
#: actor trains (the CUDA graphs' memory too, as slime does)
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

#: a probe's result when the HTTP session was closed under it (shutdown): neither alive nor dead
SHUTDOWN = "shutdown"


class EngineHealth:
    """See the module docstring. `client` is the pool's RolloutClient (its `arequest`)."""

    def __init__(self, client: Any, timeout_s: float, failures: int) -> None:
        self.client, self.timeout_s, self.failures = client, timeout_s, failures
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the last running round of probes ends
        self._running = 0  # rounds of probes running now (`dead`)
        self._holds: dict[str, int] = {}
        self._epoch = 0  # bumped by every hold: a probe that overlapped one does not count
        self._failed: dict[str, int] = {}
        self.probes = 0  #: probes sent (tests and logs)

    def hold(self, reason: str) -> None:
        """No probes until `release(reason)` (holds nest and count)."""
        with self._lock:
            self._holds[reason] = self._holds.get(reason, 0) + 1
            self._epoch += 1

    def release(self, reason: str) -> None:
        with self._lock:
            left = self._holds.get(reason, 0) - 1
            if left > 0:
                self._holds[reason] = left
            else:
                self._holds.pop(reason, None)

    @contextmanager
    def quiet(self, reason: str) -> Iterator[None]:
        """No probes inside the block (a weight push)."""
        self.hold(reason)
        try:
            yield
        finally:
            self.release(reason)

    def wait_idle(self) -> None:
        """Block until no probe runs (call it holding probes off, so none starts after). Each probe ends within
        `timeout_s`. A probe is a one-token generate on SGLang: what must not run while memory is released."""
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0, timeout=self.timeout_s + 5.0)

    def holds(self) -> list[str]:
        """Why probes are off now (empty: they run)."""
        with self._lock:
            return sorted(self._holds)

    async def dead(self, urls: Iterable[str]) -> list[str]:
        """Probe `urls` (unless held quiet); the ones now judged dead."""
        urls = list(urls)
        with self._lock:
            if self._holds or not urls:
                return []
            epoch = self._epoch
            self._running += 1
        try:
            results = await asyncio.gather(*(self._probe(url) for url in urls))
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()
        dead = []
        with self._lock:
            if self._epoch != epoch:  # a push or a release began while the probes ran: they prove nothing
                return []
            for url, result in zip(urls, results):
                if result == SHUTDOWN:  # the pool is closing its session: no verdict on the engine
                    continue
                if result == "ok":
                    self._failed.pop(url, None)
                    continue
                self._failed[url] = self._failed.get(url, 0) + 1
                if result == "refused" or self._failed[url] >= self.failures:
                    self._failed.pop(url, None)
                    dead.append(url)
                else:
                    log.warning("rollout engine %s failed a /health probe (%s, %d in a row)", url, result,
                                self._failed[url])  # fmt: skip
        return dead

    async def _probe(self, url: str) -> str:
        """ok | refused (nothing listens: the process is gone) | SHUTDOWN (the client's session was closed under the
        probe: the pool is stopping, e.g. on Ctrl-C) | the failure."""
        self.probes += 1
        try:
            status, _ = await self.client.arequest("GET", url, "/health", None, self.timeout_s)
        except aiohttp.ClientConnectorError as err:
            refused = isinstance(err.os_error, ConnectionRefusedError)
            return "refused" if refused else f"unreachable: {err}"
        except asyncio.TimeoutError:
            return f"no answer within {self.timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as err:
            return f"{type(err).__name__}: {err}"
        except RuntimeError as err:
            # aiohttp raises a bare RuntimeError('Session is closed') when the session closes under a probe; uncaught,
            # it escapes the probes' gather ("_GatheringFuture exception was never retrieved" on Ctrl-C)
            if "closed" in str(err).lower():
                return SHUTDOWN
            raise
        return "ok" if status == 200 else f"HTTP {status}"


class ReleasedMemory:
    """Which memory tags each engine has released (see the module docstring); holds `health` quiet meanwhile."""

    def __init__(self, client: Any, health: EngineHealth) -> None:
        self.client, self.health = client, health
        self._released: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def released(self, url: str) -> set[str]:
        with self._lock:
            return set(self._released.get(url, ()))

    def release(self, urls: Iterable[str], tags: Iterable[str] = MEMORY_TAGS) -> None:
        """/release_memory_occupation of `tags` on every engine in `urls`, once no /health probe runs: SGLang
        asserts its scheduler is idle there (`is_fully_idle`), a probe is a one-token generate, and the failed
        assertion in a scheduler handler kills the server."""
        tags = list(tags)
        for url in urls:
            with self._lock:
                first = not any(self._released.values())
                if first:
                    self.health.hold("released memory")
            self.health.wait_idle()  # a probe that started before the hold may still be generating
            try:
                self.client.post(url, "/release_memory_occupation", {"tags": tags})
            except Exception:
                if first:
                    self.health.release("released memory")
                raise
            with self._lock:
                self._released.setdefault(url, set()).update(tags)

    def resume(self, urls: Iterable[str], tags: Iterable[str]) -> None:
        """/resume_memory_occupation of those of `tags` each engine has released (none: no call)."""
        for url in urls:
            with self._lock:
                todo = [t for t in tags if t in self._released.get(url, ())]
            if not todo:
                continue
            self.client.post(url, "/resume_memory_occupation", {"tags": todo})
            with self._lock:
                self._released[url].difference_update(todo)
                if not self._released[url]:
                    del self._released[url]
                if not self._released:
                    self.health.release("released memory")

    def forget(self, url: str) -> None:
        """An engine that was replaced: the new one released nothing."""
        with self._lock:
            had = self._released.pop(url, None)
            if had and not self._released:
                self.health.release("released memory")
