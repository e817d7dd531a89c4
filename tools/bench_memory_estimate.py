"""The dry run's memory estimate (models/estimate.py, as launch/submit.py --dry-run computes it) against what the
actor's Megatron ranks really allocate, term by term, as ratios (issue 27: target 0.8-1.25).

    python tools/bench_memory_estimate.py                        # the default job (configs/default.yaml), 2 gloo ranks
    python tools/bench_memory_estimate.py --preset wide          # a wider, deeper model where the weights dominate
    python tools/bench_memory_estimate.py [--recipe NAME] [--json FILE] -- model.dtype=bfloat16 ...   # Hydra overrides

Each rank is the real actor (MegatronActor on the CPU runtime, the recipe's layout, optimizer and micro-batch) fed a
batch at the estimate's own assumption: micro-batches of `actor.micro_batch_size` full-length sequences
(model.max_sequence_length tokens; the longest micro-batch a run can build), each one prompt token and a response to
the end (the loss reads the logits of response positions: its largest footprint). What is measured per rank:

- tensor level, exact: unique storages of the policy's parameters (weights), of their main grads (DDP's grad
  buffers), of the optimizer's fp32 masters and Adam state (after a first update, Adam's state is lazy), of the
  reference model; activations = the peak of bytes allocated during a second update (torch's CPU memory profiler,
  "Total Allocated": every tensor allocated while profiling, net of those freed), beside the peak of tensors autograd
  saved for the backward (saved_tensors_hooks, parameters excluded);
- process level: peak RSS (VmHWM, reset once imports are done) through the build and the first update, minus the RSS
  after imports and before the model is built. It includes what tensors do not show (Python objects of the modules,
  gloo buffers, oneDNN scratch, the allocator's slack), so on a tiny model it says little; the wide preset is where
  it means something.

The estimate's CUDA context + NCCL allowance has no CPU counterpart and is left out of the CPU totals. The same
per-rank tensor counts (`rank_tensor_bytes`) serve tools/gpu_smoke's memory step, which adds CUDA's peak allocated.
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
MIB = 2**20
#: --preset wide: a model whose weights and optimizer dominate a rank (about 60 M parameters per rank, short sequences)
WIDE = [
    "model.hf_config.hidden_size=1024", "model.hf_config.intermediate_size=2048",
    "model.hf_config.moe_intermediate_size=1024", "model.hf_config.num_hidden_layers=4",
    "model.hf_config.num_attention_heads=16", "model.hf_config.num_key_value_heads=4", "model.hf_config.head_dim=64",
    "model.hf_config.num_experts=8", "model.max_sequence_length=64", "actor.micro_batch_size=2",
]  # fmt: skip
TERMS = ("weights", "grads", "optimizer", "reference", "activations")


# ------------------------------------------------------------------------------------------------ process memory
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """This process's resident set now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM) since it started or since `reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: '5' into clear_refs); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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
    parameters, or its host copies with actor.ref_placement=host); only tensors on `device` ("cuda": what the GPU
    holds) or all. Call after an update: Adam creates its state at the first step."""
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
    return {"weights": weights, "grads": grads, "optimizer": optimizer, "reference": reference}


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


def measure_rank(rank: int, world_size: int, model_cfg: Any, actor_cfg: Any, batch_size: int) -> dict[str, Any]:
    """One actor rank (parallel/harness.py's run_on_ranks): RSS baseline, build, two updates; the module doc's
    figures in bytes."""
    from mcore_rl.actor.megatron_actor import MegatronActor

    gc.collect()
    reset = reset_peak_rss()
    baseline = rss_bytes()
    actor = MegatronActor(rank, world_size, model_cfg, actor_cfg, runtime="cpu")
    actor.initialize(("127.0.0.1", 0))  # torch.distributed is up already (the harness): the address is not used
    built = rss_bytes()
    vocab = int(actor.vocab_size)
    batch = full_length_batch(batch_size, model_cfg.max_sequence_length, vocab)
    actor.update(batch)  # the first step creates Adam's state
    first_peak = peak_rss_bytes()  # before the profiler and the hooks add their own bookkeeping
    tensors = rank_tensor_bytes(actor)
    params = {p.untyped_storage().data_ptr() for chunks in (actor.chunks, actor.ref_chunks)
              for chunk in chunks for p in chunk.parameters()}  # fmt: skip
    saved = SavedTensorPeak(params)
    batch = full_length_batch(batch_size, model_cfg.max_sequence_length, vocab, seed=1)
    with saved.hooks():
        _, peak = profiled_peak(lambda: actor.update(batch), f"/tmp/bench_memory_{os.getpid()}.json")
    return {
        **tensors,
        "activations": peak,
        "saved_for_backward": saved.peak,
        "rss_baseline": baseline,
        "rss_built": built,
        "rss_peak_first_update": first_peak,
        "rss_peak": peak_rss_bytes(),
        "rss_peak_reset": reset,
    }


# ------------------------------------------------------------------------------------------------ the driver
def dry_run_estimate(cfg: Any, fused_attention: bool = True) -> Any:
    """The actor's MemoryEstimate as launch/submit.py --dry-run computes it (its `_estimate`, so every argument is the
    dry run's), for ranks whose attention is fused (TE's flash attention, what a CUDA dry run assumes) or not (the
    local spec these CPU ranks run: `fused_attention=False` is handed to estimate_memory for this one call)."""
    import functools

    import mcore_rl.models.estimate as estimate

    if str(REPO / "launch") not in sys.path:
        sys.path.insert(0, str(REPO / "launch"))
    import submit

    original = estimate.estimate_memory
    estimate.estimate_memory = functools.partial(original, fused_attention=fused_attention)
    try:
        return submit._estimate(cfg, cfg.actor, submit._hf_dict(cfg), None, use_ref=cfg.actor.use_ref)
    finally:
        estimate.estimate_memory = original


def compare(est: Any, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per term: the estimate, the fullest rank's measurement, estimate / measured; totals at tensor and RSS level."""
    estimate = {"weights": est.weights, "grads": est.grads, "optimizer": est.optimizer + est.optimizer_host,
                "reference": est.reference + getattr(est, "reference_host", 0.0),
                "activations": est.activations}  # fmt: skip
    fullest = max(ranks, key=lambda r: sum(r[t] for t in TERMS))
    rows = {t: {"estimate": estimate[t], "measured": fullest[t],
                "ratio": estimate[t] / fullest[t] if fullest[t] else None} for t in TERMS}  # fmt: skip
    cpu_total = sum(estimate.values())  # est.training without the CUDA context allowance
    tensor_total = sum(fullest[t] for t in TERMS)
    rss = max(r["rss_peak_first_update"] - r["rss_baseline"] for r in ranks)  # the profiled update adds its own
    return {
        "terms": rows,
        "saved_for_backward": fullest["saved_for_backward"],
        "estimate_total": cpu_total,
        "tensor_total": tensor_total,
        "tensor_ratio": cpu_total / tensor_total,
        "rss_over_baseline": rss,
        "rss_ratio": cpu_total / rss,
        "ranks": ranks,
    }


def table(result: dict[str, Any], title: str) -> str:
    m = lambda b: f"{b / MIB:10.2f}"  # noqa: E731
    lines = [title, f"{'term':<22}{'estimate MiB':>13}{'measured MiB':>13}{'est/meas':>10}"]
    for term, row in result["terms"].items():
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        lines.append(f"{term:<22}{m(row['estimate']):>13}{m(row['measured']):>13}{ratio:>10}")
    lines += [
        f"{'  (saved for backward)':<22}{'':>13}{m(result['saved_for_backward']):>13}",
        f"{'total (tensors)':<22}{m(result['estimate_total']):>13}{m(result['tensor_total']):>13}"
        f"{result['tensor_ratio']:>10.2f}",
        f"{'peak RSS - baseline':<22}{m(result['estimate_total']):>13}{m(result['rss_over_baseline']):>13}"
        f"{result['rss_ratio']:>10.2f}",
    ]
    per_rank = ", ".join(f"{r['activations'] / MIB:.1f}" for r in result["ranks"])
    lines.append(f"(activations per rank: {per_rank} MiB; MoE ranks differ by the tokens their experts receive)")
    base = max(r["rss_baseline"] for r in result["ranks"])
    lines.append(f"(RSS after imports {base / MIB:.0f} MiB per rank; CUDA context allowance of the estimate left out)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="default", help="configs/<recipe>.yaml")
    p.add_argument("--preset", choices=("default", "wide"), default="default", help="wide: the WIDE overrides first")
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
    from mcore_rl.models.spec import te_in_use

    est = dry_run_estimate(cfg, fused_attention=te_in_use("cpu"))
    lay = cfg.actor.layout
    dp = cfg.actor.world_size // (lay.tp * lay.pp * lay.cp)
    batch_size = cfg.actor.micro_batch_size * dp * cfg.actor.mini_batches
    ranks = run_on_ranks(measure_rank, cfg.actor.world_size, (cfg.model, cfg.actor, batch_size), timeout_s=900)
    result = compare(est, ranks)
    title = (f"{' '.join([args.recipe, *overrides])}: actor world {cfg.actor.world_size} (dp {dp}), micro-batch "
             f"{cfg.actor.micro_batch_size} x {cfg.model.max_sequence_length} tokens, {cfg.model.dtype}")  # fmt: skip
    print(table(result, title))
    if args.json:
        args.json.write_text(json.dumps({"title": title, **result}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
