"""The control calls around a weight push, on each engine, by SGLang 0.5.23's session rules
(`scheduler_components/weight_updater.py`): what controller/weight_sync.py sends before and after the buckets.

```
pause     /pause_generation {mode}                   (sync.pause_mode; not with the embedded server's "none")
begin     /begin_weight_update                       refused while a session is open ("already open"): a session
                                                     left by a failed push or a dead controller is closed and begun
                                                     again; an engine that does not answer is handed to the pool to
                                                     be replaced, and the push goes on without it
  ... the actor ranks send the buckets (or /update_weights_from_disk with load_format) ...
commit    /end_weight_update -> /flush_cache         the radix cache holds KV of the old weights (the chat template's
                                                     prefix is in every prompt); SGLang flushes only with no request
                                                     running, so generation is still paused here (pause mode
                                                     none, the embedded server's: no prefix cache, no flush)
close     /abort_weight_update (our server: the staged tensors are dropped, old weights kept), or where the engine
          has no such route (SGLang) /end_weight_update: the session closes with what it loaded; the engine is dirty
continue  /continue_generation
```
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
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
    """No engine could take part in a push."""


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

    def open(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """Pause and begin on every engine of `urls`: (the engines in the push, the engines paused). Engines that
        do not answer are replaced and left out; FenceError if none is left."""
        paused, live = [], []
        for url in urls:
            try:
                if self.pause_mode != "none":
                    self.client.post(url, "/pause_generation", {"mode": self.pause_mode}, self.control_timeout_s)
                    paused.append(url)
                self._begin(url)
                live.append(url)
            except UNREACHABLE as err:
                self.replace(url, f"no answer to the weight push's control calls: {type(err).__name__}: {err}")
        if not live:
            self.resume(paused)
            raise FenceError(f"no engine of {urls} answered /begin_weight_update (each is being replaced)")
        return live, paused

    def _begin(self, url: str) -> None:
        try:
            self.client.post(url, "/begin_weight_update", None, self.control_timeout_s)
        except RolloutRequestError as err:
            if "already open" not in str(err):
                raise
            log.warning("engine %s had a weight-update session open (a push that failed): closing it", url)
            self.close([url])
            self.client.post(url, "/begin_weight_update", None, self.control_timeout_s)

    def update_from_disk(self, urls: list[str], directory: str, version: int) -> None:
        """/update_weights_from_disk inside the session. load_format: the engines started with load_format=dummy,
        which SGLang's disk loader refuses (it takes only its DefaultModelLoader's formats)."""
        body = {"model_path": directory, "load_format": "auto", "weight_version": str(version), "flush_cache": False}
        for url in urls:
            self.client.post(url, "/update_weights_from_disk", body, self.update_timeout_s)

    def commit(self, urls: list[str]) -> None:
        """/end_weight_update, then /flush_cache, on every engine of `urls`. Not flushed with pause mode "none",
        which only the embedded server takes: it keeps no prefix cache between requests, and refuses a flush while
        requests run (as SGLang does), which they do there during a push."""
        for url in urls:
            self.client.post(url, "/end_weight_update", None, self.update_timeout_s)
        if self.pause_mode == "none":
            return
        for url in urls:
            self.client.post(url, "/flush_cache", None, self.control_timeout_s)

    def close(self, urls: list[str]) -> None:
        """Close the session of every engine of `urls` (a failed push; see the module docstring)."""
        for url in urls:
            try:
                try:
                    self.client.post(url, "/abort_weight_update", None, self.control_timeout_s)
                except RolloutRequestError as err:
                    if " 404" not in str(err):
                        raise
                    self.client.post(url, "/end_weight_update", None, self.control_timeout_s)
            except Exception as err:  # noqa: BLE001 (a dead engine, or no session open: nothing to close)
                log.debug("closing the weight-update session of %s: %s", url, err)

    def resume(self, urls: list[str]) -> None:
        """/continue_generation on `urls` (those `open` paused)."""
        for url in urls:
            try:
                self.client.post(url, "/continue_generation", None, self.control_timeout_s)
            except Exception as err:  # noqa: BLE001 (a dead engine is replaced; the push's own error is raised)
                log.debug("continue_generation on %s: %s", url, err)
