"""Score a batch of decoded responses with a reward function and check every score before it reaches the loss.

    (solution_strs, data_sources, ground_truths, extra_infos)
      -> per-row RewardFn calls (inline, or on threads with an optional per-call timeout)
         | or one BatchRewardFn.score_batch call (reward models, sandboxes)
      -> validate: finite number, or dict with a finite "score"
      -> RewardOutput(scores [batch] float32, per-row extras from dict returns, summary metrics)

A reward function that returns None, NaN, a string, or a dict without "score" stops the step with an error naming
the function, the data_source, the row and the value, because a silently wrong reward poisons advantages for the
whole batch. A function that raises is reported the same way, with the original exception chained; so is one that
calls sys.exit or raises KeyboardInterrupt itself (a real Ctrl-C still stops the run: errors.sigint_received), one
that raises any other BaseException subclass, and one that calls os._exit (or posix._exit): while a reward call runs,
those two are guarded (in this process only, not in a child it forks) and raise instead of ending the driver, which
would otherwise have ended with exit 0 and no summary.json, looking like a finished run.
Each call gets its own deep copy of its row's extra_info: a function that edits it cannot change what the next sample,
the next epoch or another function sees.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import numbers
import os
import posix
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from mcore_rl import errors  # imported here, not in the reward threads (a first import from two at once raced)
from mcore_rl.reward.loader import RewardFn, RewardFunctionError, RewardResult

log = logging.getLogger(__name__)
#: seconds between the progress lines of a long reward phase (a slow verifier, a reward that swaps)
PROGRESS_EVERY_S = 30.0
#: driver RSS growth since the first reward phase that is warned about (MiB): well above what a step's own batches,
#: tensors and allocator slack add on the default job, well below what breaks a node
MEMORY_WARN_MB = 1024.0


@runtime_checkable
class BatchRewardFn(Protocol):
    """Scores a whole batch in one call: the seam for a reward model server or a sandboxed code runner, which batch
    requests and enforce their own timeouts. Returns one float or dict (with "score") per row."""

    def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[str],
        extra_infos: Sequence[dict[str, Any] | None],
    ) -> list[RewardResult]: ...


class RewardTimeoutError(RewardFunctionError):
    """A reward function call ran past the manager's per-call timeout (and no `timeout_score` was set)."""


@dataclass
class RewardOutput:
    """Scores for one batch."""

    scores: torch.Tensor
    """float32 [batch]: the reward of each response."""
    extras: dict[str, list[Any]] = field(default_factory=dict)
    """Per-row values of every non-"score" key that dict returns carried; None where a row lacked the key."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Summary for logging: mean score overall and per data_source, means of numeric extras, timeout count."""


class _ExitCalled(BaseException):
    """A reward called os._exit / posix._exit (raised by the guard instead of ending the process)."""


_IN_REWARD = threading.local()  # .pid: set while this thread runs a reward call in that process
_GUARD_LOCK = threading.Lock()


def _install_exit_guard() -> None:
    """Replace os._exit and posix._exit (once per process) by a guard that raises _ExitCalled inside a reward call of
    this process and ends the process as before everywhere else (the lifecycle's own exits, a forked child's)."""
    with _GUARD_LOCK:
        for module, name in ((os, "os._exit"), (posix, "posix._exit")):
            real = module._exit
            if getattr(real, "_reward_guard", False):
                continue

            def guarded(code: int, real: Any = real, name: str = name) -> None:
                if getattr(_IN_REWARD, "pid", None) == os.getpid():
                    raise _ExitCalled(f"{name}({code!r})")
                real(code)

            guarded._reward_guard = True  # type: ignore[attr-defined]
            module._exit = guarded


def _rss() -> int:
    """This process's resident memory in bytes."""
    import psutil

    return psutil.Process().memory_info().rss


def _real_ctrl_c(exc: BaseException) -> bool:
    """A KeyboardInterrupt that a real Ctrl-C raised inside the call: re-raised as it is, so the run stops as
    interrupted (the user's, not the function's)."""
    return isinstance(exc, KeyboardInterrupt) and errors.sigint_received()


def _ended(exc: BaseException, where: str) -> RewardFunctionError:
    """A reward's sys.exit, os._exit or its own KeyboardInterrupt as its failure (RewardFunctionError: a user error,
    exit 2)."""
    if isinstance(exc, KeyboardInterrupt):
        what = "raised KeyboardInterrupt (no Ctrl-C was pressed)"
    elif isinstance(exc, _ExitCalled):
        what = f"called {exc}"
    else:
        what = f"called sys.exit({exc.code!r})"
    return RewardFunctionError(f"{where} {what}; a reward function must return a score, not end the process")


def _shown(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (a reward returning 10**400 printed 401 digits)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit // 2]}... ({len(text)} characters)"


def _function_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(getattr(fn, "func", None), "__qualname__", None) or repr(fn)


class RewardManager:
    """Applies one reward function to batches of responses, validating every result."""

    def __init__(
        self,
        fn: RewardFn | BatchRewardFn,
        *,
        num_threads: int = 1,
        timeout_s: float | None = None,
        timeout_score: float | None = None,
        progress_every_s: float = PROGRESS_EVERY_S,
        memory_warn_mb: float = MEMORY_WARN_MB,
    ) -> None:
        """Args:
        fn: a per-response `RewardFn` (see `loader.build_reward_fn`) or a `BatchRewardFn`.
        num_threads: concurrent calls for a per-response function. Threads help I/O-bound rewards (HTTP to a
            verifier); CPU-bound Python rule rewards are fast enough inline. 1 with no timeout runs inline.
        timeout_s: per-call limit in seconds for a per-response function, or None for no limit.
        timeout_score: score given to a call that times out; None makes a timeout an error.
        progress_every_s: a phase longer than this logs how many rows are scored, and again after each such period.
        memory_warn_mb: warn (once) when the driver's RSS after a reward phase exceeds its RSS before the first
            phase by this much: a reward that keeps memory between calls grows the driver every step.
        """
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        if timeout_score is not None and not math.isfinite(timeout_score):
            raise ValueError(f"timeout_score must be finite or None, got {timeout_score}")
        _install_exit_guard()
        self.fn = fn
        self.name = _function_name(fn)
        self.num_threads = num_threads
        self.timeout_s = timeout_s
        self.timeout_score = timeout_score
        self.progress_every_s = progress_every_s
        self.memory_warn_mb = memory_warn_mb
        self._rss_first: int | None = None  # the driver's RSS before the first reward phase
        self._phases = 0
        self._memory: dict[str, float] = {}
        self._memory_warned = False
        # The calling thread's last output: validation reads its extras (acc) after scoring through a producer,
        # while an async producer may be scoring the next batch on another thread.
        self._last = threading.local()

    def last_output(self) -> RewardOutput | None:
        """The last RewardOutput this thread's `score` returned (None before any)."""
        return getattr(self._last, "output", None)

    def score(
        self,
        solution_strs: Sequence[str],
        data_sources: Sequence[str],
        ground_truths: Sequence[str],
        extra_infos: Sequence[dict[str, Any] | None] | None = None,
    ) -> RewardOutput:
        """Score a batch; all sequences are per row and must have the same length."""
        n = len(solution_strs)
        if extra_infos is None:
            extra_infos = [None] * n
        lengths = {
            "solution_strs": n,
            "data_sources": len(data_sources),
            "ground_truths": len(ground_truths),
            "extra_infos": len(extra_infos),
        }
        if len(set(lengths.values())) != 1:
            raise ValueError(f"RewardManager.score: inputs differ in length: {lengths}")

        rss_before = _rss()
        output = self._score(solution_strs, data_sources, ground_truths, extra_infos, n)
        self._track_memory(rss_before, _rss())
        return output

    def memory_metrics(self) -> dict[str, float]:
        """The driver's memory around the last reward phase: `perf/reward_rss_delta_mb` (its RSS growth over the phase)
        and `perf/reward_driver_rss_gb` (its RSS after it); empty before any phase. Under perf/, beside
        perf/cpu_memory_used_gb: figures of the machine's state, which differ between two runs of the same job."""
        return dict(self._memory)

    def _track_memory(self, before: int, after: int) -> None:
        if self._rss_first is None:
            self._rss_first = before
        self._phases += 1
        self._memory = {
            "perf/reward_rss_delta_mb": (after - before) / 2**20,
            "perf/reward_driver_rss_gb": after / 2**30,
        }
        growth_mb = (after - self._rss_first) / 2**20
        if growth_mb > self.memory_warn_mb and not self._memory_warned:
            self._memory_warned = True
            log.warning(
                "reward: the driver's memory grew by %.0f MiB over %d reward phase(s) (now %.2f GiB) while reward "
                "function %s ran: a reward that keeps memory between calls (a cache, a global list) grows the driver "
                "every step until it runs out; perf/reward_rss_delta_mb in the metrics shows the growth per step",
                growth_mb, self._phases, after / 2**30, self.name,
            )  # fmt: skip

    def _score(
        self,
        solution_strs: Sequence[str],
        data_sources: Sequence[str],
        ground_truths: Sequence[str],
        extra_infos: Sequence[dict[str, Any] | None],
        n: int,
    ) -> RewardOutput:
        timeouts = 0
        if isinstance(self.fn, BatchRewardFn):
            infos = [copy.deepcopy(info) for info in extra_infos]  # see the module docstring
            _IN_REWARD.pid = os.getpid()
            try:
                results = list(self.fn.score_batch(data_sources, solution_strs, ground_truths, infos))
            except (SystemExit, KeyboardInterrupt, _ExitCalled) as exc:
                if _real_ctrl_c(exc):
                    raise
                raise _ended(exc, f"{self.name}.score_batch") from exc
            except BaseException as exc:
                if isinstance(exc, (Exception, errors.Terminated)):
                    raise
                raise RewardFunctionError(f"{self.name}.score_batch raised {type(exc).__name__}: {exc}") from exc
            finally:
                _IN_REWARD.pid = None
            if len(results) != n:
                raise RewardFunctionError(f"{self.name}.score_batch returned {len(results)} results for {n} rows")
        else:
            calls = [
                self._call(self.fn, row, data_sources[row], solution_strs[row], ground_truths[row], extra_infos[row])
                for row in range(n)
            ]
            done = [0]  # rows scored so far, read by the progress reporter
            timed_out: list[int] = []
            with self._progress(n, done):
                if self.num_threads == 1 and self.timeout_s is None:
                    results = []
                    for call in calls:
                        results.append(call())
                        done[0] += 1
                else:
                    results, timed_out = self._run_threaded(calls, done)
            if timed_out:
                for row in timed_out:
                    if self.timeout_score is None:
                        raise RewardTimeoutError(
                            f"reward function {self.name} ran past timeout_s={self.timeout_s} on row {row} "
                            f"(data_source={data_sources[row]!r}); raise reward.timeout_s if the function is this "
                            f"slow (null: no limit)"
                        )
                    results[row] = self.timeout_score
                timeouts = len(timed_out)

        scores: list[float] = []
        extras: dict[str, list[Any]] = {}
        for row, result in enumerate(results):
            score, row_extras = self._validate(result, row, data_sources[row])
            scores.append(score)
            for key, value in row_extras.items():
                extras.setdefault(key, [None] * n)[row] = value
        self._last.output = RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32),
            extras=extras,
            metrics=self._metrics(scores, data_sources, extras, timeouts),
        )
        return self._last.output

    def _call(
        self, fn: RewardFn, row: int, data_source: str, solution_str: str, ground_truth: str, extra_info: Any
    ) -> Callable[[], RewardResult]:
        """A zero-argument call for one row that wraps user exceptions with the row's context."""

        def call() -> RewardResult:
            info = copy.deepcopy(extra_info)  # see the module docstring
            _IN_REWARD.pid = os.getpid()
            try:
                return fn(
                    data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=info
                )
            except (SystemExit, KeyboardInterrupt, _ExitCalled) as exc:
                if _real_ctrl_c(exc):
                    raise
                raise _ended(exc, f"reward function {self.name} on row {row} (data_source={data_source!r})") from exc
            except BaseException as exc:  # an Exception, or a BaseException subclass of the user's own
                if isinstance(exc, errors.Terminated):  # SIGTERM arrived while an inline reward ran
                    raise
                raise RewardFunctionError(
                    f"reward function {self.name} raised on row {row} (data_source={data_source!r}): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            finally:
                _IN_REWARD.pid = None

        return call

    @contextlib.contextmanager
    def _progress(self, n: int, done: list[int]) -> Iterator[None]:
        """Log `done[0]`/n every progress_every_s while the block runs (from a thread: a call may block the caller)."""
        stop = threading.Event()
        start = time.monotonic()

        def report() -> None:
            while not stop.wait(self.progress_every_s):
                limit = f"reward.timeout_s={self.timeout_s:g} per call" if self.timeout_s else "no reward.timeout_s"
                log.info(
                    "reward: %d/%d rows scored in %.0f s (reward function %s; %s)",
                    done[0], n, time.monotonic() - start, self.name, limit,
                )  # fmt: skip

        reporter = threading.Thread(target=report, daemon=True, name="reward-progress")
        reporter.start()
        try:
            yield
        finally:
            stop.set()
            reporter.join()  # gone before score returns: no thread of ours outlives a phase but abandoned calls

    def _run_threaded(
        self, calls: list[Callable[[], RewardResult]], done: list[int] | None = None
    ) -> tuple[list[Any], list[int]]:
        """Run calls on up to `num_threads` daemon threads, each with its own deadline from when it starts.

        Python cannot kill a thread, so a call past its deadline is abandoned: its (daemon) thread no longer counts
        towards `num_threads` and its late result is ignored. Abandoning rather than joining is what keeps one hung
        verifier from stalling the whole step; the cost is a leaked thread per hang. A pool executor would not do:
        a hung call would hold a worker forever and starve the queued calls. Without a `timeout_score` the first
        timeout ends the batch (no further call starts), so a hanging function fails in one timeout, leaving at most
        `num_threads` threads behind.
        """
        n = len(calls)
        results: list[Any] = [None] * n
        finished = [False] * n
        errors: dict[int, BaseException] = {}
        cond = threading.Condition()

        def work(row: int) -> None:
            try:
                value: Any = calls[row]()
            except BaseException as exc:  # re-raised in the calling thread below
                with cond:
                    if not finished[row]:  # an abandoned call's late error is dropped too
                        errors[row] = exc
                        finished[row] = True
                    cond.notify()
                return
            with cond:
                if not finished[row]:  # an abandoned call's late result is dropped
                    results[row] = value
                    finished[row] = True
                    if done is not None:
                        done[0] += 1
                cond.notify()

        started: dict[int, float] = {}  # row -> start time, for calls still counted as running
        timed_out: list[int] = []
        next_row = 0
        with cond:
            while next_row < n or started:
                while next_row < n and len(started) < self.num_threads:
                    started[next_row] = time.monotonic()
                    threading.Thread(target=work, args=(next_row,), daemon=True, name=f"reward-{next_row}").start()
                    next_row += 1
                wait_s = None
                if self.timeout_s is not None:
                    wait_s = max(0.0, min(started.values()) + self.timeout_s - time.monotonic())
                cond.wait_for(lambda: any(finished[row] for row in started), timeout=wait_s)
                now = time.monotonic()
                for row, start in list(started.items()):
                    if finished[row]:
                        del started[row]
                    elif self.timeout_s is not None and now - start >= self.timeout_s:
                        finished[row] = True
                        timed_out.append(row)
                        del started[row]
                failing = [*errors, *(timed_out if self.timeout_score is None else [])]
                if failing:
                    # Report the first failing row in row order, not the first call to fail: wait for the calls on
                    # earlier rows (each within its own timeout), start no more, then pick the lowest row.
                    first = min(failing)
                    next_row = n
                    if not any(row < first for row in started):
                        if first in errors:
                            raise errors[first]
                        # Fail at the first hang: a function that hangs on one row usually hangs on all of them,
                        # and going on would cost one timeout and one abandoned thread per remaining row.
                        return results, [first]
        return results, sorted(timed_out)

    def _validate(self, result: Any, row: int, data_source: str) -> tuple[float, dict[str, Any]]:
        """Check one result; return (score, extras). Raises naming the function, data_source, row and value."""
        where = f"reward function {self.name} on row {row} (data_source={data_source!r})"
        extras: dict[str, Any] = {}
        value = result
        if isinstance(result, dict):
            if "score" not in result:
                raise RewardFunctionError(f"{where} returned a dict without 'score' (keys: {sorted(result)})")
            value = result["score"]
            extras = {key: v for key, v in result.items() if key != "score"}
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(
                f"{where} returned {_shown(value)} of type {type(value).__name__}; "
                "expected a finite float or a dict with a finite float 'score'"
            )
        try:
            score = float(value)
        except OverflowError:  # an int beyond float's range (10**400)
            score = math.inf
        if not math.isfinite(score):
            raise RewardFunctionError(f"{where} returned {_shown(value)}; expected a finite score")
        return score, extras

    @staticmethod
    def _metrics(
        scores: list[float], data_sources: Sequence[str], extras: dict[str, list[Any]], timeouts: int
    ) -> dict[str, float]:
        """Means for logging: overall, per data_source, and of every numeric extra key."""
        metrics: dict[str, float] = {"reward/timeouts": float(timeouts)}
        if scores:
            metrics["reward/score_mean"] = sum(scores) / len(scores)
        by_source: dict[str, list[float]] = {}
        for source, score in zip(data_sources, scores):
            by_source.setdefault(source, []).append(score)
        for source, values in by_source.items():
            metrics[f"reward/{source}/score_mean"] = sum(values) / len(values)
        for key, values in extras.items():
            numeric = [float(v) for v in values if isinstance(v, numbers.Real)]
            if numeric:
                metrics[f"reward/{key}_mean"] = sum(numeric) / len(numeric)
        return metrics
