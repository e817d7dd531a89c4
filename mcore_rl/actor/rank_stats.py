"""verl's per-step actor figures that only the ranks can measure, reduced to one value per step (max over all ranks):

    timing_s/ref                  the reference model's logprob pass (it runs inside the old-logprob call here, so
                                  timing_s/old_log_prob holds both, as it holds both in verl's fused ref+actor path)
    perf/max_memory_allocated_gb  torch.cuda.max_memory_allocated() / 2**30 (peak since the rank started, as verl's
    perf/max_memory_reserved_gb   megatron worker reports it in update_actor), CUDA only: on CPU there is no device
                                  memory; the host's is verl's perf/cpu_memory_used_gb (metrics/compute.py)

Reduced with one all-reduce (MAX) over the actor's ranks at the end of the update, which every rank runs: the update's
metrics come back from the ranks that hold the loss only, and the peak may be on another pipeline stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
_ABSENT = -1.0  # "not measured on this rank": the max over ranks stays -1 only when no rank measured it


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """(fn(), seconds it took), the device's queued kernels included (a CUDA sync before reading the clock)."""
    start = time.perf_counter()
    value = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return value, time.perf_counter() - start


def step_rank_metrics(device: torch.device, ref_seconds: float | None) -> dict[str, float]:
    """verl's names for the step's reference-pass time and device-memory peaks, the max over every rank of the
    default process group (a collective: every rank must call it)."""
    cuda = device.type == "cuda"
    values = torch.tensor(
        [
            _ABSENT if ref_seconds is None else ref_seconds,
            torch.cuda.max_memory_allocated(device) / 2**30 if cuda else _ABSENT,
            torch.cuda.max_memory_reserved(device) / 2**30 if cuda else _ABSENT,
        ],
        dtype=torch.float64,
        device=device,
    )
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    names = ("timing_s/ref", "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb")
    return {name: float(v) for name, v in zip(names, values.tolist(), strict=True) if v != _ABSENT}
