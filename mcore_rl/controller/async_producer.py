"""One-step-off-policy generation (trainer.async_rollout): batch N+1 generates while the actor trains on batch N.

```
produce(N):  queue batches N .. N+max_staleness on the generation thread (each: prompts -> engines -> reward)
             wait for batch N  ->  check every sample's weight versions  ->  mark stale samples  ->  return it
meanwhile:   the thread generates batch N+1 against the engines while the loop computes logprobs, updates the
             actor and pushes weights; a push lands between two decode steps of the in-flight requests (our server
             stages the update and commits it atomically; with sync.pause_mode=abort SGLang aborts them and the
             client continues each from its tokens so far), so a sample can hold tokens of two versions
             (Sample.weight_versions spans)
```
Bound: when batch N is trained the engines serve version V (= the version the update starts from); a sample's
oldest token must be at least V - max_staleness. Batches are queued at most max_staleness ahead, which keeps the
bound; the check makes it an invariant (RuntimeError naming the sample otherwise). Samples with any token older
than V get `tensors["stale"] = 1`: the actor corrects them with truncated importance weights (actor.stale_tis_cap).

One generation thread, batches in step order: the prompt loader is read on that thread only, so the data order is
that of the synchronous loop (the loader's position runs ahead of the trained step by the queued batches).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch

from mcore_rl.controller.producer import Rollouts
from mcore_rl.metrics.logger import StepTimer


class AsyncProducer:
    """Wraps a producer (single-turn or agent) and runs it ahead of the loop on a background thread."""

    def __init__(self, inner: Any, state: Any, max_staleness: int, last_step: int) -> None:
        """`state`: the loop's LoopState (its weight_version is the engines' version); `last_step`: nothing is
        generated for steps after it."""
        self.inner, self.state, self.max_staleness, self.last_step = inner, state, max_staleness, last_step
        self._jobs: queue.Queue[tuple[int, Future] | None] = queue.Queue()
        self._pending: deque[tuple[int, Future]] = deque()
        self._next = 0  # next step to queue
        self._version_at_start: dict[int, int] = {}  # engines' version when each step was queued (a metric)
        self._thread = threading.Thread(target=self._work, name="async-rollout", daemon=True)
        self._thread.start()

    def score(self, prompts: list[Any], samples: list[Any], n: int) -> Any:
        """The inner producer's scoring (validation scores its samples the way training does)."""
        return self.inner.score(prompts, samples, n)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            step, future = job
            if not future.set_running_or_notify_cancel():
                continue
            timer = StepTimer()
            started = time.perf_counter()
            try:
                rollouts = self.inner.produce(step, timer)
            except BaseException as err:  # noqa: BLE001 (handed to the loop, which raises it)
                future.set_exception(err)
                continue
            rollouts.metrics.update({f"async/{k.split('/')[-1]}_s": v for k, v in timer.laps.items()})
            rollouts.metrics["async/started_at_version"] = float(self._version_at_start.get(step, -1))
            rollouts.metrics["async/busy_s"] = time.perf_counter() - started
            future.set_result(rollouts)

    def _queue(self, step: int) -> None:
        future: Future = Future()
        self._version_at_start[step] = self.state.weight_version
        self._pending.append((step, future))
        self._jobs.put((step, future))

    def produce(self, step: int, timer: StepTimer) -> Rollouts:
        """Batch `step` (generated ahead, at most max_staleness versions old); laps `time/generate` (the wait)."""
        self._next = max(self._next, step)
        while self._next <= min(step + self.max_staleness, self.last_step):
            self._queue(self._next)
            self._next += 1
        queued, future = self._pending.popleft()
        if queued != step:
            raise RuntimeError(f"async rollout: the loop asked for step {step}, the queue holds step {queued}")
        rollouts = future.result()
        timer.lap("gen")
        self.tag(rollouts)
        timer.lap("reward")
        return rollouts

    def tag(self, rollouts: Rollouts) -> None:
        """Check the staleness bound and mark stale samples (see the module docstring)."""
        current = self.state.weight_version
        stale = torch.zeros(len(rollouts.samples))
        oldest_seen, mixed = current, 0
        for i, sample in enumerate(rollouts.samples):
            versions = [v for v, _, _ in sample.weight_versions] or [sample.weight_version]
            numeric = [v for v in versions if isinstance(v, int)]
            if len(numeric) != len(versions):
                raise RuntimeError(f"async rollout: sample {i} has non-integer weight versions {versions}")
            oldest = min(numeric)
            if oldest < current - self.max_staleness:
                raise RuntimeError(
                    f"async rollout: sample {i} has tokens of weight version {oldest}, more than "
                    f"max_staleness={self.max_staleness} behind the trained version {current}"
                )
            stale[i] = float(oldest < current)
            oldest_seen = min(oldest_seen, oldest)
            mixed += len(set(numeric)) > 1
        rollouts.batch.tensors["stale"] = stale
        n = max(len(rollouts.samples), 1)
        rollouts.metrics.update(
            {
                "async/stale_frac": float(stale.mean()) if len(stale) else 0.0,
                "async/staleness_max": float(current - oldest_seen),
                "async/two_version_frac": mixed / n,
            }
        )

    def close(self) -> None:
        """Stop the generation thread after its current batch (queued ones are cancelled)."""
        for _, future in self._pending:
            future.cancel()
        self._jobs.put(None)


def make_producer(cfg: Any, loader: Any, engines: Any, reward: Any, tokenizer: Any, state: Any) -> Any:
    """The run's producer: single-turn or agent episodes (agent.enabled), ahead of the loop if trainer.async_rollout."""
    from mcore_rl.controller.agent_producer import AgentProducer
    from mcore_rl.controller.filters import build_producer

    if cfg.agent.enabled:
        inner = AgentProducer(cfg, loader, engines, reward, tokenizer)
    else:  # single-turn, shaped by the algorithm where it asks (DAPO's filter, ReMax's baseline)
        inner = build_producer(cfg, loader, engines, reward, tokenizer)
    if not cfg.trainer.async_rollout:
        return inner
    return AsyncProducer(inner, state, cfg.trainer.max_staleness, cfg.trainer.steps)
