"""Blockwise FP8 (e4m3) weight quantisation in the format of DeepSeek-V3 / Qwen3 FP8 checkpoints.

The format (`quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}`):

    w [M, N] (bf16/fp32)  -> split into 128 x 128 blocks (configurable)
    per block:  s = amax(|block|) / 448          (448 = largest finite float8_e4m3fn)
                q = float8_e4m3fn(w / s)         (round to nearest even)
    stored:     `weight` = q [M, N] float8_e4m3fn,  `weight_scale_inv` = s [ceil(M/128), ceil(N/128)] fp32
    dequantise: w ~= q * weight_scale_inv        (DeepSeek's name: multiplying by it undoes the quantisation)

Edge blocks: when M or N is not a multiple of the block size, the scale grid is ceil-sized and the last row/column of
blocks is *partial* (only the elements that exist take part in its amax). The weight itself is never padded, as in
DeepSeek's `weight_dequant` kernel, which masks the edge blocks.

Zero blocks: amax == 0 would give s = 0 and 0/0. Such a block gets s = 1.0 (q = 0, and dequantisation is exact);
the same guard catches an fp32 amax so small (< ~6e-43) that amax/448 underflows to zero. No floor is applied to
small non-zero amax: every non-zero block uses its full e4m3 range.

Expert stacks: a 3D tensor [E, M, N] is quantised as E independent 2D weights (scales [E, ceil(M/bm), ceil(N/bn)]),
which is what a checkpoint holding one tensor per expert stores.

`quantize_blockwise_ref` / `dequantize_blockwise_ref` are the plain-torch reference (fp32 math, IEEE division).
`quantize_blockwise` / `dequantize_blockwise` use the Triton kernels in `fp8_blockwise_triton.py` for CUDA tensors on
GPUs with FP8 (compute capability >= 8.9) when triton imports, else the reference; the two are meant to agree bit for
bit (tests marked `gpu`; not yet run on a GPU). On CPU (checkpoint conversion), `quantize_blockwise_cpu` /
`dequantize_blockwise_cpu` give the reference's results bit for bit, working by block rows (and a 256-entry fp8 table).

    from mcore_rl.kernels.fp8_blockwise import quantize_blockwise, dequantize_blockwise
    q, scale_inv = quantize_blockwise(w)                       # w: [M, N] or [E, M, N]
    w_hat = dequantize_blockwise(q, scale_inv, dtype=torch.bfloat16)
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
DEFAULT_BLOCK = (128, 128)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def scale_grid_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, ...]:
    """Shape of `weight_scale_inv` for a weight of `shape` ([M, N] or [E, M, N]): ceil-sized, DeepSeek-style."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or any(int(b) != b or b <= 0 for b in block):
        raise ValueError(f"block must be two positive ints (rows, cols), got {block!r}")
    return int(block[0]), int(block[1])


def _check_weight(w: torch.Tensor) -> None:
    if w.dim() not in (2, 3):
        raise ValueError(
            f"blockwise FP8 needs a 2D weight [M, N] or a 3D expert stack [E, M, N]; got shape {tuple(w.shape)}"
        )
    if w.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"blockwise FP8 needs a float weight ({', '.join(map(str, _FLOAT_DTYPES))}); got {w.dtype}")
    if w.numel() == 0:
        raise ValueError(f"cannot quantise an empty weight of shape {tuple(w.shape)}")


def _check_quantized(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"q must be {FP8_DTYPE}, got {q.dtype}")
    if q.dim() not in (2, 3):
        raise ValueError(f"q must be 2D [M, N] or 3D [E, M, N]; got shape {tuple(q.shape)}")
    expected = scale_grid_shape(q.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match q {tuple(q.shape)} with block {block}: "
            f"expected {expected}"
        )
    if scale_inv.dtype != torch.float32:
        raise ValueError(f"weight_scale_inv must be float32, got {scale_inv.dtype}")


def _expand_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Per-element scale [..., rows, cols] from the block grid; edge blocks are cut to the weight's size."""
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :rows, :cols]


def quantize_blockwise_ref(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch blockwise FP8 quantisation: returns (q float8_e4m3fn, weight_scale_inv fp32).

    Accepts [M, N] or [E, M, N] (each expert quantised on its own). All math is fp32; non-finite inputs are
    refused because a single inf or NaN would poison its whole block's scale.
    """
    block = _check_block(block)
    _check_weight(w)
    wf = w.float()
    if not torch.isfinite(wf).all():
        raise ValueError(f"weight of shape {tuple(w.shape)} holds inf or NaN; blockwise FP8 needs finite values")
    squeeze = wf.dim() == 2
    if squeeze:
        wf = wf.unsqueeze(0)
    experts, rows, cols = wf.shape
    grid_rows, grid_cols = scale_grid_shape((rows, cols), block)
    # Zero padding only to find each block's amax: |0| never raises an amax, so edge blocks stay partial.
    padded = torch.nn.functional.pad(wf.abs(), (0, grid_cols * block[1] - cols, 0, grid_rows * block[0] - rows))
    amax = padded.view(experts, grid_rows, block[0], grid_cols, block[1]).amax(dim=(2, 4))
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero (or underflowed) blocks: s = 1
    # w / s rather than w * (1/s): the reciprocal would add a second rounding. |w/s| <= 448 up to one fp32 ulp;
    # the clamp makes the cast saturate explicitly instead of relying on the cast's overflow behaviour.
    q = (wf / _expand_scale(scale, rows, cols, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if squeeze:
        return q[0], scale[0]
    return q, scale


def dequantize_blockwise_ref(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Plain-torch dequantisation: fp32(q) * weight_scale_inv, then one rounding to `dtype`."""
    block = _check_block(block)
    _check_quantized(q, scale_inv, block)
    rows, cols = q.shape[-2:]
    return (q.float() * _expand_scale(scale_inv, rows, cols, block)).to(dtype)


def quantize_blockwise_cpu(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's math and result, bit for bit, one block row at a time: the per-element scale is never
    expanded, and inf/NaN are found through the block amaxes (a non-finite value makes its block's amax non-finite)
    instead of a pass over the whole weight. What `mcore-to-hf --fp8` runs on CPU."""
    block = _check_block(block)
    _check_weight(w)
    squeeze = w.dim() == 2
    stack = w.unsqueeze(0) if squeeze else w
    experts, rows, cols = stack.shape
    grid_rows, grid_cols = scale_grid_shape((rows, cols), block)
    q = torch.empty(stack.shape, dtype=FP8_DTYPE)
    scales = torch.empty((experts, grid_rows, grid_cols), dtype=torch.float32)
    column_block = torch.arange(cols) // block[1]
    for r in range(grid_rows):
        part = stack[:, r * block[0] : (r + 1) * block[0], :].float()
        padded = torch.nn.functional.pad(part.abs(), (0, grid_cols * block[1] - cols))
        amax = padded.view(experts, part.shape[1], grid_cols, block[1]).amax(dim=(1, 3))
        if not torch.isfinite(amax).all():
            raise ValueError(f"weight of shape {tuple(w.shape)} holds inf or NaN; blockwise FP8 needs finite values")
        scale = amax / FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        scales[:, r] = scale
        expanded = scale.index_select(-1, column_block).unsqueeze(-2)
        q[:, r * block[0] : (r + 1) * block[0], :] = (part / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q[0], scales[0]) if squeeze else (q, scales)


@functools.cache
def _fp8_values() -> torch.Tensor:
    """fp32 value of each of the 256 float8_e4m3fn bit patterns (NaNs included)."""
    return torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()


def dequantize_blockwise_cpu(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The reference's math and result, bit for bit, at CPU speed: one block row at a time (the expanded per-element
    scale is never built; a block row of fp32 stays in cache) and fp8 -> fp32 through a 256-entry table (torch's
    scalar float8 cast runs ~0.15 G elements/s). 5-7x the reference on one core (tools/bench_fp8.py); checkpoint
    import runs it."""
    block = _check_block(block)
    _check_quantized(q, scale_inv, block)
    rows, cols = q.shape[-2:]
    out = torch.empty(q.shape, dtype=dtype)
    bits, values = q.view(torch.uint8), _fp8_values()
    column_block = torch.arange(cols) // block[1]
    for start in range(0, rows, block[0]):
        stop = min(start + block[0], rows)
        scale = scale_inv[..., start // block[0], :].index_select(-1, column_block).unsqueeze(-2)
        part = bits[..., start:stop, :]
        fp32 = values.index_select(0, part.reshape(-1).int()).view(part.shape)
        out[..., start:stop, :] = (fp32 * scale).to(dtype)
    return out


@functools.cache
def _triton_module() -> ModuleType | None:
    """The Triton kernels, or None where triton does not import (CPU-only installs)."""
    try:
        from mcore_rl.kernels import fp8_blockwise_triton
    except (ImportError, RuntimeError):  # no triton, or a triton without a usable backend
        return None
    return fp8_blockwise_triton


def triton_available() -> bool:
    """True when the Triton kernels can be used (triton imports; CUDA is checked per tensor)."""
    return _triton_module() is not None


def _kernels_for(t: torch.Tensor) -> ModuleType | None:
    """The Triton module when `t` is on a GPU that has FP8 (compute capability >= 8.9) and triton imports."""
    if not t.is_cuda or torch.cuda.get_device_capability(t.device) < (8, 9):
        return None
    return _triton_module()


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 quantisation: Triton kernel for CUDA tensors (sm >= 8.9, triton importable), else the reference.

    Same contract as `quantize_blockwise_ref`, except that the Triton path does not scan for inf/NaN (that check
    would cost a device sync per weight); a non-finite value poisons its block (inf/NaN scale or values).
    """
    block = _check_block(block)
    _check_weight(w)
    module = _kernels_for(w)
    if module is not None:
        return module.quantize(w, block)
    if w.device.type == "cpu":
        return quantize_blockwise_cpu(w, block)
    return quantize_blockwise_ref(w, block)


def dequantize_blockwise(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Blockwise FP8 dequantisation: Triton kernel for CUDA tensors (sm >= 8.9, triton importable), else reference."""
    block = _check_block(block)
    _check_quantized(q, scale_inv, block)
    module = _kernels_for(q)
    if module is not None and dtype in module.OUT_DTYPES:  # the kernel stores fp32/bf16/fp16 only
        return module.dequantize(q, scale_inv, block, dtype)
    if q.device.type == "cpu":
        return dequantize_blockwise_cpu(q, scale_inv, block, dtype)
    return dequantize_blockwise_ref(q, scale_inv, block, dtype)
