"""Run a function on N gloo ranks (forked from a preloaded server): the multi-rank test harness.

    results = run_on_ranks(my_fn, world_size=4, args=(layout,))

`my_fn(rank, world_size, *args)` must be importable (defined at module level). Each rank is a fresh process with the
CPU runtime enabled and torch.distributed started over gloo on loopback; the list of return values (index = rank)
comes back, or a RankFailed naming the first rank that raised, with its traceback.

Ranks are forked from a fork server (multiprocessing's `forkserver`) that has imported torch and megatron-core once,
instead of each rank importing them anew (`spawn`): here that import is about 5 CPU-seconds per rank, more than most
ranks' own work. Four ranks that build the default job's actor took 10.9 s (20 CPU-s) spawned and 0.7 s (1.2 CPU-s)
forked, after a first call of 6 s that starts the server (`python tools/bench_harness.py`). The server is started on
first use and lives as long as this process; where a GPU is usable the ranks are spawned as before
(`default_start_method`). What a spawned rank would get from its parent and a forked one would not, each rank is
given explicitly: the parent's current environment and its current stdout/stderr (the server's are those of the
moment it started); sys.path and the working directory come with multiprocessing's own preparation data, as for
spawn.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from typing import Any

import torch
import torch.multiprocessing as mp

from mcore_rl.parallel.groups import destroy_model_parallel, free_port, init_distributed

#: What the fork server imports before forking ranks: what every rank imports anyway (a rank built from the
#: forked image only imports its own function's module). Import-time state only: no Python thread is started (torch
#: starts one idle native thread at import, and its DataLoader forks worker processes from that state too).
RANK_PRELOAD = (
    "mcore_rl",  # first: it installs the CPU hook on megatron.core.jit (mcore_rl/_megatron_import.py)
    "torch",
    "torch.distributed",
    "megatron.core",
    "mcore_rl.parallel.cpu_runtime",
    "mcore_rl.parallel.groups",
    "mcore_rl.parallel.harness",
    "mcore_rl.models.builder",
)


def default_start_method() -> str:
    """`forkserver`, or `spawn` where torch sees a usable GPU: the fork server's imports ask CUDA whether a device is
    there (mcore_rl's hook on megatron.core.jit), and a process that has asked cannot fork children that use CUDA
    or even ask again (torch's "poisoned fork"), which would hide the GPU from the CPU runtime's refusal."""
    from mcore_rl.parallel.cpu_runtime import usable_gpu

    return "spawn" if usable_gpu() else "forkserver"


def rank_context(start_method: str | None = None):
    """The multiprocessing context ranks start from (the fork server); use it for queues shared with ranks."""
    ctx = mp.get_context(start_method or default_start_method())
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(list(RANK_PRELOAD))  # read when the server starts, i.e. on first use
    return ctx


class _ParentStdio:
    """The parent's stdout and stderr at the time a rank starts, passed to the rank as file descriptors.

    Pickled only while multiprocessing starts a process: `reduction.DupFd` hands the descriptors over with the
    process (the fork server's own stdio is whatever the parent's was when the server started, e.g. the output
    capture of another test)."""

    def __reduce__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        return (_redirect_stdio, (reduction.DupFd(1), reduction.DupFd(2)))


def _redirect_stdio(out, err) -> None:
    for fd, dup in ((1, out), (2, err)):
        inherited = dup.detach()
        os.dup2(inherited, fd)
        os.close(inherited)


def _adopt_parent(env: dict[str, str]) -> None:
    """Make this forked rank's environment the parent's, as spawn would have, and its thread count the one the
    parent's OMP_NUM_THREADS asks for (libgomp read the variable when the fork server imported torch)."""
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


class RankFailed(RuntimeError):
    """A rank raised or died before reporting; the message says which, with its traceback."""


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable, args: Sequence[Any], queue: Any, env: dict, stdio: Any
) -> None:
    # `stdio` is None here: unpickling it already pointed fds 1 and 2 at the caller's (see _ParentStdio)
    _adopt_parent(env)
    try:
        init_distributed("cpu", rank, world_size, "127.0.0.1", port, timeout_s=300)
        result = fn(rank, world_size, *args)
        # Bytes, not tensors: torch.multiprocessing would share tensor storage through file descriptors that vanish
        # when this process exits, racing the parent's read.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            destroy_model_parallel()
        except Exception:  # noqa: BLE001 - a broken group at teardown must not hide the real error
            pass


def run_on_ranks(
    fn: Callable,
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 600.0,
    start_method: str | None = None,
) -> list[Any]:
    """Start `world_size` CPU ranks running `fn(rank, world_size, *args)`; return their results by rank.

    `start_method`: `default_start_method()` unless given; "spawn" starts each rank as a fresh interpreter (what
    tools/bench_harness.py compares)."""
    ctx = rank_context(start_method)
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, fn, tuple(args), queue, env, _ParentStdio()),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    suspects: set[int] = set()
    try:
        while len(results) < world_size and not failures:
            try:
                rank, ok, payload = queue.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
            except queue_module.Empty:
                if time.monotonic() >= deadline:
                    raise
                # A rank killed from outside (out of memory, a signal) never reports: without this check the
                # parent would wait for the whole timeout. Two quiet polls in a row, so that a result still in
                # the pipe from a rank that crashed at teardown is not misread.
                dead = {r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)}
                for r in sorted(dead & suspects):
                    failures[r] = f"exited with code {procs[r].exitcode} before reporting (killed: out of memory?)"
                suspects = dead
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                failures[rank] = payload
    finally:
        for proc in procs:
            # Poll (waitpid) rather than join(): join waits for the process's sentinel pipe, which a grandchild that
            # inherited it keeps open after the rank has exited (torch's torch_shm_manager, started by ranks that
            # share CPU tensors through the file_system strategy, lives on until its last client is gone).
            stop = time.monotonic() + (5 if failures else 60)
            while proc.is_alive() and time.monotonic() < stop:
                time.sleep(0.02)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        rank = min(failures)
        raise RankFailed(f"rank {rank} of {world_size} failed:\n{failures[rank]}")
    return [results[rank] for rank in range(world_size)]
