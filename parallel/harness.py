"""Run a function on N spawned gloo ranks: the multi-rank test harness.

    results = run_on_ranks(my_fn, world_size=4, args=(layout,))

`my_fn(rank, world_size, *args)` must be importable (defined at module level). Each rank is a fresh process with the
CPU runtime enabled and torch.distributed started over gloo on loopback; the list of return values (index = rank)
comes back, or a RankFailed naming the first rank that raised, with its traceback.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from mcore_rl.parallel.groups import destroy_model_parallel, free_port, init_distributed


class RankFailed(RuntimeError):
    """A spawned rank raised; the message holds its traceback."""


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: Sequence[Any], queue: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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


def run_on_ranks(fn: Callable, world_size: int, args: Sequence[Any] = (), timeout_s: float = 600.0) -> list[Any]:
    """Spawn `world_size` CPU ranks running `fn(rank, world_size, *args)`; return their results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, port, fn, tuple(args), queue), daemon=False)
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
