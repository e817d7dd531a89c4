"""Colocated placement: an actor rank's training state leaves the GPU while the engines generate, and comes back.

    moved = offload(actor)   # parameters + gradient buffers (Megatron DDP's flat buffers), optimizer state,
                             # the frozen reference -> pinned host memory; GPU storage freed
    moved = onload(actor)    # the same tensors back, into the same storages (every view stays valid)

Megatron's DDP keeps every parameter and main_grad as a view of a few flat buffers (`param_data`, `grad_data` per
bucket group), so the buffers' storages are resized to 0 and back instead of re-pointing each parameter: views,
the optimizer's parameter references and the DDP hooks all keep working. On the CPU runtime everything already
lives in host memory: both calls are no-ops that say so once in the log.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def _flat_buffers(actor: Any) -> list[torch.Tensor]:
    out = []
    for ddp in actor.ddp_chunks:
        for buffer in list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", [])):
            for name in ("param_data", "grad_data"):
                tensor = getattr(buffer, name, None)
                if tensor is not None and tensor.is_cuda:
                    out.append(tensor)
    return out


def _optimizer_tensors(actor: Any) -> list[tuple[dict, str]]:
    """(state dict, key) of every optimizer state tensor (Adam's moments), so it can be swapped in place."""
    out = []
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in inner.state.values() if inner is not None else []:
            out.extend((state, k) for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)
    return out


def offload(actor: Any) -> dict[str, int]:
    """Move the rank's training state to host memory; returns {"bytes": moved}."""
    if actor.runtime != "cuda":
        if not getattr(actor, "_offload_logged", False):
            log.warning("actor offload: CPU runtime, the state is already in host memory (no-op)")
            actor._offload_logged = True
        return {"bytes": 0}
    if getattr(actor, "_offloaded", None):
        return {"bytes": 0}
    moved, saved = 0, []
    for tensor in _flat_buffers(actor):
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        saved.append((tensor, host))
        moved += tensor.numel() * tensor.element_size()
    torch.cuda.synchronize()
    for tensor, _ in saved:
        tensor.untyped_storage().resize_(0)
    for container, key in _optimizer_tensors(actor):
        value = container[key]
        if value.is_cuda:
            moved += value.numel() * value.element_size()
            container[key] = value.to("cpu", non_blocking=True)
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for group in getattr(opt, "fp32_from_float16_groups", []):
            for param in group:
                moved += param.numel() * param.element_size()
                param.data = param.data.to("cpu", non_blocking=True)
    for chunk in actor.ref_chunks:
        for param in chunk.parameters():
            moved += param.numel() * param.element_size()
            param.data = param.data.to("cpu", non_blocking=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    actor._offloaded = saved
    return {"bytes": moved}


def onload(actor: Any) -> dict[str, int]:
    """Bring the state offloaded by `offload` back onto the rank's GPU; returns {"bytes": moved}."""
    saved = getattr(actor, "_offloaded", None)
    if actor.runtime != "cuda" or not saved:
        return {"bytes": 0}
    device = torch.device("cuda", torch.cuda.current_device())
    moved = 0
    for tensor, host in saved:
        tensor.untyped_storage().resize_(host.numel() * host.element_size())
        tensor.copy_(host, non_blocking=True)
        moved += host.numel() * host.element_size()
    for container, key in _optimizer_tensors(actor):
        if not container[key].is_cuda:
            moved += container[key].numel() * container[key].element_size()
            container[key] = container[key].to(device, non_blocking=True)
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for group in getattr(opt, "fp32_from_float16_groups", []):
            for param in group:
                param.data = param.data.to(device, non_blocking=True)
                moved += param.numel() * param.element_size()
    for chunk in actor.ref_chunks:
        for param in chunk.parameters():
            param.data = param.data.to(device, non_blocking=True)
            moved += param.numel() * param.element_size()
    torch.cuda.synchronize()
    actor._offloaded = None
    return {"bytes": moved}
