"""The memory part of the kit's actor steps: the dry run's estimate (models/estimate.py) for the kit's shapes against
what the rank allocates, term by term, as ratios (the target: 0.8-1.25).

    weights, grads, optimizer, reference   exact bytes of the rank's storages on the device (CUDA, or the CPU with
                                           --dry-cpu): tools/bench_memory_estimate.py's rank_tensor_bytes
    buffers                                Megatron's global memory buffer (the local spec's attention scores,
                                           b x heads x s^2, kept between passes): allocated on CUDA; on the CPU its
                                           resident pages (never touched: none)
    activations                            one more update: CUDA's peak allocated minus what was allocated before it
                                           (on the CPU, the profiler's peak of bytes allocated during it)
    peak                                   CUDA's peak allocated through that update against the estimate's training
                                           figure without the CUDA context allowance (the allocator does not see it)

The estimate is made as the dry run makes it, with the attention the rank runs: TE's fused attention where Transformer
Engine is in use, else the local spec's unfused attention (models/estimate.py: fused_attention).
"""

from __future__ import annotations

from typing import Any

import torch

TERMS = ("weights", "grads", "optimizer", "reference", "buffers", "activations")


def measure(actor: Any, batch: Any, hf: dict[str, Any], seq_len: int, dry: bool) -> dict[str, Any]:
    """Run one update of `batch` on `actor` (world 1) and return the estimate, the measurement and their ratios."""
    from mcore_rl.models.estimate import estimate_memory
    from mcore_rl.models.spec import te_in_use
    from tools.bench_memory_estimate import profiled_peak, rank_tensor_bytes

    runtime = "cpu" if dry else "cuda"
    cfg = actor.cfg
    est = estimate_memory(
        hf, 1, tp=1, pp=1, micro_batch=cfg.micro_batch_size, seq_len=seq_len, plan=actor.optim_plan,
        recompute=cfg.recompute, use_ref=cfg.use_ref, overhead_gib=0.0,
        ref_placement=actor.reference.placement if actor.reference is not None else "resident",
        fused_attention=te_in_use(runtime), runtime=runtime,
        logprob_micro_batch=getattr(cfg, "logprob_micro_batch_size", None),
    )  # fmt: skip
    measured: dict[str, float] = dict(rank_tensor_bytes(actor, device=runtime))
    if dry:
        _, measured["activations"] = profiled_peak(lambda: actor.update(batch), "/tmp/gpu_smoke_memory_trace.json")
        peak = None
    else:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        actor.update(batch)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        measured["activations"] = peak - before
    # on the device only: the offloaded optimizer share and a host-placed reference are host memory
    estimate = {"weights": est.weights, "grads": est.grads, "optimizer": est.optimizer, "reference": est.reference,
                "buffers": est.buffers, "activations": est.working}  # fmt: skip
    terms = {t: {"estimate": estimate[t], "measured": measured[t],
                 "ratio": round(estimate[t] / measured[t], 3) if measured[t] else None} for t in TERMS}  # fmt: skip
    total = sum(estimate.values())
    out: dict[str, Any] = {"terms": terms, "estimate_bytes": total, "fused_attention": te_in_use(runtime)}
    if peak is not None:
        out.update(peak_allocated_bytes=peak, estimate_over_peak=round(total / peak, 3))
    else:  # the CPU has no allocator peak: the sum of the exact terms stands in for it
        out["estimate_over_tensors"] = round(total / sum(measured[t] for t in TERMS), 3)
    return out


def summary(memory: dict[str, Any]) -> str:
    """One phrase for the kit's table: estimate / peak (or / tensors on the CPU), and the activations' ratio."""
    ratio = memory.get("estimate_over_peak", memory.get("estimate_over_tensors"))
    what = "peak allocated" if "estimate_over_peak" in memory else "tensors"
    act = memory["terms"]["activations"]["ratio"]
    flag = "" if ratio is not None and 0.8 <= ratio <= 1.25 else " (outside 0.8-1.25)"
    return f"memory estimate/{what} {ratio:.2f}{flag}, activations {act if act is None else f'{act:.2f}'}"
