"""Triton kernels for `block_copy.py`: a whole table of 2D block copies in one launch, optionally fused with FP8.

Plain copy (`_copy_blocks_kernel`): a fixed tile of TILE_ROWS x TILE_COLS elements and a 1-D grid over all tiles of
all blocks. The host computes each block's tile count and their prefix sum (`tile_start`, n + 1 entries); program p
finds its block by a binary search of `tile_start` (log2(n) scalar loads, cached) and copies one masked tile. Chosen
over a 2D grid (block, tile) because block sizes differ by 1000x (128 x 128 to 8192 x 7168): a 2D grid sized by the
largest block would launch mostly idle programs. Before launch the host
- widens the element: buffers are viewed as int64 (or int32, int16) when every offset, stride and width allows, so
  each lane moves 8 bytes, and values are moved as raw bits (any dtype, NaN payloads included, copied exactly);
- reshapes contiguous blocks (a whole dim-0 shard, a 1-D tensor) into rows of TILE_COLS, so no tile is mostly mask.

FP8 (`_copy_quantize_kernel`): one program per 128 x 128 tile of each destination tensor. A tile may span several
blocks (a dim-1 split whose shard width is not a multiple of 128, a QKV group of 64 rows), so the host intersects
blocks with the tile grid once (pure data, `_fp8_plan`) and gives each tile its list of pieces (CSR). The program
gathers its pieces into one fp32 tile, takes the amax, divides with IEEE rounding (`div_rn`), and stores e4m3 bits
that it encodes with integer ops (`_e4m3_bits`, round to nearest even). The integer encoding runs on any GPU (no sm_89
fp8 store needed) and under the interpreter, whose fp32 -> fp8 cast (triton 3.9, interpreter.py `_convert_float`)
rounds ties away and, on a mantissa carry, ORs the carry into the exponent: 0.496 -> 0.25.

Tile sizes and num_warps are untuned (written on a CPU-only machine; checked under TRITON_INTERPRET=1 only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ROWS = 16
TILE_COLS = 256  # both powers of two (tl.arange)
_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    table_ptr,
    tile_start_ptr,
    n_blocks,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    # Invariant tile_start[lo] <= pid < tile_start[hi]; every block has >= 1 tile, so it ends with hi = lo + 1.
    lo = pid * 0
    hi = lo + n_blocks
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(tile_start_ptr + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    row = table_ptr + lo * 6
    src_offset = tl.load(row)
    src_stride = tl.load(row + 1)
    dst_offset = tl.load(row + 2)
    dst_stride = tl.load(row + 3)
    rows = tl.load(row + 4)
    cols = tl.load(row + 5)
    tile = pid - tl.load(tile_start_ptr + lo)
    tiles_c = (cols + TILE_C - 1) // TILE_C
    r = (tile // tiles_c) * TILE_R + tl.arange(0, TILE_R)
    c = (tile % tiles_c) * TILE_C + tl.arange(0, TILE_C)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    values = tl.load(src_ptr + (src_offset + r[:, None] * src_stride + c[None, :]), mask=mask)
    tl.store(dst_ptr + (dst_offset + r[:, None] * dst_stride + c[None, :]), values, mask=mask)


def _widen(
    src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, dst, table) viewed as the widest integer type that every block's offsets, strides and cols allow."""
    size = src.element_size()
    for wide in (8, 4, 2, 1):
        k = wide // size
        if wide < size or wide % size or (table[:, [0, 1, 2, 3, 5]] % k).any():
            continue
        if src.data_ptr() % wide or dst.data_ptr() % wide:
            continue
        try:  # a view needs an aligned start; the blocks end before the last whole wide element
            s = src[: src.numel() // k * k].view(_INT_OF_SIZE[wide])
            d = dst[: dst.numel() // k * k].view(_INT_OF_SIZE[wide])
        except RuntimeError:
            continue
        widened = table.clone()
        widened[:, [0, 1, 2, 3, 5]] //= k
        return s, d, widened
    raise AssertionError("unreachable: a one-byte view always exists")


def _launch_table(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop empty blocks, reshape contiguous ones into rows of TILE_COLS; return (table, tile_start)."""
    out = []
    for o, s, d, ds, r, c in table.tolist():
        if r == 0 or c == 0:
            continue
        if r == 1 or (s == c and ds == c):
            n = r * c
            full = n // TILE_COLS
            if full:
                out.append((o, TILE_COLS, d, TILE_COLS, full, TILE_COLS))
            if n % TILE_COLS:
                out.append((o + full * TILE_COLS, 0, d + full * TILE_COLS, 0, 1, n % TILE_COLS))
        else:
            out.append((o, s, d, ds, r, c))
    launch = torch.tensor(out, dtype=torch.int64).view(-1, 6)
    tiles = (launch[:, 4] + TILE_ROWS - 1) // TILE_ROWS * ((launch[:, 5] + TILE_COLS - 1) // TILE_COLS)
    return launch, torch.cat([torch.zeros(1, dtype=torch.int64), tiles.cumsum(0)])


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor) -> None:
    """One launch for the whole table; inputs are validated by `block_copy.copy_blocks` (table on the CPU)."""
    src, dst, table = _widen(src, dst, table)
    launch, tile_start = _launch_table(table)
    n = len(launch)
    if n == 0:
        return
    meta = torch.cat([launch.view(-1), tile_start]).to(src.device)
    total = int(tile_start[-1])
    _copy_blocks_kernel[(total,)](
        src,
        dst,
        meta,
        meta[6 * n :],
        n,
        TILE_R=TILE_ROWS,
        TILE_C=TILE_COLS,
        SEARCH_STEPS=max(1, n.bit_length()),
        num_warps=4,
    )


# ---- FP8 -------------------------------------------------------------------------------------------------------------


@triton.jit
def _e4m3_bits(x):
    """float8_e4m3fn bit pattern (int32, 0..255) of fp32 x with |x| <= 448, rounded to nearest even."""
    xb = x.to(tl.int32, bitcast=True)
    sign = (xb >> 31) & 1
    a = xb & 0x7FFFFFFF
    # Normal range (|x| >= 2^-6): round the 23-bit mantissa to 3 bits; a carry moves into the exponent by itself.
    # 960 = (127 - 7) << 3 rebiases the exponent from fp32's 127 to e4m3's 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
    # Subnormal range: the result counts units of 2^-9, m = round(M * 2^(E - 150 + 9)) with M the 24-bit significand.
    # The shift is clamped to [21, 31] so that both arms are defined for every input (only one is kept).
    shift = tl.minimum(tl.maximum(141 - (a >> 23), 21), 31)
    significand = (a & 0x7FFFFF) | 0x800000
    sub = (significand + (1 << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift
    return tl.where(a < 0x3C800000, sub, normal) | (sign << 7)


@triton.jit
def _copy_quantize_kernel(
    src_ptr,
    q_ptr,
    s_ptr,
    tiles_ptr,
    piece_start_ptr,
    pieces_ptr,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    POW2_M: tl.constexpr,
    POW2_N: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)
    meta = tiles_ptr + p * 5
    dst_origin = tl.load(meta)
    dst_stride = tl.load(meta + 1)
    valid_rows = tl.load(meta + 2)
    valid_cols = tl.load(meta + 3)
    scale_at = tl.load(meta + 4)
    i = tl.arange(0, POW2_M)[:, None]
    j = tl.arange(0, POW2_N)[None, :]
    # Elements no piece covers (padding of an edge tile, or not written by any block) stay 0: they never raise amax.
    tile = tl.zeros((POW2_M, POW2_N), dtype=tl.float32)
    for k in range(tl.load(piece_start_ptr + p).to(tl.int32), tl.load(piece_start_ptr + p + 1).to(tl.int32)):
        piece = pieces_ptr + k * 6
        src_at = tl.load(piece)
        src_stride = tl.load(piece + 1)
        r0 = tl.load(piece + 2)
        c0 = tl.load(piece + 3)
        h = tl.load(piece + 4)
        w = tl.load(piece + 5)
        inside = (i >= r0) & (i < r0 + h) & (j >= c0) & (j < c0 + w)
        values = tl.load(src_ptr + (src_at + (i - r0) * src_stride + (j - c0)), mask=inside, other=0.0)
        tile = tl.where(inside, values.to(tl.float32), tile)  # where, not +: keeps -0.0
    amax = tl.max(tl.max(tl.abs(tile), axis=1), axis=0)
    # As in fp8_blockwise_triton: div_rn takes tensors of one shape, so the scale is a full tile of one value.
    zeros = tl.zeros((POW2_M, POW2_N), dtype=tl.float32)
    scale_tile = tl.math.div_rn(zeros + amax, zeros + FP8_MAX)
    scale_tile = tl.where(scale_tile > 0, scale_tile, 1.0)  # zero (or underflowed) tile: s = 1, as in the reference
    x = tl.minimum(tl.maximum(tl.math.div_rn(tile, scale_tile), -FP8_MAX), FP8_MAX)
    store = (i < valid_rows) & (j < valid_cols)  # valid_* <= TILE_*: also trims a non-power-of-two tile
    tl.store(q_ptr + (dst_origin + i * dst_stride + j), _e4m3_bits(x).to(tl.uint8), mask=store)
    tl.store(s_ptr + scale_at, tl.max(tl.max(scale_tile, axis=1), axis=0))


def _rects(table: torch.Tensor, tensors: torch.Tensor, owner: torch.Tensor) -> list[tuple[int, ...]]:
    """Each block as rectangles in its tensor's [rows, cols]: (tensor, row, col, h, w, src_offset, src_stride)."""
    rects = []
    for (o, s, d, ds, r, c), t in zip(table.tolist(), owner.tolist()):
        if t < 0:
            continue
        base, _, width, _ = tensors[t].tolist()
        p = d - base
        if r == 1 or (s == c and ds == c):  # contiguous: one run that may wrap rows
            runs = [(p, o, r * c)]
        elif ds == width:  # validated: each row stays within one tensor row
            rects.append((t, p // width, p % width, r, c, o, s))
            continue
        else:  # dst_stride a multiple of the width: rows land on every k-th tensor row
            runs = [(p + k * ds, o + k * s, c) for k in range(r)]
        for p, o, n in runs:  # a run: a partial first row, whole rows, a partial last row
            row, col = divmod(p, width)
            head = min(n, width - col) if col else 0
            if head:
                rects.append((t, row, col, 1, head, o, 0))
                row, o, n = row + 1, o + head, n - head
            if n // width:
                rects.append((t, row, 0, n // width, width, o, width))
            if n % width:
                rects.append((t, row + n // width, 0, 1, n % width, o + n // width * width, 0))
    return rects


def _fp8_plan(
    table: torch.Tensor, tensors: torch.Tensor, owner: torch.Tensor, tile: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tiles [T, 5], piece_start [T + 1], pieces [P, 6]): every tile of every tensor and the pieces that fill it."""
    tm, tn = tile
    _, rows, cols, scale_offset = tensors.unbind(1)
    grid_m, grid_n = (rows + tm - 1) // tm, (cols + tn - 1) // tn
    n_tiles = grid_m * grid_n
    tile_base = torch.cat([torch.zeros(1, dtype=torch.int64), n_tiles.cumsum(0)])
    # Tiles: tensor t, tile (i, j) -> dst origin, row stride, valid rows/cols (edge tiles are partial), scale address.
    t = torch.repeat_interleave(torch.arange(len(tensors)), n_tiles)
    local = torch.arange(int(tile_base[-1])) - tile_base[t]
    ti, tj = local // grid_n[t], local % grid_n[t]
    tiles = torch.stack(
        [
            tensors[t, 0] + ti * tm * cols[t] + tj * tn,
            cols[t],
            (rows[t] - ti * tm).clamp(max=tm),
            (cols[t] - tj * tn).clamp(max=tn),
            scale_offset[t] + local,
        ],
        1,
    )
    rects = torch.tensor(_rects(table, tensors, owner), dtype=torch.int64).view(-1, 7)
    rt, r0, c0, h, w, so, ss = rects.unbind(1)
    i0, j0 = r0 // tm, c0 // tn
    ni, nj = (r0 + h - 1) // tm - i0 + 1, (c0 + w - 1) // tn - j0 + 1
    count = ni * nj
    rid = torch.repeat_interleave(torch.arange(len(rects)), count)
    k = torch.arange(int(count.sum())) - torch.repeat_interleave(count.cumsum(0) - count, count)
    pi, pj = i0[rid] + k // nj[rid], j0[rid] + k % nj[rid]
    top, left = torch.maximum(r0[rid], pi * tm), torch.maximum(c0[rid], pj * tn)
    bottom, right = torch.minimum(r0[rid] + h[rid], (pi + 1) * tm), torch.minimum(c0[rid] + w[rid], (pj + 1) * tn)
    pieces = torch.stack(
        [so[rid] + (top - r0[rid]) * ss[rid] + (left - c0[rid]), ss[rid], top - pi * tm, left - pj * tn],
        1,
    )
    pieces = torch.cat([pieces, torch.stack([bottom - top, right - left], 1)], 1)
    tile_of_piece = tile_base[rt[rid]] + pi * grid_n[rt[rid]] + pj
    order = torch.argsort(tile_of_piece, stable=True)
    per_tile = torch.bincount(tile_of_piece, minlength=len(tiles))
    piece_start = torch.cat([torch.zeros(1, dtype=torch.int64), per_tile.cumsum(0)])
    return tiles, piece_start, pieces[order]


def copy_blocks_fp8(
    src: torch.Tensor,
    dst_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    table: torch.Tensor,
    tensors: torch.Tensor,
    owner: torch.Tensor,
    tile: tuple[int, int],
) -> None:
    """One launch: copy + quantise every tile of `tensors`; validated by `block_copy.copy_blocks_fp8`."""
    tiles, piece_start, pieces = _fp8_plan(table, tensors, owner, tile)
    if len(tiles) == 0:
        return
    meta = torch.cat([tiles.view(-1), piece_start, pieces.view(-1)]).to(src.device)
    n = len(tiles)
    _copy_quantize_kernel[(n,)](
        src,
        dst_fp8.view(torch.uint8),
        scale_inv,
        meta,
        meta[5 * n :],
        meta[6 * n + 1 :],
        TILE_M=tile[0],
        TILE_N=tile[1],
        POW2_M=triton.next_power_of_2(tile[0]),
        POW2_N=triton.next_power_of_2(tile[1]),
        FP8_MAX=448.0,
        num_warps=8,
    )
