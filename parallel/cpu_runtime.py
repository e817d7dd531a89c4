"""The CPU runtime: run megatron-core on CPU with gloo.

Megatron-core assumes CUDA in a handful of places. This module holds every patch that makes 0.16.1 run on a CPU-only
machine, each with a comment saying what it works around. Nothing here changes Megatron's math: the same model code,
schedules and optimizer run; only device placement, RNG bookkeeping and two imports are redirected, and the MoE
all-gather dispatcher gathers its three tensors in one collective (same values, bit for bit).

Device placement has two layers: a torch function mode that rewrites every op naming CUDA (in force by default), and
patched factories (`torch.zeros(..., device="cuda")`, `Tensor.to("cuda")`, ...) that keep working where the hot loops
suspend the mode (`mode_suspended`: the schedule, the optimizer step), since the mode costs a Python call per op.

The runtime is opt-in (`runtime: cpu` in the config, or `enable_cpu_runtime()` in tests) and refuses to start where it
would shadow a usable GPU, because a silent CPU fallback on a GPU node is a 100x slowdown nobody asked for.

Measured against megatron-core 0.16.1 and torch 2.13 (CPU build).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False


class CpuRuntimeRefused(RuntimeError):
    """Raised when the CPU runtime is asked for on a machine with a usable GPU, or with an unverified Megatron."""


#: megatron-core releases these patches were run against (constraints.txt pins the one CI uses). Another release may
#: move a patched call site and fail deep inside a rank, or silently not be patched;
#: MCORE_RL_ALLOW_UNVERIFIED_MEGATRON=1 lets one try anyway.
VERIFIED_MEGATRON = ("0.16.1",)


def megatron_version_problem(version: str | None = None) -> str | None:
    """Why the installed (or given) megatron-core cannot carry the CPU runtime; None when it is verified."""
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version("megatron-core")
        except metadata.PackageNotFoundError:
            return "megatron-core is not installed (pip install -c constraints.txt -e .)"
    if version in VERIFIED_MEGATRON or os.environ.get("MCORE_RL_ALLOW_UNVERIFIED_MEGATRON") == "1":
        return None
    return (
        f"megatron-core {version} is installed, but the CPU runtime's patches (parallel/cpu_runtime.py) are verified "
        f"with {', '.join(VERIFIED_MEGATRON)} only: pip install -c constraints.txt megatron-core, or set "
        "MCORE_RL_ALLOW_UNVERIFIED_MEGATRON=1 to try it"
    )


class _CudaToCpuMode(TorchFunctionMode):
    """Maps every torch function's CUDA `device` keyword (and `pin_memory`) onto the CPU.

    Megatron 0.16.1 allocates with `device="cuda"` or `device=torch.cuda.current_device()` (an int, which torch reads
    as a CUDA ordinal) in its schedules (token counters), causal masks, MoE router/expert buffers and optimizer.
    Rewriting the `device` argument here keeps those call sites untouched. `Tensor.to("cuda")` and `Tensor.cuda()`
    are patched methods (`_patch_factories`), in force with or without the mode.
    `Tensor.type()` (no arguments) answers with the CUDA type name, for Megatron's dtype checks.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = _on_cpu(dict(kwargs)) if kwargs else {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The distributed optimizer (0.16.1) sorts parameters by `param.type()` and refuses any but
            # 'torch.cuda.{Float,Half,BFloat16}Tensor': report a CPU tensor's type under its CUDA name.
            with torch._C.DisableTorchFunction():
                name = args[0].type()
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        return func(*args, **kwargs)


def _names_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CpuRNGStatesTracker:
    """Megatron's named RNG streams on the CPU generator.

    Megatron's tracker keeps one CUDA generator state per name ("model-parallel-rng", "expert-parallel-rng", ...) and
    `fork(name)` swaps it in, so that dropout and initialisation differ across TP ranks where they must. The CUDA
    version calls `torch.cuda.get_rng_state`; this one swaps the CPU generator's state with the same semantics.
    """

    def __init__(self, *_: Any, **__: Any) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False
        self._current_state_name = "default-rng"

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        previous, self._current_state_name = self._current_state_name, name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)
            self._current_state_name = previous


def usable_gpu() -> bool:
    """True when torch sees at least one CUDA device it can use."""
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except RuntimeError:
        return False


def enable_cpu_runtime(allow_with_gpu: bool = False) -> None:
    """Install the CPU patches in this process (idempotent).

    Call it before building any Megatron model, in every rank process. Refuses when a usable GPU is present unless
    `allow_with_gpu` (tests that compare CPU and GPU on purpose) or MCORE_RL_ALLOW_CPU_WITH_GPU=1.
    """
    global _ENABLED
    if _ENABLED:
        return
    problem = megatron_version_problem()
    if problem is not None:
        raise CpuRuntimeRefused(problem)
    if usable_gpu() and not (allow_with_gpu or os.environ.get("MCORE_RL_ALLOW_CPU_WITH_GPU") == "1"):
        raise CpuRuntimeRefused(
            "runtime=cpu refused: this machine has a usable GPU "
            f"({torch.cuda.device_count()} visible) and the CPU runtime would shadow it. Use runtime=cuda, or set "
            "MCORE_RL_ALLOW_CPU_WITH_GPU=1 to force it."
        )

    # torch.cuda.current_device() raises on a CPU build. Megatron's training paths pass it as a device argument
    # (`torch.empty(n, device=torch.cuda.current_device())`), also inside autograd backward functions, where the
    # function mode below is not in force (autograd's engine does not carry it). Returning the CPU device itself
    # works in both places; only NCCL-specific code (not used on CPU) builds torch.device("cuda", <index>) from it.
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    # Megatron synchronises around timers and collectives; there is nothing to wait for on CPU.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

    import megatron.core.tensor_parallel.random as mrandom

    # The CUDA RNG tracker calls torch.cuda.get_rng_state: replace it (and its factory) with the CPU tracker so that
    # model_parallel_cuda_manual_seed() and fork() keep isolating RNG streams.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker  # type: ignore[misc, assignment]
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom.initialize_rng_tracker = lambda *a, **k: None  # type: ignore[assignment]

    import megatron.core.transformer.moe.moe_utils as moe_utils

    # 0.16.1 reads moe_utils.te_general_gemm in the router even when Transformer Engine failed to import, where the
    # name was never bound. None selects its plain torch matmul path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    import megatron.core.optimizer.optimizer as moptimizer

    # clip_grad_by_total_norm_fp32 asserts `param.grad.type() == 'torch.cuda.FloatTensor'` (0.16.1) before scaling;
    # the CPU version scales the same fp32 gradients by the same coefficient.
    moptimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32

    import megatron.core.transformer.moe.moe_layer as moe_layer

    # Every collective costs a millisecond or more over gloo here (two thread hand-offs per rank, on a VM that wakes
    # an idle core slowly), against tens of microseconds for the bytes: the all-gather dispatcher's three all-gathers
    # per MoE layer (routing map, probs, hidden states) and their two reduce-scatters in backward are fused into one
    # of each. Same values, bit for bit (tests/test_cpu_runtime.py).
    moe_layer.MoEAllGatherTokenDispatcher = _fused_allgather_dispatcher()

    # A global function mode, pushed once for the life of the process. Ray runs a synchronous actor's methods on
    # the thread that built it, so the mode stays in force for every call.
    _CudaToCpuMode().__enter__()
    # The mode costs a Python call per torch op. The hot loops (the schedule's forward/backward, the optimizer step)
    # run with it suspended (`mode_suspended`); what they allocate on "cuda" goes through these patched factories.
    _patch_factories()
    _ENABLED = True


#: torch functions and Tensor methods that take a `device` (or `pin_memory`) keyword and that Megatron's hot paths call
_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "as_tensor", "empty_like", "zeros_like", "ones_like",
    "full_like", "rand", "randn", "randint", "randperm", "empty_strided", "linspace", "eye",
)  # fmt: skip
_TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def _on_cpu(kwargs: dict[str, Any]) -> dict[str, Any]:
    if "device" in kwargs and _names_cuda(kwargs["device"]):
        kwargs["device"] = "cpu"
    if kwargs.get("pin_memory"):  # pinned host memory needs a CUDA context
        kwargs["pin_memory"] = False
    return kwargs


def _patch_factories() -> None:
    """Factories that map a CUDA `device` keyword to the CPU, `Tensor.to("cuda")` and `Tensor.cuda()` that stay on
    the CPU: what the mode does for these, at the cost of one Python call per factory call, not per op."""

    def factory(fn: Any) -> Any:
        @functools.wraps(fn)
        def on_cpu(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **_on_cpu(kwargs))

        return on_cpu

    for name in _FACTORIES:
        setattr(torch, name, factory(getattr(torch, name)))
    for name in _TENSOR_FACTORIES:
        setattr(torch.Tensor, name, factory(getattr(torch.Tensor, name)))
    to = torch.Tensor.to

    def to_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and _names_cuda(args[0]):
            args = ("cpu", *args[1:])
        return to(self, *args, **_on_cpu(kwargs))

    torch.Tensor.to = to_cpu  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


def _fused_allgather_dispatcher() -> type:
    """Megatron's all-gather token dispatcher, gathering the routing map, probs and hidden states as one tensor."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    class FusedAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
        def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):  # noqa: ANN202
            if self.tp_size == 1 and self.ep_size == 1:
                return hidden_states, probs
            # [tokens, hidden | experts (probs) | experts (routing map as 0/1)] in the probs' dtype (fp32: exact for
            # bf16 hidden states and for the map); the gather's backward reduce-scatters both gradients at once.
            width, experts = hidden_states.shape[-1], probs.shape[-1]
            packed = torch.cat([hidden_states.to(probs.dtype), probs, self.routing_map.to(probs.dtype)], dim=-1)
            gathered = gather_from_sequence_parallel_region(packed, group=self.tp_ep_group)
            self.routing_map = gathered[:, width + experts :].detach() > 0.5
            return gathered[:, :width].to(hidden_states.dtype), gathered[:, width : width + experts]

    return FusedAllGatherTokenDispatcher


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:  # noqa: ANN001
    """Megatron's clip by a precomputed total norm, without the CUDA type assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is not None:
            grad.detach().mul_(clip_coeff)


@contextlib.contextmanager
def mode_suspended() -> Iterator[None]:
    """Suspend the device-rewriting mode (every torch function mode) in hot loops: the mode costs a Python call per
    torch op (measured: a third of the time of a loop of small copies; 10-25% of a default-job update). Inside, the
    patched factories (`_patch_factories`) still put what Megatron allocates on "cuda" on the CPU; anything else
    that names CUDA fails loudly (torch is not compiled with it), it does not silently go elsewhere. Without the CPU
    runtime (CUDA) it does nothing: there it would also switch off tensor subclasses' `__torch_function__`."""
    if not _ENABLED:
        yield
        return
    with torch._C.DisableTorchFunction():
        yield


def cpu_runtime_enabled() -> bool:
    """Whether `enable_cpu_runtime` ran in this process."""
    return _ENABLED


def return_freed_memory() -> None:
    """Hand the free pages of the C heap back to the system (glibc's malloc_trim; nothing elsewhere). A freed CPU
    tensor under glibc's mmap threshold (up to 32 MiB) stays in its arenas, in the process's RSS, until trimmed:
    without this, an engine that frees a model's worth of staging copies, or a rank that frees a step's activations,
    keeps its RSS where it was."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
