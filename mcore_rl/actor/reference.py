"""The actor's frozen reference model: where its weights live, and how a reference pass reaches them.

    reference = build_reference(actor, placement)     # after the policy is built, loaded and wrapped (same weights)
    with reference.weights_in(actor) as chunks:       # model chunks that hold the reference's weights in the block
        logprobs = forward(chunks)
    with reference.weights_in(actor, writeback=True) as chunks:
        load_into(chunks)                             # checkpoint resume: what is loaded becomes the reference
    reference.device_tensors()                        # what colocated offload moves (actor/offload.py)

`actor.ref_placement` chooses (null: `resolve_placement`):

resident  a second Megatron model (a GPTModel per virtual stage) built like the policy, loaded from it and frozen.
          A reference pass is a forward through it; it costs one more model's weights on the device.
host      the reference's weights (every tensor of the policy chunks' state dicts: parameters and persistent buffers
          such as DeepSeek-V3's expert bias) in host memory, pinned on CUDA. A reference pass parks the policy's
          weights in a second host buffer (D2H), copies the reference's into the policy's own parameters (H2D), runs
          the policy's chunks, and copies the policy's weights back (H2D): three transfers of the rank's weights per
          pass, on the current stream (ordered with the forward), and one model's weights on the device, as slime's
          TensorBackuper keeps "actor" and "ref" on the host. With the distributed optimizer the parameters are views
          of DDP's flat buffers, which are copied whole (`swap_tensors`). The copies are plain `copy_` into the same
          tensors, so every view (the parameters in DDP's buffer, the optimizer's references) stays valid and the
          policy comes back to the bit. The host holds two copies of the rank's weights (reference, parked policy).

The forward of a reference pass is the same module code on the same weights in both placements, so reference
logprobs are bit-identical (tests/test_reference_swap.py). Forward-only passes run under no_grad: Megatron's router
counts tokens for the expert-bias update only with grad enabled, so the reference pass leaves the policy's counters
alone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

#: placement -> what holds the reference (the registry config/names.py's REF_PLACEMENTS mirrors)
PLACEMENTS: dict[str, type] = {}


def resolve_placement(placement: str | None, runtime: str) -> str:
    """`actor.ref_placement`, with null resolved: host on CUDA (a second model costs as much device memory as the
    weights, which a large MoE cannot spare), resident on the CPU runtime (its device is host memory: a host copy
    and the parked policy would cost twice the memory the second model does)."""
    if placement is None:
        return "host" if runtime == "cuda" else "resident"
    if placement not in PLACEMENTS:
        raise ValueError(f"actor.ref_placement={placement!r} is invalid: expected one of {tuple(PLACEMENTS)}")
    return placement


def model_tensors(chunks: list[torch.nn.Module]) -> list[torch.Tensor]:
    """Every tensor of `chunks`' state dicts (parameters and persistent buffers, not Transformer Engine's
    `_extra_state`), the live objects, once each (tied weights appear under two names), in state-dict order."""
    seen: set[int] = set()
    out = []
    for chunk in chunks:
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            if torch.is_tensor(tensor) and not name.endswith("_extra_state") and id(tensor) not in seen:
                seen.add(id(tensor))
                out.append(tensor)
    return out


def swap_tensors(actor: Any) -> list[torch.Tensor]:
    """What a swap copies: Megatron DDP's flat parameter buffers where the distributed optimizer keeps the parameters
    as views of them (a few large copies instead of one per tensor: full PCIe bandwidth, few launches), and every
    other tensor of the chunks' state dicts (all of them without the distributed optimizer, where DDP keeps no
    parameter buffer; persistent buffers such as the expert bias)."""
    flat = [
        buffer.param_data
        for ddp in getattr(actor, "ddp_chunks", [])
        for buffer in list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
        if getattr(buffer, "param_data", None) is not None
    ]
    inside = {t.untyped_storage().data_ptr() for t in flat}
    return flat + [t for t in model_tensors(actor.chunks) if t.untyped_storage().data_ptr() not in inside]


class ResidentReference:
    """A second, frozen model on the device (the placement `resident`)."""

    placement = "resident"

    def __init__(self, actor: Any) -> None:
        from mcore_rl.models.builder import build_gpt_chunks

        # Building initialises weights from the RNG streams; the reference is overwritten right away, so the streams
        # are put back as they were: a run draws the same random numbers with either placement.
        with _rng_preserved(actor.runtime):
            self.chunks, _ = build_gpt_chunks(actor.spec, actor.pg)
        for ref, policy in zip(self.chunks, actor.chunks):
            ref.load_state_dict(policy.state_dict())
            ref.requires_grad_(False)
            ref.eval()

    @contextlib.contextmanager
    def weights_in(self, actor: Any, writeback: bool = False) -> Iterator[list[torch.nn.Module]]:
        """The reference's own chunks (`writeback` needs nothing: loading into them is the reference)."""
        yield self.chunks

    def device_tensors(self) -> list[torch.Tensor]:
        """The reference's parameters: what colocated offload moves to the host and back."""
        return [p for chunk in self.chunks for p in chunk.parameters()]


class HostReference:
    """The reference's weights in host memory, swapped into the policy's model for each pass (placement `host`)."""

    placement = "host"

    def __init__(self, actor: Any) -> None:
        pin = actor.runtime == "cuda"  # pinned: asynchronous copies at full PCIe bandwidth, no staging copy
        self._live = swap_tensors(actor)
        with torch.no_grad():
            self._ref = [_host_like(t, pin).copy_(t) for t in self._live]
        self._park = [_host_like(t, pin) for t in self._live]  # the policy's weights during a reference pass
        self.bytes = sum(t.numel() * t.element_size() for t in self._live)  #: the rank's weights (+ bucket padding)
        self.last_swap: dict[str, float] = {}  #: bytes moved and seconds of the last pass's two swaps (tools/)

    @contextlib.contextmanager
    def weights_in(self, actor: Any, writeback: bool = False) -> Iterator[list[torch.nn.Module]]:
        """The policy's chunks holding the reference's weights; on exit (also on an error) the policy's weights are
        back. `writeback`: what the chunks hold at the end of the block becomes the reference (checkpoint load)."""
        cuda = actor.runtime == "cuda"
        start = time.perf_counter()
        with torch.no_grad():
            for live, park, ref in zip(self._live, self._park, self._ref):
                park.copy_(live, non_blocking=cuda)  # D2H, then H2D into the same memory: one stream, in order
                live.copy_(ref, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        swap_in = time.perf_counter() - start
        try:
            yield actor.chunks
        finally:
            start = time.perf_counter()
            with torch.no_grad():
                for live, park, ref in zip(self._live, self._park, self._ref):
                    if writeback:
                        ref.copy_(live, non_blocking=cuda)
                    live.copy_(park, non_blocking=cuda)
            if cuda:
                torch.cuda.synchronize()  # the parked copy is reused by the next pass; the caller reads the policy
            self.last_swap = {
                "bytes": float(self.bytes * (4 if writeback else 3)),
                "swap_in_s": swap_in,
                "swap_out_s": time.perf_counter() - start,
            }

    def device_tensors(self) -> list[torch.Tensor]:
        """Nothing: the reference is in host memory already."""
        return []

    def host_bytes(self) -> int:
        """Host memory held: the reference's weights and the parking space of the policy's."""
        return 2 * self.bytes


PLACEMENTS.update(resident=ResidentReference, host=HostReference)


def build_reference(actor: Any, placement: str) -> ResidentReference | HostReference:
    """The reference of `actor` at `placement` (resident | host), holding the policy's current weights."""
    return PLACEMENTS[placement](actor)


def _host_like(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)


@contextlib.contextmanager
def _rng_preserved(runtime: str) -> Iterator[None]:
    """The default generators' and Megatron's named RNG streams' states, as they were before the block."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    cpu, streams = torch.get_rng_state(), tracker.get_states()
    cuda = torch.cuda.get_rng_state() if runtime == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        tracker.set_states(streams)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
