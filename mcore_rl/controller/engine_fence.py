"""The control calls around a weight push, on each engine, by SGLang 0.5.23's session rules
(`scheduler_components/weight_updater.py`): what controller/weight_sync.py sends before and after the buckets.

```
pause     /pause_generation {mode}                   (sync.pause_mode; not with the embedded server's "none"), to every
                                                     engine at once: SGLang's abort mode loops abort_all with 1 s
                                                     sleeps until its running requests are gone
begin     /begin_weight_update                       refused while a session is open ("already open"): a session
                                                     left by a failed push or a dead controller is closed and begun
                                                     again; an engine that does not answer is handed to the pool to
                                                     be replaced, and the push goes on without it. An engine that
                                                     refuses pause or begin (4xx/5xx) fails the push (FenceError):
                                                     the engines paused so far are continued, sessions begun closed
  ... the actor ranks send the buckets (or /update_weights_from_disk with load_format) ...
commit    /end_weight_update -> /flush_cache         the radix cache holds KV of the old weights (the chat template's
                                                     prefix is in every prompt); SGLang flushes only with no request
                                                     running, so generation is still paused here (pause mode
                                                     none, the embedded server's: no prefix cache, no flush)
close     /abort_weight_update (our server: the staged tensors are dropped, old weights kept; a session it took in
          place, while paused, answers weights_intact false), or where the engine has no such route (SGLang)
          /end_weight_update: the session closes with what it loaded; the engine is held
continue  /continue_generation, except on held engines (colocated: after the engines resumed their KV cache,
          `continue_after`)
```
Held engines: SGLang loads every bucket into the live weights as it arrives and labels the engine with the push's
version after the FIRST one (weight_updater.py:219-226 distributed, 250-258 tensor, 150-153 disk:
`record_weight_version_after_update` after each successful call), and 0.5.23 has no abort. An engine whose session a
failed push closed with /end_weight_update therefore holds a mix of old and new weights already labelled with the new
version. It stays paused (its requests wait, as SGLang holds requests while paused: tokenizer_manager.py:938-939)
until a complete push to it commits; with pause mode none, which cannot hold it, it is replaced. Our server is held
too when its abort answers weights_intact false: paused, it loads in place as SGLang does (rollout/weight_receiver.py).
So no sample comes from half-updated weights, and every token carries the version that produced it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp

from mcore_rl.rollout.client import RolloutRequestError

log = logging.getLogger(__name__)

#: seconds a control call (pause, begin, end, flush, continue) may take; an engine that does not answer /pause or
#: /begin within it is dead or hung (SIGSTOPped), and is replaced rather than waited on for sync.timeout_s
CONTROL_TIMEOUT_S = 60.0

#: what a dead or hung engine answers a control call with (aiohttp: refused, reset, disconnected, timed out)
UNREACHABLE = (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError)


class FenceError(RuntimeError):
    """No engine could take part in a push, or one refused its pause or begin."""


class EngineFence:
    """See the module docstring. `replace(url, why)` hands a dead engine to the pool (EnginePool.replace)."""

    def __init__(
        self,
        client: Any,
        pause_mode: str,
        replace: Callable[[str, str], Any],
        control_timeout_s: float = CONTROL_TIMEOUT_S,
        update_timeout_s: float = 300.0,
    ) -> None:
        self.client, self.pause_mode, self.replace = client, pause_mode, replace
        self.control_timeout_s, self.update_timeout_s = control_timeout_s, update_timeout_s
        #: engines holding half-updated weights (a failed push closed their session with /end_weight_update): kept
        #: paused until a push to them commits (module docstring)
        self.held: set[str] = set()
        self._deferred: list[str] | None = None  # engines to continue at the end of `continue_after`

    @contextmanager
    def continue_after(self) -> Iterator[None]:
        """The pushes inside the block leave their engines paused; they continue when the block ends (if it ends
        without an error). The colocated hand-over to generation: the engines take their KV cache and CUDA graphs
        back after the push, and SGLang must not run a batch before (placement.ColocatedPlacement.sync_weights)."""
        self._deferred = []
        try:
            yield
            deferred = list(dict.fromkeys(self._deferred))
        finally:
            self._deferred = None
        self.resume(deferred)

    def open(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """Pause and begin on every engine of `urls`: (the engines in the push, the engines paused). Engines that
        do not answer are replaced and left out; FenceError if none is left, or if one refuses its pause or begin
        (then the engines paused here are continued and the sessions begun closed first, so nothing stays paused)."""
        paused: list[str] = []
        live: list[str] = []
        failed: list[tuple[str, BaseException]] = []
        if self.pause_mode != "none":
            # all at once: SGLang's abort-mode pause returns only once its running requests are gone (abort_all,
            # then 1 s sleeps), so one engine after another cost a second or more each
            answers = self.client.run(self._each(urls, "/pause_generation", {"mode": self.pause_mode}))
            paused = [url for url, answer in zip(urls, answers) if answer is None]
            failed += [(url, answer) for url, answer in zip(urls, answers) if answer is not None]
        if not any(not isinstance(err, UNREACHABLE) for _, err in failed):
            ready = paused if self.pause_mode != "none" else list(urls)
            answers = self.client.run(self._each(ready, "/begin_weight_update", None))
            live = [url for url, answer in zip(ready, answers) if answer is None]
            failed += [(url, answer) for url, answer in zip(ready, answers) if answer is not None]
        refused = [(url, err) for url, err in failed if not isinstance(err, UNREACHABLE)]
        for url, err in failed:
            if isinstance(err, UNREACHABLE):
                self.held.discard(url)
                self.replace(url, f"no answer to the weight push's control calls: {type(err).__name__}: {err}")
        if refused:
            self.close(live, loaded=False)  # no bucket was sent: nothing to hold
            self.resume(paused)
            url, err = refused[0]
            raise FenceError(f"engine {url} refused the weight push's control calls: {err}")
        if not live:
            self.resume(paused)
            raise FenceError(f"no engine of {urls} answered /begin_weight_update (each is being replaced)")
        return live, paused

    async def _each(self, urls: list[str], route: str, body: Any) -> list[BaseException | None]:
        """`route` on every engine of `urls` at once (a begin through `_abegin`): None for each that answered 2xx,
        else its error."""

        async def one(url: str) -> None:
            if route == "/begin_weight_update":
                await self._abegin(url)
            else:
                await self.client.apost(url, route, body, self.control_timeout_s)

        answers = await asyncio.gather(*(one(url) for url in urls), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, Exception):
                raise answer  # KeyboardInterrupt, cancellation: not an engine's answer
        return list(answers)

    async def _abegin(self, url: str) -> None:
        try:
            await self.client.apost(url, "/begin_weight_update", None, self.control_timeout_s)
        except RolloutRequestError as err:
            if "already open" not in str(err):
                raise
            log.warning("engine %s had a weight-update session open (a push that failed): closing it", url)
            await asyncio.to_thread(self.close, [url], False)  # this push loads it next
            await self.client.apost(url, "/begin_weight_update", None, self.control_timeout_s)

    def update_from_disk(self, urls: list[str], directory: str, version: int) -> None:
        """/update_weights_from_disk inside the session. load_format: the engines started with load_format=dummy,
        which SGLang's disk loader refuses (it takes only its DefaultModelLoader's formats)."""
        body = {"model_path": directory, "load_format": "auto", "weight_version": str(version), "flush_cache": False}
        for url in urls:
            self.client.post(url, "/update_weights_from_disk", body, self.update_timeout_s)

    def commit(self, urls: list[str]) -> None:
        """/end_weight_update, then /flush_cache, on every engine of `urls`; then they hold a complete push, so
        none of them is held any more. Not flushed with pause mode "none", which only the embedded server takes: it
        keeps no prefix cache between requests, and refuses a flush while requests run (as SGLang does), which they
        do there during a push."""
        for url in urls:
            self.client.post(url, "/end_weight_update", None, self.update_timeout_s)
        if self.pause_mode != "none":
            for url in urls:
                self.client.post(url, "/flush_cache", None, self.control_timeout_s)
        self.held.difference_update(urls)

    def close(self, urls: list[str], loaded: bool = True) -> list[str]:
        """Close the session of every engine of `urls` (a failed push; see the module docstring). With `loaded` (a
        bucket may have arrived), the engines that may keep part of the push (closed with /end_weight_update, or
        not closed at all) are held: they stay paused until a push to them commits, or, with pause mode none, are
        replaced. Returns them."""
        held = []
        for url in urls:
            try:
                try:
                    answer = self.client.post(url, "/abort_weight_update", None, self.control_timeout_s)
                    if not isinstance(answer, dict) or answer.get("weights_intact", True):
                        continue  # our server, staged: the staged tensors are dropped, weights and version are old
                    # our server, in place (it was paused): what arrived is already in its weights, so it is held
                    # like SGLang (it refuses /continue_generation itself until a push commits)
                except RolloutRequestError as err:
                    if " 404" not in str(err):
                        raise
                    self.client.post(url, "/end_weight_update", None, self.control_timeout_s)
            except Exception as err:  # noqa: BLE001 (a dead engine, or no session open: nothing to close)
                log.debug("closing the weight-update session of %s: %s", url, err)
            held.append(url)
        if not held or not loaded:
            return []
        if self.pause_mode == "none":  # nothing keeps it from generating on half-updated weights
            for url in held:
                self.replace(url, "a failed weight push left it with half-updated weights, and pause mode none "
                                  "cannot hold it out of rotation")  # fmt: skip
            return held
        self.held.update(held)
        log.warning("engines %s keep part of a failed weight push: paused until a push to them commits", held)
        return held

    def resume(self, urls: list[str]) -> None:
        """/continue_generation on `urls` (those `open` paused), except held ones (module docstring); inside
        `continue_after`, at its end."""
        if self._deferred is not None:
            self._deferred.extend(urls)
            return
        for url in urls:
            if url in self.held:
                continue
            try:
                self.client.post(url, "/continue_generation", None, self.control_timeout_s)
            except Exception as err:  # noqa: BLE001 (a dead engine is replaced; the push's own error is raised)
                log.debug("continue_generation on %s: %s", url, err)
