"""Block copies: the resharding hot step, gathered TP shards -> HF layout, as one table of 2D copies per bucket.

After one TP all-gather per bucket, the gathered buffer holds, rank after rank, each rank's pieces of every tensor of
the bucket. Every layout transform weight sync needs (split along dim 0 or dim 1, per-query-group QKV -> q/k/v,
GLU [gate_i; up_i] shards -> gate and up, vocab padding trimmed) is a set of 2D block copies from that buffer into the
flat bucket buffer:

    gathered (1-D) --table[n, 6]--> bucket (1-D)        one kernel launch per bucket (Triton on CUDA)
    gathered (1-D) --table, tensors--> bucket fp8 + weight_scale_inv    copy fused with 128x128 e4m3 quantisation

A table is an int64 tensor [n, 6] with the columns of BLOCK_FIELDS, in elements of the buffers' dtype: block i copies
`rows x cols` elements, row r reading src[src_offset + r*src_stride : + cols] into dst[dst_offset + r*dst_stride :
+ cols]. Blocks must not overlap in dst (not checked: the kernel copies blocks in parallel; the reference would let
the later one win); src may overlap freely. Tables are plan data: keep them on the CPU (validation reads them).

`copy_blocks_reference` defines the math; `copy_blocks` is the entry point (Triton on CUDA, or on CPU when
TRITON_INTERPRET=1 and triton imports; else `copy_blocks_cpu`). The FP8 pair `copy_blocks_fp8(_reference)` also takes
`tensors`, an int64 [m, 4] table (FP8_TENSOR_FIELDS): each quantised tensor is a row-major [rows, cols] at dst_offset
of the fp8 buffer, its ceil-sized scale grid row-major at scale_offset of the fp32 `weight_scale_inv` buffer, with the
math of `fp8_blockwise.quantize_blockwise_ref` (a tile's amax / 448; elements no block covers count as zeros).
Benchmark: tools/bench_block_copy.py.
"""

from __future__ import annotations

import bisect
import functools
import math
import os
from types import ModuleType

import torch

from mcore_rl.kernels.fp8_blockwise import DEFAULT_BLOCK, FP8_DTYPE, quantize_blockwise_cpu, quantize_blockwise_ref

BLOCK_FIELDS = ("src_offset", "src_stride", "dst_offset", "dst_stride", "rows", "cols")
FP8_TENSOR_FIELDS = ("dst_offset", "rows", "cols", "scale_offset")
FP8_SRC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_buffer(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got {getattr(t, 'shape', type(t))}")


def _check_int_table(name: str, row: str, table: torch.Tensor, fields: tuple[str, ...]) -> torch.Tensor:
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int64 or table.dim() != 2:
        raise ValueError(f"{name} must be an int64 tensor [n, {len(fields)}], got {getattr(table, 'dtype', table)}")
    if table.shape[1] != len(fields):
        raise ValueError(f"{name} must have {len(fields)} columns {fields}, got shape {tuple(table.shape)}")
    table = table.cpu()
    negative = (table < 0).nonzero()
    if len(negative):
        i, f = negative[0].tolist()
        raise ValueError(f"{row} {i}: {fields[f]} = {table[i, f].item()} is negative")
    return table


def check_table(table: torch.Tensor, src_numel: int, dst_numel: int) -> torch.Tensor:
    """Validate a block table against buffer sizes; return it on the CPU. Raises ValueError naming block and field.

    Blocks with rows == 0 or cols == 0 copy nothing and are always valid (beyond non-negative fields).
    """
    table = _check_int_table("table", "block", table, BLOCK_FIELDS)
    src_offset, src_stride, dst_offset, dst_stride, rows, cols = table.unbind(1)
    live = (rows > 0) & (cols > 0)
    checks = (
        ("dst_stride", live & (rows > 1) & (dst_stride < cols), "< cols: the block's rows overlap in dst"),
        ("src_offset", live & (src_offset + (rows - 1) * src_stride + cols > src_numel), f"> src.numel() {src_numel}"),
        ("dst_offset", live & (dst_offset + (rows - 1) * dst_stride + cols > dst_numel), f"> dst.numel() {dst_numel}"),
    )
    failing = [(int(bad.nonzero()[0]), field, why) for field, bad, why in checks if bad.any()]
    if failing:
        i, field, why = min(failing, key=lambda f: f[0])
        o, s, d, ds, r, c = table[i].tolist()
        extent = {"dst_stride": f"dst_stride {ds}", "src_offset": f"src_offset {o} + ({r} - 1) * {s} + {c}"}
        extent["dst_offset"] = f"dst_offset {d} + ({r} - 1) * {ds} + {c}"
        raise ValueError(f"block {i}: {field}: {extent[field]} {why} (rows {r}, cols {c})")
    return table


def _check_pair(src: torch.Tensor, dst: torch.Tensor) -> None:
    _check_buffer("src", src)
    _check_buffer("dst", dst)
    if src.dtype != dst.dtype:
        raise ValueError(f"src and dst must share a dtype, got {src.dtype} and {dst.dtype}")
    if src.device != dst.device:
        raise ValueError(f"src and dst must share a device, got {src.device} and {dst.device}")


def _view2d(buf: torch.Tensor, offset: int, stride: int, rows: int, cols: int) -> torch.Tensor:
    # as_strided takes an absolute storage offset: a buffer that is itself a slice starts at buf.storage_offset().
    return buf.as_strided((rows, cols), (stride, 1), buf.storage_offset() + offset)


def copy_blocks_reference(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor) -> None:
    """The definition: for each block in order, dst[dst_offset + r*dst_stride + c] = src[src_offset + r*src_stride + c]
    for r < rows, c < cols. Validates like `copy_blocks`."""
    _check_pair(src, dst)
    table = check_table(table, src.numel(), dst.numel())
    for o, s, d, ds, r, c in table.tolist():
        if r and c:
            _view2d(dst, d, ds, r, c).copy_(_view2d(src, o, s, r, c))


def copy_blocks_cpu(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor) -> None:
    """The CPU path: one `copy_` per block (a 1-D run when the block is contiguous on both sides, else a strided 2D
    view whose rows torch moves as contiguous runs).

    Chosen by tools/bench_block_copy.py (100 blocks of 128..8192 rows x 128..7168 cols, 256 MiB of bf16, one thread):
    ~32 GB/s read + write, against ~1.6 GB/s for one `index_copy_` over precomputed element indices (two int64
    indices per 2-byte element: 8x the bytes moved, gathered at random) and ~2.2 GB/s for one copy per row.
    """
    _check_pair(src, dst)
    table = check_table(table, src.numel(), dst.numel())
    _copy_checked(src, dst, table)


def _copy_checked(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor) -> None:
    for o, s, d, ds, r, c in table.tolist():
        if r == 0 or c == 0:
            continue
        if r == 1 or (s == c and ds == c):  # contiguous on both sides: one 1-D run
            n = r * c
            dst[d : d + n].copy_(src[o : o + n])
        else:
            _view2d(dst, d, ds, r, c).copy_(_view2d(src, o, s, r, c))


@functools.cache
def _triton_module() -> ModuleType | None:
    """The Triton kernels, or None where triton does not import (CPU-only installs)."""
    try:
        from mcore_rl.kernels import block_copy_triton
    except (ImportError, RuntimeError):  # no triton, or a triton without a usable backend
        return None
    return block_copy_triton


def triton_available() -> bool:
    """True when the Triton kernels can be used (triton imports; the device is checked per tensor)."""
    return _triton_module() is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernels_for(t: torch.Tensor) -> ModuleType | None:
    """The Triton module for CUDA tensors, or for CPU tensors under TRITON_INTERPRET=1 (tests); else None."""
    if t.is_cuda or (t.device.type == "cpu" and _interpreting()):
        return _triton_module()
    return None


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor) -> None:
    """Copy every block of `table` from `src` into `dst` (both 1-D, one dtype); the result is the reference's.

    CUDA: one Triton launch for the whole table (values moved as raw bits, so any dtype is copied exactly). CPU:
    `copy_blocks_cpu`. Raises ValueError, naming the block and field, for a table that reaches outside a buffer.
    """
    _check_pair(src, dst)
    table = check_table(table, src.numel(), dst.numel())
    module = _kernels_for(src)
    if module is not None:
        module.copy_blocks(src, dst, table)
    else:
        _copy_checked(src, dst, table)


# ---- FP8: copy fused with blockwise e4m3 quantisation --------------------------------------------------------------


def check_fp8_tables(
    src: torch.Tensor,
    dst_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    table: torch.Tensor,
    tensors: torch.Tensor,
    tile: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate an FP8 copy; return (table, tensors) on the CPU and each block's tensor index (-1: empty block).

    Besides `check_table`: every non-empty block lies inside one tensor, each of its rows inside one row of that
    tensor unless the block is contiguous (then it may wrap rows); tensors are disjoint in dst and in scale_inv.
    """
    _check_buffer("src", src)
    _check_buffer("dst_fp8", dst_fp8)
    _check_buffer("scale_inv", scale_inv)
    if src.dtype not in FP8_SRC_DTYPES:
        raise ValueError(f"src must be one of {FP8_SRC_DTYPES} for FP8 quantisation, got {src.dtype}")
    if dst_fp8.dtype != FP8_DTYPE or scale_inv.dtype != torch.float32:
        raise ValueError(f"dst_fp8 must be {FP8_DTYPE} and scale_inv float32, got {dst_fp8.dtype}, {scale_inv.dtype}")
    if src.device != dst_fp8.device or src.device != scale_inv.device:
        raise ValueError(
            f"src, dst_fp8, scale_inv must share a device: {src.device}, {dst_fp8.device}, {scale_inv.device}"
        )
    if len(tile) != 2 or min(tile) <= 0:
        raise ValueError(f"tile must be two positive ints, got {tile!r}")
    table = check_table(table, src.numel(), dst_fp8.numel())
    tensors = _check_int_table("tensors", "tensors row", tensors, FP8_TENSOR_FIELDS)
    spans, scale_spans = [], []
    for i, (d, r, c, so) in enumerate(tensors.tolist()):
        grid = math.ceil(r / tile[0]) * math.ceil(c / tile[1])
        if r == 0 or c == 0:
            raise ValueError(f"tensors row {i}: rows {r} x cols {c} is empty")
        if d + r * c > dst_fp8.numel():
            raise ValueError(f"tensors row {i}: dst_offset {d} + {r} * {c} > dst_fp8.numel() {dst_fp8.numel()}")
        if so + grid > scale_inv.numel():
            raise ValueError(f"tensors row {i}: scale_offset {so} + {grid} > scale_inv.numel() {scale_inv.numel()}")
        spans.append((d, d + r * c, i))
        scale_spans.append((so, so + grid, i))
    for ranges, field in ((spans, "dst_offset"), (scale_spans, "scale_offset")):
        ordered = sorted(ranges)
        for (_, end, a), (start, _, b) in zip(ordered, ordered[1:]):
            if start < end:
                raise ValueError(f"tensors rows {a} and {b} overlap ({field})")
    owner = torch.full((len(table),), -1, dtype=torch.int64)
    starts = sorted(spans)
    firsts = [lo for lo, _, _ in starts]
    for b, (_, s, d, ds, r, c) in enumerate(table.tolist()):
        if r == 0 or c == 0:
            continue
        k = bisect.bisect_right(firsts, d) - 1  # the tensor starting last at or before the block
        last = d + (r - 1) * ds + c
        if k < 0 or last > starts[k][1]:
            raise ValueError(f"block {b}: dst_offset {d} (to {last}) is not inside one tensor of `tensors`")
        t = starts[k][2]
        width = tensors[t, 2].item()
        contiguous = r == 1 or (s == c and ds == c)
        if not contiguous and (ds % width != 0 or (d - starts[k][0]) % width + c > width):
            raise ValueError(
                f"block {b}: dst_stride {ds} / cols {c} do not keep its rows within rows of tensor {t} (width {width})"
            )
        owner[b] = t
    return table, tensors, owner


def _write_quantized(
    dst_fp8: torch.Tensor, scale_inv: torch.Tensor, d: int, so: int, q: torch.Tensor, s: torch.Tensor
) -> None:
    dst_fp8[d : d + q.numel()].copy_(q.reshape(-1))
    scale_inv[so : so + s.numel()].copy_(s.reshape(-1))


def copy_blocks_fp8_reference(
    src: torch.Tensor,
    dst_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    table: torch.Tensor,
    tensors: torch.Tensor,
    tile: tuple[int, int] = DEFAULT_BLOCK,
) -> None:
    """The definition: copy the blocks into a zeroed buffer of src's dtype laid out like dst_fp8 (the reference copy),
    then quantise each tensor of `tensors` with `fp8_blockwise.quantize_blockwise_ref` into dst_fp8 / scale_inv."""
    table, tensors, _ = check_fp8_tables(src, dst_fp8, scale_inv, table, tensors, tile)
    staging = torch.zeros(dst_fp8.numel(), dtype=src.dtype, device=src.device)
    copy_blocks_reference(src, staging, table)
    for d, r, c, so in tensors.tolist():
        q, s = quantize_blockwise_ref(staging[d : d + r * c].view(r, c), tile)
        _write_quantized(dst_fp8, scale_inv, d, so, q, s)


def copy_blocks_fp8(
    src: torch.Tensor,
    dst_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    table: torch.Tensor,
    tensors: torch.Tensor,
    tile: tuple[int, int] = DEFAULT_BLOCK,
) -> None:
    """Block copy fused with blockwise FP8 quantisation; the result is `copy_blocks_fp8_reference`'s, bit for bit.

    CUDA (or CPU under TRITON_INTERPRET=1): one Triton launch; each program assembles one destination tile from the
    blocks that cover it, so tiles may span several blocks (any GPU: e4m3 is encoded with integer ops). CPU: per
    tensor, its blocks into a staging tensor (extra memory: the largest tensor), then `quantize_blockwise_cpu` (which
    refuses inf/NaN; the kernel does not scan for them).
    """
    table, tensors, owner = check_fp8_tables(src, dst_fp8, scale_inv, table, tensors, tile)
    module = _kernels_for(src)
    if module is not None:
        module.copy_blocks_fp8(src, dst_fp8, scale_inv, table, tensors, owner, tile)
        return
    quantize = quantize_blockwise_cpu if src.device.type == "cpu" else quantize_blockwise_ref
    for t, (d, r, c, so) in enumerate(tensors.tolist()):
        mine = table[owner == t].clone()
        mine[:, 2] -= d  # dst offsets relative to the tensor
        staging = torch.zeros(r * c, dtype=src.dtype, device=src.device)
        _copy_checked(src, staging, mine)
        q, s = quantize(staging.view(r, c), tile)
        _write_quantized(dst_fp8, scale_inv, d, so, q, s)
