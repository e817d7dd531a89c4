"""Colocated placement: an actor rank's training state leaves the GPU while the engines generate, and comes back.

    moved = offload(actor)   # parameters + gradient buffers (Megatron DDP's flat buffers), optimizer state, fp32
                             # masters (the distributed optimizer's shards or Float16Optimizer's copies), the frozen
                             # reference -> host memory; the weight-sync buffers freed; GPU storage released
    moved = onload(actor)    # the same tensors back, into the same storages (every view stays valid)
    targets = offload_targets(actor)   # what a phase can leave behind, by kind (tests count it on CPU)

Megatron's DDP keeps every parameter and main_grad as a view of a few flat buffers (`param_data`, `grad_data` per
bucket group), so the buffers' storages are resized to 0 and back instead of re-pointing each parameter: views,
the optimizer's parameter references and the DDP hooks all keep working.

On the CPU runtime the state already lives in host memory, beside the engines: nothing moves, and `offload` frees what
generation does not need instead. The gradient buffers go (every update zeroes them before its first backward, so
their values are dead once the optimizer has stepped; `onload` gives them back zeroed), the weight-sync buckets go,
and the heap's free pages (the step's activations, kept in glibc's arenas) are handed back to the system.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def _optimizers(actor: Any) -> list[Any]:
    return list(getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]))


def offload_targets(actor: Any) -> dict[str, list]:
    """Everything of the rank's training state that generation does not need, by kind:

    ddp_buffers      Megatron DDP's flat param_data / grad_data buffers (tensors whose storage is resized)
    optimizer_state  (state dict, key) of every optimizer state tensor (Adam's moments), swapped in place
    master_params    fp32 master parameters: the distributed optimizer's `shard_fp32_from_float16_groups`,
                     Float16OptimizerWithFloat16Params' `fp32_from_float16_groups` (fp32 models have none: their
                     masters are views of the param buffer, moved with it)
    reference        the frozen reference model's parameters (when resident: actor/reference.py)
    """
    buffers = [
        t
        for buffer in _ddp_buffers(actor)
        for t in (getattr(buffer, "param_data", None), getattr(buffer, "grad_data", None))
        if t is not None
    ]
    state, masters = [], []
    for opt in _optimizers(actor):
        inner = getattr(opt, "optimizer", None)
        for values in inner.state.values() if inner is not None else []:
            state.extend((values, k) for k, v in values.items() if torch.is_tensor(v) and v.dim() > 0)
        for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            masters.extend(p for group in getattr(opt, name, None) or [] for p in group if p is not None)
    # a reference on the host (actor.ref_placement=host) has nothing on the device
    reference = actor.reference.device_tensors() if getattr(actor, "reference", None) is not None else []
    return {"ddp_buffers": buffers, "optimizer_state": state, "master_params": masters, "reference": reference}


def target_bytes(targets: dict[str, list]) -> dict[str, int]:
    """Bytes of each kind of `offload_targets`."""
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    return {
        "ddp_buffers": sum(size(t) for t in targets["ddp_buffers"]),
        "optimizer_state": sum(size(c[k]) for c, k in targets["optimizer_state"]),
        "master_params": sum(size(p) for p in targets["master_params"]),
        "reference": sum(size(p) for p in targets["reference"]),
    }


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy (asynchronous D2H: the caller synchronises once for all of them)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def offload(actor: Any) -> dict[str, int]:
    """Move the rank's training state to host memory; returns {"bytes": moved, <kind>: bytes, "sync_buffers": freed}.
    On the CPU runtime: {"bytes": 0, "freed": bytes, "grad_buffers": ..., "sync_buffers": ...} (module docstring)."""
    if actor.runtime != "cuda":
        return _free_on_host(actor)
    if getattr(actor, "_offloaded", None):
        return {"bytes": 0}
    targets = offload_targets(actor)
    saved = [(t, _host(t)) for t in targets["ddp_buffers"] if t.is_cuda and t.untyped_storage().size()]
    for container, key in targets["optimizer_state"]:
        if container[key].is_cuda:
            container[key] = _host(container[key])
    for param in targets["master_params"] + targets["reference"]:
        if param.data.is_cuda:
            param.data = _host(param.data)
    torch.cuda.synchronize()  # every D2H copy done before the GPU storage goes
    for tensor, _ in saved:
        tensor.untyped_storage().resize_(0)
    out = {"bytes": 0, **target_bytes(targets)}
    out["bytes"] = sum(out[k] for k in ("ddp_buffers", "optimizer_state", "master_params", "reference"))
    if getattr(getattr(actor, "_sync", None), "executor", None) is not None:
        out["sync_buffers"] = _release_sync_buffers(actor)
    torch.cuda.empty_cache()
    actor._offloaded = saved
    return out


def _ddp_buffers(actor: Any) -> list[Any]:
    """Megatron DDP's flat buffers of every model chunk (dense and expert-parallel), each holding `param_data` and
    `grad_data` (every parameter and main_grad is a view of one)."""
    return [
        buffer
        for ddp in actor.ddp_chunks
        for buffer in list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    ]


def _release_sync_buffers(actor: Any) -> int:
    """Free the weight-sync buckets (the next sync allocates them again: actor/sync_sender.py); their bytes."""
    executor = getattr(getattr(actor, "_sync", None), "executor", None)
    if executor is None:
        return 0
    nbytes = int(getattr(executor, "resident_bytes", 0))
    executor.release()
    return nbytes


def _free_on_host(actor: Any) -> dict[str, int]:
    """CPU runtime `offload`: free the gradient buffers and the sync buckets, and return the heap's free pages."""
    from mcore_rl.parallel.cpu_runtime import return_freed_memory

    if getattr(actor, "_grads_freed", None):
        return {"bytes": 0, "freed": 0}
    grads = [
        (b.grad_data, b.grad_data.untyped_storage().size())
        for b in _ddp_buffers(actor)
        if getattr(b, "grad_data", None) is not None and b.grad_data.untyped_storage().size()
    ]
    for tensor, _ in grads:
        tensor.untyped_storage().resize_(0)
    actor._grads_freed = grads
    out = {"bytes": 0, "grad_buffers": sum(n for _, n in grads), "sync_buffers": _release_sync_buffers(actor)}
    return_freed_memory()
    out["freed"] = out["grad_buffers"] + out["sync_buffers"]
    return out


def onload(actor: Any) -> dict[str, int]:
    """Bring the state offloaded by `offload` back onto the rank's GPU; returns {"bytes": moved}. On the CPU
    runtime: the gradient buffers freed there, allocated again and zeroed ({"bytes": 0})."""
    grads = getattr(actor, "_grads_freed", None)
    if grads:
        for tensor, nbytes in grads:
            tensor.untyped_storage().resize_(nbytes)
            tensor.zero_()
        actor._grads_freed = None
    saved = getattr(actor, "_offloaded", None)
    if actor.runtime != "cuda" or not saved:
        return {"bytes": 0}
    device = torch.device("cuda", torch.cuda.current_device())
    moved = 0
    for tensor, host in saved:
        tensor.untyped_storage().resize_(host.numel() * host.element_size())
        tensor.copy_(host, non_blocking=True)
        moved += host.numel() * host.element_size()
    targets = offload_targets(actor)
    for container, key in targets["optimizer_state"]:
        if not container[key].is_cuda:
            moved += container[key].numel() * container[key].element_size()
            container[key] = container[key].to(device, non_blocking=True)
    for param in targets["master_params"] + targets["reference"]:
        if not param.data.is_cuda:
            param.data = param.data.to(device, non_blocking=True)
            moved += param.numel() * param.element_size()
    torch.cuda.synchronize()
    actor._offloaded = None
    return {"bytes": moved}
