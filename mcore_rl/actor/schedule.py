"""One call into Megatron's forward/backward schedule with explicit process groups.

Picks the schedule for pp/vpp (no pipelining, 1F1B, interleaved), builds the P2P communicator that pipelined schedules
need when groups are passed in (megatron-core 0.16.1 refuses pg_collection without it), and gives every virtual stage
its own iterator over the micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mcore_rl.parallel.cpu_runtime import mode_suspended


def run_schedule(
    model: Sequence[torch.nn.Module],
    forward_step: Callable,
    microbatches: Sequence[Any],
    seq_length: int,
    micro_batch_size: int,
    pg_collection: Any,
    forward_only: bool,
) -> list[Any]:
    """Run `forward_step(data_iterator, model_chunk)` over `microbatches`; returns the last stage's loss dicts."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    pp_size = pg_collection.pp.size()
    vpp = len(model) if len(model) > 1 else None
    kwargs: dict[str, Any] = {}
    if pp_size > 1:
        kwargs["p2p_communicator"] = P2PCommunicator(pp_group=pg_collection.pp, config=model[0].config)
    schedule = get_forward_backward_func(pp_size=pp_size, vp_size=vpp)
    with mode_suspended():  # the CPU runtime's per-op device mode is not needed here (parallel/cpu_runtime.py)
        return schedule(
            forward_step_func=forward_step,
            data_iterator=[iter(microbatches) for _ in model] if vpp else iter(microbatches),
            model=list(model) if vpp else model[0],
            num_microbatches=len(microbatches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
            pg_collection=pg_collection,
            **kwargs,
        )
