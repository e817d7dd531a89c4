"""Triton kernels for blockwise FP8 (e4m3) quantisation; the plain-torch reference is `fp8_blockwise.py`.

One program per (block row, block column, expert): it loads its (possibly partial) block, reduces the fp32 amax,
writes one scale and the block's e4m3 values. Importing this module needs triton; `fp8_blockwise.py` imports it
lazily and only for CUDA tensors, so CPU-only installs never touch it.

Bit-exactness with the reference (checked by the `gpu` tests in tests/test_fp8_blockwise.py):
- divisions use `tl.math.div_rn` (IEEE round-to-nearest); Triton's plain `/` on fp32 is an approximate division
  (up to 2 ulp), which would move values that sit near an e4m3 rounding boundary;
- casts to e4m3 and to bf16/fp16 request round-to-nearest-even explicitly, as torch's casts do;
- values are clamped to +-448 before the cast, as in the reference, so saturation behaviour never matters.
Triton stores float8e4nv only on compute capability >= 8.9 (Ada, Hopper); `fp8_blockwise.py` uses the reference
elsewhere. Written for triton >= 3.0; not yet run on a GPU (developed on a CPU-only machine).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FP8_MAX = 448.0
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the dequantize kernel stores


@triton.jit
def _quantize_kernel(
    w_ptr,
    q_ptr,
    s_ptr,
    rows,
    cols,
    grid_rows,
    grid_cols,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.program_id(2)
    # TILE_* are BLOCK_* rounded up to a power of two (tl.arange needs one); the mask trims both the tile's
    # excess and the weight's partial edge blocks.
    local_m = tl.arange(0, TILE_M)
    local_n = tl.arange(0, TILE_N)
    r = pid_m * BLOCK_M + local_m
    c = pid_n * BLOCK_N + local_n
    mask = (local_m[:, None] < BLOCK_M) & (local_n[None, :] < BLOCK_N) & (r[:, None] < rows) & (c[None, :] < cols)
    offs = expert.to(tl.int64) * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # Masked elements load as 0 and never raise |amax|.
    amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
    # div_rn takes two tensors of one shape (no broadcasting, no scalars), so the scale is computed as a full tile;
    # `zeros + x` is exact, and every entry of the tile holds the same value.
    zeros = tl.zeros((TILE_M, TILE_N), dtype=tl.float32)
    scale_tile = tl.math.div_rn(zeros + amax, zeros + FP8_MAX)
    scale_tile = tl.where(scale_tile > 0, scale_tile, 1.0)  # zero or underflowed block: s = 1, as in the reference
    q = tl.math.div_rn(w, scale_tile)
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    scale = tl.max(tl.max(scale_tile, axis=1), axis=0)
    tl.store(s_ptr + (expert * grid_rows + pid_m) * grid_cols + pid_n, scale)


@triton.jit
def _dequantize_kernel(
    q_ptr,
    s_ptr,
    y_ptr,
    rows,
    cols,
    grid_rows,
    grid_cols,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    OUT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.program_id(2)
    local_m = tl.arange(0, TILE_M)
    local_n = tl.arange(0, TILE_N)
    r = pid_m * BLOCK_M + local_m
    c = pid_n * BLOCK_N + local_n
    mask = (local_m[:, None] < BLOCK_M) & (local_n[None, :] < BLOCK_N) & (r[:, None] < rows) & (c[None, :] < cols)
    offs = expert.to(tl.int64) * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(s_ptr + (expert * grid_rows + pid_m) * grid_cols + pid_n)
    y = q * scale  # a lone fp32 multiply: exact product rounded once, nothing for fma contraction to fuse
    if OUT_FP32:
        tl.store(y_ptr + offs, y, mask=mask)
    else:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def _launch_shape(shape: torch.Size, block: tuple[int, int]) -> tuple[int, int, int, int, int]:
    experts = shape[0] if len(shape) == 3 else 1
    rows, cols = shape[-2:]
    return experts, rows, cols, triton.cdiv(rows, block[0]), triton.cdiv(cols, block[1])


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a CUDA tensor [M, N] or [E, M, N]; inputs are validated by `fp8_blockwise.quantize_blockwise`."""
    w = w.contiguous()
    experts, rows, cols, grid_rows, grid_cols = _launch_shape(w.shape, block)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((*w.shape[:-2], grid_rows, grid_cols), dtype=torch.float32, device=w.device)
    _quantize_kernel[(grid_rows, grid_cols, experts)](
        w,
        q,
        scale,
        rows,
        cols,
        grid_rows,
        grid_cols,
        BLOCK_M=block[0],
        BLOCK_N=block[1],
        TILE_M=triton.next_power_of_2(block[0]),
        TILE_N=triton.next_power_of_2(block[1]),
        FP8_MAX=_FP8_MAX,
    )
    return q, scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Dequantise a CUDA tensor to `dtype` (one of OUT_DTYPES); inputs are validated by the caller."""
    q = q.contiguous()
    scale_inv = scale_inv.contiguous()
    experts, rows, cols, grid_rows, grid_cols = _launch_shape(q.shape, block)
    y = torch.empty(q.shape, dtype=dtype, device=q.device)
    _dequantize_kernel[(grid_rows, grid_cols, experts)](
        q,
        scale_inv,
        y,
        rows,
        cols,
        grid_rows,
        grid_cols,
        BLOCK_M=block[0],
        BLOCK_N=block[1],
        TILE_M=triton.next_power_of_2(block[0]),
        TILE_N=triton.next_power_of_2(block[1]),
        OUT_FP32=dtype == torch.float32,
    )
    return y
