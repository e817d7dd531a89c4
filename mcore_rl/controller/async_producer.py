"""Generation ahead of training (rollout.max_staleness = k >= 1): batches N+1 .. N+k generate while the actor trains
on batch N.

```
produce(N):  queue batches N .. N+k on the generation thread (each: prompts -> engines -> reward)
             wait for batch N  ->  label every token with its version lag  ->  apply the limit  ->  return it
meanwhile:   the thread generates the next batches against the engines while the loop computes logprobs, updates
             the actor and pushes weights; a push lands between two decode steps of the requests in flight (our
             server stages the update and commits it atomically; SGLang's pause modes retract or keep them in place,
             and with sync.pause_mode=abort the client continues each from its tokens so far), so a sample can hold
             tokens of several versions (Sample.weight_versions: the engine's own [version, start, end) spans)
```
Versions: when batch N is trained the engines serve version V, the version the update starts from. A token sampled
by version v has lag V - v. The queue keeps every token's lag <= k: batch N+k is queued while the engines serve
version V - k at the earliest, and the loop cannot push again before it has trained batch N. The limit is checked on
every token all the same, since the queue cannot see everything (an engine replaced mid-run serves whatever it was
started with until the next push): a sample past it is dropped with its prompt's group (rollout.staleness_action=
drop, the default: the bound is what the run asked for, at no cost in time), generated again on the current weights
inside the step (regenerate) or kept (weight). A step whose every group is dropped ends
the run with an error naming the limit (StalenessLimitExceeded), never an empty update.

The batch carries `version_lag` [B, T] (per token) and `stale` [B, T] (1 where lag > 0): the actor weighs stale
tokens by truncated importance sampling against the engine's own per-token logprobs (actor/step_losses.py; the
estimator is in docs/algorithms.md). Tokens of the current version get weight 1, so a sample that spans a push is
corrected on its old tokens only.

One generation thread, batches in step order: the prompt loader is read on that thread only, so the data order is
that of the synchronous loop (the loader's position runs ahead of the trained step by the queued batches). k = 0 is
the synchronous loop itself: make_producer returns the inner producer, no thread.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch

from mcore_rl.controller.producer import Rollouts
from mcore_rl.controller.samples import samples_to_batch
from mcore_rl.metrics.logger import StepTimer


class StalenessLimitExceeded(ValueError):
    """Every sample of a step was older than rollout.max_staleness allows (staleness_action=drop): exit 2 naming the
    limit, as a setting the run cannot keep."""


def token_versions(sample: Any) -> list[int]:
    """The weight version that sampled each response token: the engine's spans, the sample's version elsewhere (a
    tool's tokens in an agent episode, an engine that reports one version). Non-integer versions are refused."""
    fallback = sample.weight_version
    versions = [fallback] * len(sample.response_ids)
    for version, start, end in sample.weight_versions:
        versions[start:end] = [version] * (min(end, len(versions)) - start)
    if any(not isinstance(v, int) or isinstance(v, bool) for v in versions):
        listed = sorted({str(v) for v in versions})
        raise RuntimeError(f"async rollout: a sample has non-integer weight versions {listed}; expected integers")
    return versions


def _lags(samples: list[Any], current: int, limit: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Per sample: each token's version lag behind `current`, the oldest token's lag; and the samples past `limit`."""
    lags = [[current - v for v in token_versions(s)] for s in samples]
    oldest = [max(lag, default=0) for lag in lags]
    return lags, oldest, [i for i, lag in enumerate(oldest) if lag > limit]


class AsyncProducer:
    """Wraps a producer (single-turn or agent) and runs it ahead of the loop on a background thread."""

    def __init__(
        self,
        inner: Any,
        state: Any,
        max_staleness: int,
        last_step: int,
        action: str = "drop",
        group_unit: int = 1,
        partial: bool = True,
    ) -> None:
        """`state`: the loop's LoopState (its weight_version is the engines' version); `last_step`: nothing is
        generated for steps after it; `action`: rollout.staleness_action; `group_unit`: kept groups after a drop are
        a multiple of it (the update's mini-batches and data-parallel ranks must divide the batch); `partial`:
        rollout.partial_rollout (false: `push_fence` keeps every batch on one version)."""
        self.inner, self.state, self.max_staleness, self.last_step = inner, state, max_staleness, last_step
        self.action, self.group_unit, self.partial = action, max(1, group_unit), partial
        self._batch = threading.Lock()  # held by the thread over each batch when partial is off
        self._push_waits: list[float] = []  # seconds each push waited for a batch to end (partial off)
        self._jobs: queue.Queue[tuple[int, Future] | None] = queue.Queue()
        self._pending: deque[tuple[int, Future]] = deque()
        self._next = 0  # next step to queue
        self._version_at_start: dict[int, int] = {}  # engines' version when each step was queued (a metric)
        self._stale_processed = 0  # samples with a token older than the trained version, over the run
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
                if self.partial:
                    rollouts = self.inner.produce(step, timer)
                else:  # no push lands while this batch generates (push_fence)
                    with self._batch:
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
        """Batch `step` (generated ahead, its tokens at most max_staleness versions old); laps `time/generate` (the
        wait)."""
        self._next = max(self._next, step)
        while self._next <= min(step + self.max_staleness, self.last_step):
            self._queue(self._next)
            self._next += 1
        queued, future = self._pending.popleft()
        if queued != step:
            raise RuntimeError(f"async rollout: the loop asked for step {step}, the queue holds step {queued}")
        rollouts = future.result()
        timer.lap("gen")
        rollouts = self.tag(rollouts, step)
        timer.lap("reward")
        return rollouts

    def tag(self, rollouts: Rollouts, step: int = 0) -> Rollouts:
        """Label every token with its version lag, apply the limit (rollout.staleness_action) and add the staleness
        metrics; returns the batch to train (the same object unless groups were dropped)."""
        current, k = self.state.weight_version, self.max_staleness
        lags, oldest, over = _lags(rollouts.samples, current, k)
        dropped = regenerated = 0
        if over and self.action == "regenerate":
            rollouts, regenerated = self._regenerate(rollouts, over, step)
            lags, oldest, over = _lags(rollouts.samples, current, k)  # an engine still on old weights: dropped
        if over and self.action in ("drop", "regenerate"):
            before = len(rollouts.samples)
            rollouts, lags, oldest = self._drop(rollouts, lags, oldest, set(over), step, current)
            dropped = before - len(rollouts.samples)
        mask = rollouts.batch.response_mask
        lag = torch.zeros_like(mask)
        for i, row in enumerate(lags):
            lag[i, : len(row)] = torch.tensor(row, dtype=lag.dtype)
        rollouts.batch.tensors["version_lag"] = lag
        rollouts.batch.tensors["stale"] = (lag > 0).to(mask.dtype)
        self._stale_processed += sum(1 for o in oldest if o > 0)
        kept_over = len(over) if self.action == "weight" else 0
        rollouts.metrics.update(self._metrics(rollouts, lag, mask, oldest, dropped, kept_over))
        rollouts.metrics["async/regenerated_samples"] = float(regenerated)
        return rollouts

    def _metrics(self, rollouts, lag, mask, oldest, dropped, kept_over) -> dict[str, float]:
        n = max(len(oldest), 1)
        tokens = float(mask.sum())
        out = {
            # verl's fully-async trainer's name: samples trained with any token of an older version, over the run
            "fully_async/count/stale_samples_processed": float(self._stale_processed),
            "async/stale_frac": sum(1 for o in oldest if o > 0) / n,
            "async/staleness_max": float(max(oldest, default=0)),
            "async/staleness_mean": float((lag * mask).sum()) / tokens if tokens else 0.0,
            # requests that were in flight at a push and went on across it (tokens of two versions or more)
            "async/partial_requests": float(
                sum(1 for s in rollouts.samples if len({v for v, _, _ in s.weight_versions}) > 1)
            ),
            "async/dropped_samples": float(dropped),
            "async/kept_over_limit_samples": float(kept_over),
        }
        out["async/two_version_frac"] = out["async/partial_requests"] / n
        if not self.partial:  # the push of the step before this batch was trained waited this long for generation
            out["async/push_wait_s"] = self._push_waits[-1] if self._push_waits else 0.0
        for d in range(self.max_staleness + 1):  # the histogram by lag: samples by their oldest token, and tokens
            out[f"async/lag_samples/{d}"] = float(sum(1 for o in oldest if o == d))
            out[f"async/lag_tokens_frac/{d}"] = (
                float(((lag == d).to(mask.dtype) * mask).sum()) / tokens if tokens else 0.0
            )
        return out

    def _regenerate(self, rollouts: Rollouts, over: list[int], step: int) -> tuple[Rollouts, int]:
        """The batch with the groups holding a sample past the limit generated again by the inner producer on the
        weights the engines serve now; (the batch, the number of samples regenerated)."""
        samples, prompts = list(rollouts.samples), rollouts.prompts
        n = max(1, len(samples) // max(1, len(prompts)))
        bad = sorted({i // n for i in over})
        fresh = self.inner.regenerate([prompts[g] for g in bad], step)
        scores = rollouts.scores.clone()
        baseline = None if rollouts.baseline_scores is None else rollouts.baseline_scores.clone()
        for j, g in enumerate(bad):
            rows, new = slice(g * n, (g + 1) * n), slice(j * n, (j + 1) * n)
            samples[rows] = fresh.samples[new]
            scores[rows] = fresh.scores[new]
            if baseline is not None:
                baseline[rows] = fresh.baseline_scores[new]
        batch, group_ids = samples_to_batch(samples, n)
        out = Rollouts(prompts, samples, scores, batch, group_ids, dict(rollouts.metrics), baseline)
        return out, len(bad) * n

    def _drop(self, rollouts: Rollouts, lags, oldest, over: set[int], step: int, current: int):
        """The batch without the groups holding a sample past the limit, cut to a multiple of group_unit groups."""
        samples, prompts = rollouts.samples, rollouts.prompts
        n = max(1, len(samples) // max(1, len(prompts)))
        bad = {i // n for i in over}
        keep = [g for g in range(len(prompts)) if g not in bad]
        keep = keep[: len(keep) // self.group_unit * self.group_unit]
        if not keep:
            raise StalenessLimitExceeded(
                f"rollout.max_staleness={self.max_staleness}: step {step} has no group left to train: "
                f"{len(bad)} of {len(prompts)} groups hold tokens more than {self.max_staleness} weight versions "
                f"older than the trained version {current} (the oldest is {max(oldest)} behind), and the update needs "
                f"groups in multiples of {self.group_unit}; expected fresher samples: raise rollout.max_staleness, or "
                "set rollout.staleness_action=weight to train them with importance weights"
            )
        rows = [g * n + j for g in keep for j in range(n)]
        kept = [samples[i] for i in rows]
        batch, group_ids = samples_to_batch(kept, n)
        baseline = rollouts.baseline_scores[rows] if rollouts.baseline_scores is not None else None
        out = Rollouts(
            [prompts[g] for g in keep], kept, rollouts.scores[rows], batch, group_ids, dict(rollouts.metrics), baseline
        )
        return out, [lags[i] for i in rows], [oldest[i] for i in rows]

    @contextlib.contextmanager
    def push_fence(self) -> Iterator[None]:
        """Held over a push when partial rollouts are off (RunSession.fence_pushes): waits for the batch being
        generated to end, and the next one starts after the push, so no request spans two versions."""
        if self.partial:
            yield
            return
        started = time.perf_counter()
        with self._batch:
            self._push_waits.append(time.perf_counter() - started)
            yield

    def close(self) -> None:
        """Stop the generation thread after its current batch (queued ones are cancelled)."""
        for _, future in self._pending:
            future.cancel()
        self._jobs.put(None)


def make_producer(cfg: Any, loader: Any, engines: Any, reward: Any, tokenizer: Any, state: Any) -> Any:
    """The run's producer: single-turn or agent episodes (agent.enabled), ahead of the loop when
    rollout.max_staleness > 0; at 0 the inner producer itself (the synchronous loop)."""
    from mcore_rl.controller.agent_producer import AgentProducer
    from mcore_rl.controller.filters import build_producer, group_unit

    if cfg.agent.enabled:
        inner = AgentProducer(cfg, loader, engines, reward, tokenizer)
    else:  # single-turn, shaped by the algorithm where it asks (DAPO's filter, ReMax's baseline)
        inner = build_producer(cfg, loader, engines, reward, tokenizer)
    if cfg.rollout.max_staleness == 0:
        return inner
    rollout = cfg.rollout
    return AsyncProducer(
        inner, state, rollout.max_staleness, cfg.trainer.steps, rollout.staleness_action, group_unit(cfg),
        rollout.partial_rollout,
    )  # fmt: skip
