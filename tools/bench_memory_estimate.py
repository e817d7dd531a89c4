"""The dry run's memory estimate (models/estimate.py, as launch/submit.py --dry-run prints it for the recipe: its
`actor_estimate`) against what the actor's Megatron ranks really hold, term by term, as ratios (target
0.8-1.25).

    python tools/bench_memory_estimate.py                        # the default job (configs/default.yaml), 2 gloo ranks
    python tools/bench_memory_estimate.py --preset wide          # a wider, deeper model where the weights dominate
    python tools/bench_memory_estimate.py --mmap-threshold 131072   # the allocator experiment (below)
    python tools/bench_memory_estimate.py [--recipe NAME] [--json FILE] -- model.dtype=bfloat16 ...   # Hydra overrides

Each rank is the real actor (MegatronActor on the CPU runtime, the recipe's layout, optimizer and micro-batches) fed
a batch at the estimate's own assumption: full-length sequences (model.max_sequence_length tokens; the longest
micro-batch a run can build), each one prompt token and a response to the end (the loss reads the logits of response
positions: its largest footprint). As a step does, it computes the old policy's logprobs
(actor.logprob_micro_batch_size at a time), then updates. What is measured per rank:

- tensor level, exact: unique storages of the policy's parameters (weights), of their main grads (DDP's grad
  buffers), of the optimizer's fp32 masters and Adam state (after a first update, Adam's state is lazy), of the
  reference model; buffers = Megatron's global memory buffer (the local spec's attention scores), its resident pages;
  activations = the peak of bytes allocated during a third update (torch's CPU memory profiler, "Total Allocated":
  every tensor allocated while profiling, net of those freed), beside the peak of tensors autograd saved for the
  backward (saved_tensors_hooks, parameters excluded);
- process level (tools/process_memory.py): peak RSS (VmHWM) through the build, the logprob pass and the first update,
  and through a second step's logprob pass and update (the run's peak: its forward and backward run beside Adam's
  state, which the first step creates only after its backward), the larger of the two against the estimate's
  training figure, which on the CPU runtime includes the rank's process (models/estimate.py: CPU_PROCESS_IMAGE_MIB +
  CPU_RUNTIME_GROWTH_MIB) and the allocator's slack (CPU_ALLOCATOR_SLACK x the working set); and the same
  without the process image (RSS after imports). The process rows measure those three allowances: the RSS after
  imports, what the rank holds after the first step beyond its tensors and the bytes glibc holds free (of
  it, file-backed pages: library code first touched), and the bytes glibc holds free at the RSS peak (freed tensors
  kept in its arenas, glibc's mallinfo2 sampled at the peak). `--mmap-threshold BYTES` sets glibc's M_MMAP_THRESHOLD
  in the ranks (the project's ranks do not): every allocation from that size up is its own mapping, returned to the
  kernel when freed, which shows that slack is the allocator's (the estimate still counts it, so the ratio drops).

The same per-rank tensor counts (`rank_tensor_bytes`) serve tools/gpu_smoke's memory step, which adds CUDA's peak
allocated.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python tools/bench_memory_estimate.py`: tools.process_memory and mcore_rl from here
    sys.path.insert(0, str(REPO))

from tools.process_memory import (  # noqa: E402
    RssPeakSampler,
    malloc_info,
    peak_rss_bytes,
    reset_peak_rss,
    resident_bytes,
    rss_bytes,
    rss_parts,
    set_mmap_threshold,
)

MIB = 2**20
#: --preset wide: a model whose weights and optimizer dominate a rank (about 60 M parameters per rank, short sequences)
WIDE = [
    "model.hf_config.hidden_size=1024", "model.hf_config.intermediate_size=2048",
    "model.hf_config.moe_intermediate_size=1024", "model.hf_config.num_hidden_layers=4",
    "model.hf_config.num_attention_heads=16", "model.hf_config.num_key_value_heads=4", "model.hf_config.head_dim=64",
    "model.hf_config.num_experts=8", "model.max_sequence_length=64", "actor.micro_batch_size=2",
]  # fmt: skip
TERMS = ("weights", "grads", "optimizer", "reference", "buffers", "activations")


# ------------------------------------------------------------------------------------------------ tensor memory
def _storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int], device: str | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (on `device`'s type, or any) not already in `seen` (which is
    updated): views of one buffer (Megatron's DDP grad and param buffers) count once."""
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        if device is not None and t.device.type != device:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside Megatron's (ChainedOptimizer of Float16/FP32/Distributed optimizers)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    parts = chained if chained is not None else [optimizer]
    return [getattr(p, "optimizer", p) for p in parts]


def rank_tensor_bytes(actor: Any, device: str | None = None) -> dict[str, int]:
    """Exact bytes one actor rank holds, by the estimate's terms: weights (the policy's parameters and buffers),
    grads (main grads: DDP's fp32 grad buffers), optimizer (fp32 masters + Adam state), reference (the frozen copy's
    parameters, or its host copies with actor.ref_placement=host), buffers (Megatron's global memory buffer); only
    tensors on `device` ("cuda": what the GPU holds) or all. Call after an update: Adam creates its state at the first
    step."""
    seen: set[int] = set()
    count = lambda tensors: _storage_bytes(tensors, seen, device)  # noqa: E731
    params = [p for chunk in actor.chunks for p in chunk.parameters()]
    weights = count(params) + count(b for chunk in actor.chunks for b in chunk.buffers())
    grads = count(getattr(p, "main_grad", None) for p in params) + count(p.grad for p in params)
    optimizer = 0
    for inner in _inner_optimizers(actor.optimizer):
        # fp32 masters: the optimizer's own parameters that are not the model's (16-bit weights); states: Adam's
        optimizer += count(p for group in inner.param_groups for p in group["params"])
        optimizer += count(v for state in inner.state.values() for v in state.values())
    reference = count(p for chunk in getattr(actor, "ref_chunks", []) for p in chunk.parameters())
    # actor.ref_placement=host (actor/reference.py): the reference's and the parked policy's host copies
    held = getattr(actor, "reference", None)
    reference += count([*getattr(held, "_ref", []), *getattr(held, "_park", [])])
    return {"weights": weights, "grads": grads, "optimizer": optimizer, "reference": reference,
            "buffers": megatron_buffer_bytes(device)}  # fmt: skip


def megatron_buffer_bytes(device: str | None = None) -> int:
    """Bytes of Megatron's global memory buffer (the local spec's attention scores among them) that the device
    holds: on CUDA the allocation (committed when made), on the CPU its resident pages (committed on first touch; the
    attention's baddbmm with beta=0 never touches it: models/estimate.py's attention_buffer_bytes)."""
    from megatron.core import parallel_state

    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    total = 0
    for tensor in getattr(buffer, "buffer", {}).values():
        if device is not None and tensor.device.type != device:
            continue
        total += resident_bytes(tensor) if tensor.device.type == "cpu" else tensor.untyped_storage().nbytes()
    return total


class SavedTensorPeak:
    """Peak bytes of the tensors autograd saves for the backward while active (storages counted once; `exclude`:
    storage pointers not to count, the parameters), released as autograd frees them."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude, self.live, self.current, self.peak = exclude, {}, 0, 0

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if not key or key in self.exclude:
            return t
        if key in self.live:
            self.live[key][1] += 1
        else:
            self.live[key] = [storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        return _Saved(self, key, t)

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda s: s.tensor if isinstance(s, _Saved) else s)


class _Saved:
    """A saved tensor as autograd holds it; its end (autograd frees the graph) releases its bytes."""

    __slots__ = ("owner", "key", "tensor")

    def __init__(self, owner: SavedTensorPeak, key: int, tensor: torch.Tensor) -> None:
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self) -> None:
        self.owner.release(self.key)


def profiled_peak(fn: Callable[[], Any], trace: str) -> tuple[Any, int]:
    """fn()'s result and the peak of CPU bytes it held allocated (torch's memory profiler: tensors allocated while
    profiling, net of those freed; `trace` is the chrome trace written to read them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(trace)
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"
              and e["args"].get("Device Type") == 0]  # fmt: skip
    return result, max(totals, default=0)


# ------------------------------------------------------------------------------------------------ one rank
def full_length_batch(batch_size: int, seq_len: int, vocab: int, seed: int = 0) -> Any:
    """`batch_size` samples of `seq_len` tokens in all (the actor adds one target position: prompt + response =
    seq_len - 1), with old logprobs and advantages, so an update runs at the longest micro-batch of a run. One prompt
    token, the rest response: the loss reads the logits of response positions, so this is its largest footprint (the
    estimate's bound)."""
    from mcore_rl.actor.batch import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    prompt = 1
    response = max(1, seq_len - 1 - prompt)
    ids = torch.randint(1, vocab, (batch_size, prompt + response), generator=gen)
    batch = TrainBatch([row.tolist() for row in ids[:, :prompt]], ids[:, prompt:].clone(),
                       torch.ones(batch_size, response))  # fmt: skip
    batch.tensors.update(old_logprobs=-torch.rand(batch_size, response, generator=gen),
                         advantages=torch.randn(batch_size, response, generator=gen))  # fmt: skip
    return batch


def measure_rank(
    rank: int, world_size: int, model_cfg: Any, actor_cfg: Any, batch_size: int, mmap_threshold: int | None = None
) -> dict[str, Any]:
    """One actor rank (parallel/harness.py's run_on_ranks): RSS baseline, build, a step's passes (the old policy's
    logprobs, then an update), one more profiled update; the module doc's figures in bytes. `mmap_threshold`: glibc's
    M_MMAP_THRESHOLD for this rank (tools/process_memory.py), the experiment of --mmap-threshold."""
    from mcore_rl.actor.megatron_actor import MegatronActor

    threshold_set = set_mmap_threshold(mmap_threshold) if mmap_threshold else False
    gc.collect()
    reset = reset_peak_rss()
    baseline, base_parts, base_malloc = rss_bytes(), rss_parts(), malloc_info()
    actor = MegatronActor(rank, world_size, model_cfg, actor_cfg, runtime="cpu")
    actor.initialize(("127.0.0.1", 0))  # torch.distributed is up already (the harness): the address is not used
    built = rss_bytes()
    vocab = int(actor.vocab_size)
    batch = full_length_batch(batch_size, model_cfg.max_sequence_length, vocab)
    with RssPeakSampler() as sampler:
        actor.logprobs(batch)  # as a step starts: the old policy's logprobs, logprob_micro_batch_size at a time
        actor.update(batch)  # the first update creates Adam's state
    first_peak = peak_rss_bytes()  # before the profiler and the hooks add their own bookkeeping
    gc.collect()
    after, after_parts, after_malloc = rss_bytes(), rss_parts(), malloc_info()
    tensors = rank_tensor_bytes(actor)
    # A second step, unprofiled: every step after the first runs its forward and backward with Adam's state already
    # allocated (the first creates it in its optimizer step, after the backward has freed the activations), so its
    # peak is the run's; the first's is lower by up to the optimizer term (1 GiB on configs/smollm2_arith.yaml).
    reset_peak_rss()
    batch = full_length_batch(batch_size, model_cfg.max_sequence_length, vocab, seed=2)
    with RssPeakSampler() as steady_sampler:
        actor.logprobs(batch)
        actor.update(batch)
    steady_peak = peak_rss_bytes() if reset else steady_sampler.peak
    params = {p.untyped_storage().data_ptr() for chunks in (actor.chunks, actor.ref_chunks)
              for chunk in chunks for p in chunk.parameters()}  # fmt: skip
    saved = SavedTensorPeak(params)
    batch = full_length_batch(batch_size, model_cfg.max_sequence_length, vocab, seed=1)
    with saved.hooks():
        _, peak = profiled_peak(lambda: actor.update(batch), f"/tmp/bench_memory_{os.getpid()}.json")
    freed = lambda m: (m or {}).get("free", 0) - (base_malloc or {}).get("free", 0)  # noqa: E731
    held = sum(tensors[t] for t in ("weights", "grads", "optimizer", "reference", "buffers"))
    return {
        **tensors,
        "activations": peak,
        "saved_for_backward": saved.peak,
        "rss_baseline": baseline,
        "rss_built": built,
        "rss_peak_first_update": first_peak,
        "rss_peak_steady_update": steady_peak,
        "rss_after_first_update": after,
        "rss_peak": peak_rss_bytes(),
        "rss_peak_reset": reset,
        # the process's own part (module doc): after the first step, what is resident beyond the tensors held and
        # beyond the bytes glibc holds free
        "file_growth": after_parts["file"] - base_parts["file"],
        "anon_growth": after_parts["anon"] - base_parts["anon"],
        "malloc_free_after": freed(after_malloc),
        "malloc_free_at_peak": freed(sampler.at_peak.get("malloc")),
        "malloc_free_at_steady_peak": freed(steady_sampler.at_peak.get("malloc")),
        "runtime_growth": after - baseline - held - freed(after_malloc),
        "mmap_threshold_set": threshold_set,
    }


# ------------------------------------------------------------------------------------------------ the driver
def dry_run_estimate(cfg: Any) -> Any:
    """The actor's MemoryEstimate as `launch/submit.py --dry-run` prints it for this recipe (its `actor_estimate`:
    the runtime's allowance, the attention the ranks build)."""
    if str(REPO / "launch") not in sys.path:
        sys.path.insert(0, str(REPO / "launch"))
    import submit

    return submit.actor_estimate(cfg)


def compare(est: Any, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per term: the estimate, the fullest rank's measurement, estimate / measured; totals at tensor and RSS level;
    the CPU rank process's allowance against what the ranks' processes hold besides tensors."""
    from mcore_rl.models.estimate import CPU_PROCESS_IMAGE_MIB, CPU_RUNTIME_GROWTH_MIB

    estimate = {
        "weights": est.weights,
        "grads": est.grads,
        "optimizer": est.optimizer + est.optimizer_host,
        "reference": est.reference + est.reference_host,
        "buffers": est.buffers,
        "activations": est.working,
    }  # fmt: skip  (activations, or gloo's grad-reduce copy if larger)
    fullest = max(ranks, key=lambda r: sum(r[t] for t in TERMS))
    rows = {t: {"estimate": estimate[t], "measured": fullest[t],
                "ratio": estimate[t] / fullest[t] if fullest[t] and estimate[t] else None} for t in TERMS}  # fmt: skip
    tensor_estimate = sum(estimate.values())
    tensor_total = sum(fullest[t] for t in TERMS)
    image = CPU_PROCESS_IMAGE_MIB * MIB
    # the peak of the unprofiled steps (the profiled update adds its own bookkeeping): a later step's, once Adam's
    # state exists, unless the first's is higher
    step_peak = lambda r: max(r["rss_peak_first_update"], r["rss_peak_steady_update"])  # noqa: E731
    top = max(ranks, key=step_peak)
    steady = top["rss_peak_steady_update"] >= top["rss_peak_first_update"]
    peak = step_peak(top)
    process = {
        "process image (RSS after imports)": (image, top["rss_baseline"]),
        "runtime growth (not tensors, not free)": (CPU_RUNTIME_GROWTH_MIB * MIB, top["runtime_growth"]),
        "  of it file-backed (libraries)": (None, top["file_growth"]),
        "allocator free bytes at the peak": (
            est.allocator_slack,
            top["malloc_free_at_steady_peak" if steady else "malloc_free_at_peak"],
        ),
        "  and held after the step": (None, top["malloc_free_after"]),
    }
    return {
        "terms": rows,
        "saved_for_backward": fullest["saved_for_backward"],
        "estimate_total": tensor_estimate,
        "tensor_total": tensor_total,
        "tensor_ratio": tensor_estimate / tensor_total,
        "process": {k: {"estimate": e, "measured": m} for k, (e, m) in process.items()},
        "estimate_training": est.training,  # tensors + the CPU rank process's allowance
        "rss_peak": peak,
        "rss_peak_first_update": top["rss_peak_first_update"],
        "rss_peak_ratio": est.training / peak,
        "rss_over_baseline": peak - top["rss_baseline"],
        "rss_ratio": (est.training - image) / (peak - top["rss_baseline"]),
        "ranks": ranks,
    }


def table(result: dict[str, Any], title: str) -> str:
    """The comparison as printed: one row per term, the totals, the process's own part."""
    m = lambda b: f"{b / MIB:10.2f}" if b is not None else f"{'-':>10}"  # noqa: E731
    lines = [title, f"{'term':<40}{'estimate MiB':>13}{'measured MiB':>13}{'est/meas':>10}"]
    for term, row in result["terms"].items():
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        lines.append(f"{term:<40}{m(row['estimate']):>13}{m(row['measured']):>13}{ratio:>10}")
    lines += [
        f"{'  (saved for backward)':<40}{'':>13}{m(result['saved_for_backward']):>13}",
        f"{'total (tensors)':<40}{m(result['estimate_total']):>13}{m(result['tensor_total']):>13}"
        f"{result['tensor_ratio']:>10.2f}",
        "process (the fullest rank by peak RSS):",
    ]
    for name, row in result["process"].items():
        lines.append(f"{name:<40}{m(row['estimate']):>13}{m(row['measured']):>13}")
    lines += [
        f"{'peak RSS':<40}{m(result['estimate_training']):>13}{m(result['rss_peak']):>13}"
        f"{result['rss_peak_ratio']:>10.2f}",
        f"{'peak RSS - process image':<40}{m(result['estimate_training'] - result['process'][IMAGE]['estimate']):>13}"
        f"{m(result['rss_over_baseline']):>13}{result['rss_ratio']:>10.2f}",
    ]
    lines.append(f"{'  (the first step, before Adam state)':<40}{'':>13}{m(result['rss_peak_first_update']):>13}")
    per_rank = ", ".join(f"{r['activations'] / MIB:.1f}" for r in result["ranks"])
    lines.append(f"(activations per rank: {per_rank} MiB; MoE ranks differ by the tokens their experts receive)")
    peaks = ", ".join(f"{max(r['rss_peak_first_update'], r['rss_peak_steady_update']) / MIB:.1f}"
                      for r in result["ranks"])  # fmt: skip
    lines.append(f"(peak RSS per rank: {peaks} MiB)")
    if any(r["mmap_threshold_set"] for r in result["ranks"]):
        lines.append("(ranks ran with glibc's M_MMAP_THRESHOLD set: --mmap-threshold)")
    return "\n".join(lines)


IMAGE = "process image (RSS after imports)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="default", help="configs/<recipe>.yaml")
    p.add_argument("--preset", choices=("default", "wide"), default="default", help="wide: the WIDE overrides first")
    p.add_argument("--mmap-threshold", type=int, metavar="BYTES",
                   help="glibc's M_MMAP_THRESHOLD in the ranks (the allocator experiment; the project's ranks do not "
                        "set it)")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("overrides", nargs="*", help="Hydra overrides (after --)")
    args = p.parse_args(argv)
    from mcore_rl.controller.recipe_check import compose_recipe
    from mcore_rl.parallel.harness import run_on_ranks

    overrides = (WIDE if args.preset == "wide" else []) + list(args.overrides)
    cfg = compose_recipe(args.recipe, overrides)
    if cfg.trainer.runtime != "cpu":
        print("bench_memory_estimate runs the CPU runtime: expected trainer.runtime=cpu", file=sys.stderr)
        return 2
    if cfg.actor.recompute.granularity:  # what pre-flight refuses on CPU (mcore_rl/preflight.py)
        print(f"actor.recompute.granularity={cfg.actor.recompute.granularity!r}: Megatron's recompute needs CUDA's RNG "
              "state; expected null on the CPU runtime (the GPU kit measures the GPU)", file=sys.stderr)  # fmt: skip
        return 2
    if args.mmap_threshold is not None and args.mmap_threshold <= 0:
        print(f"--mmap-threshold {args.mmap_threshold}: expected a positive byte count", file=sys.stderr)
        return 2
    est = dry_run_estimate(cfg)
    lay = cfg.actor.layout
    dp = cfg.actor.world_size // (lay.tp * lay.pp * lay.cp)
    batch_size = cfg.actor.micro_batch_size * dp * cfg.actor.mini_batches
    ranks = run_on_ranks(measure_rank, cfg.actor.world_size,
                         (cfg.model, cfg.actor, batch_size, args.mmap_threshold), timeout_s=900)  # fmt: skip
    result = compare(est, ranks)
    title = (f"{' '.join([args.recipe, *overrides])}: actor world {cfg.actor.world_size} (dp {dp}), micro-batch "
             f"{cfg.actor.micro_batch_size} x {cfg.model.max_sequence_length} tokens, {cfg.model.dtype}"
             + (f", M_MMAP_THRESHOLD={args.mmap_threshold}" if args.mmap_threshold else ""))  # fmt: skip
    print(table(result, title))
    if args.json:
        args.json.write_text(json.dumps({"title": title, **result}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
