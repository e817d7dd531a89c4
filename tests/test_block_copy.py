"""Block copies (weight sync's reshard step): the reference against hand-built HF layouts, the CPU path and the Triton
kernel (under TRITON_INTERPRET=1 in a subprocess, and on CUDA) against the reference, the fused FP8 path against
`fp8_blockwise.quantize_blockwise_ref`, and the refusal of bad tables."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcore_rl.kernels.block_copy import (
    BLOCK_FIELDS,
    copy_blocks,
    copy_blocks_cpu,
    copy_blocks_fp8,
    copy_blocks_fp8_reference,
    copy_blocks_reference,
)
from mcore_rl.kernels.fp8_blockwise import FP8_DTYPE, quantize_blockwise_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---- a bucket of every transform, built from real shards -----------------------------------------------------------


def _bucket(tp_size: int, dtype: torch.dtype = torch.float32, seed: int = 0, hidden: int = 24, head_dim: int = 8):
    """Gathered buffer, table, HF tensors and their offsets in the bucket, for one bucket holding
    a dim-0 split (column-parallel), a dim-1 split (row-parallel), QKV (4 query groups of 2 heads), GLU fc1 and a
    vocab-padded embedding. Each rank's pieces are back to back; the ranks follow one another (an all-gather)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)
    groups, q_per_group, ffn, vocab, padded_vocab = 4, 2, 16, 37, 64
    hf = {
        "col": rand(8 * tp_size, hidden),
        "row": rand(hidden, 12 * tp_size),
        "q": rand(groups * q_per_group * head_dim, hidden),
        "k": rand(groups * head_dim, hidden),
        "v": rand(groups * head_dim, hidden),
        "gate": rand(ffn, hidden),
        "up": rand(ffn, hidden),
        "embed": rand(vocab, hidden),
    }
    # Megatron layouts: QKV interleaved per query group; fc1 is [gate_r; up_r] per TP rank; the vocab padded.
    qkv = torch.cat(
        [
            torch.cat([q.reshape(q_per_group * head_dim, hidden), k, v])
            for q, k, v in zip(hf["q"].chunk(groups), hf["k"].chunk(groups), hf["v"].chunk(groups))
        ]
    )
    embed = torch.cat([hf["embed"], torch.zeros(padded_vocab - vocab, hidden, dtype=dtype)])
    shards = [
        hf["col"].chunk(tp_size, 0),
        [s.contiguous() for s in hf["row"].chunk(tp_size, 1)],
        qkv.chunk(tp_size, 0),
        [torch.cat([g, u]) for g, u in zip(hf["gate"].chunk(tp_size), hf["up"].chunk(tp_size))],
        embed.chunk(tp_size, 0),
    ]
    per_rank = [torch.cat([s[r].reshape(-1) for s in shards]) for r in range(tp_size)]
    gathered = torch.cat(per_rank)
    piece_at = [0]
    for s in shards[:-1]:
        piece_at.append(piece_at[-1] + s[0].numel())
    dst_at, size = {}, 0
    for name, t in hf.items():
        dst_at[name], size = size, size + t.numel()
    table = []
    for r in range(tp_size):
        base = r * per_rank[0].numel()
        col, row, qkv_at, fc1, emb = (base + p for p in piece_at)
        m = hf["col"].shape[0] // tp_size
        table.append((col, hidden, dst_at["col"] + r * m * hidden, hidden, m, hidden))
        n = hf["row"].shape[1] // tp_size
        table.append((row, n, dst_at["row"] + r * n, tp_size * n, hidden, n))
        group_rows = (q_per_group + 2) * head_dim
        for local in range(groups // tp_size):
            g, at = r * groups // tp_size + local, qkv_at + local * group_rows * hidden
            q_rows = q_per_group * head_dim
            table.append((at, hidden, dst_at["q"] + g * q_rows * hidden, hidden, q_rows, hidden))
            at += q_rows * hidden  # k and v of the group follow its q heads
            table.append((at, hidden, dst_at["k"] + g * head_dim * hidden, hidden, head_dim, hidden))
            at += head_dim * hidden
            table.append((at, hidden, dst_at["v"] + g * head_dim * hidden, hidden, head_dim, hidden))
        f = ffn // tp_size
        table.append((fc1, hidden, dst_at["gate"] + r * f * hidden, hidden, f, hidden))
        table.append((fc1 + f * hidden, hidden, dst_at["up"] + r * f * hidden, hidden, f, hidden))
        v = padded_vocab // tp_size
        kept = max(0, min(v, vocab - r * v))  # rank 3 of 4 holds only padding: a block of 0 rows
        table.append((emb, hidden, dst_at["embed"] + r * v * hidden, hidden, kept, hidden))
    return gathered, torch.tensor(table, dtype=torch.int64), hf, dst_at, size


def _assert_bucket(dst: torch.Tensor, hf: dict[str, torch.Tensor], dst_at: dict[str, int]) -> None:
    for name, t in hf.items():
        got = dst[dst_at[name] : dst_at[name] + t.numel()].view(t.shape)
        assert torch.equal(got, t), name


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_reference_assembles_hf_tensors_from_gathered_shards(tp_size):
    gathered, table, hf, dst_at, size = _bucket(tp_size)
    dst = torch.full((size,), float("nan"))
    copy_blocks_reference(gathered, dst, table)
    _assert_bucket(dst, hf, dst_at)
    assert not dst.isnan().any()  # the table covers the whole bucket


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_assembles_hf_tensors(tp_size, dtype):
    gathered, table, hf, dst_at, size = _bucket(tp_size, dtype)
    dst = torch.zeros(size, dtype=dtype)
    copy_blocks(gathered, dst, table)
    _assert_bucket(dst, hf, dst_at)


# ---- random tables -------------------------------------------------------------------------------------------------


def _random_table(seed: int, n: int = 40, src_numel: int = 20000, unit: int = 1) -> tuple[torch.Tensor, int]:
    """(table, dst elements): blocks with disjoint destinations: strided and contiguous blocks, one-row and empty
    blocks, pairs that interleave columns of the same destination rows (a dim-1 split); sources overlap freely
    (stride 0 included). Every offset, stride and width is a multiple of `unit` (the kernel then moves wider words)."""
    gen = torch.Generator().manual_seed(seed)
    randint = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))
    units = src_numel // unit
    blocks, dst_at = [], 0
    while len(blocks) < n:
        rows, cols, kind = randint(0, 12), randint(1, 40), randint(0, 3)
        src_stride = [cols, randint(0, 2 * cols), 0][randint(0, 3)]
        src_offset = randint(0, units - max(rows - 1, 0) * src_stride - cols - 3)
        if kind == 0:  # contiguous on both sides
            blocks.append((randint(0, units - rows * cols), cols, dst_at, cols, rows, cols))
            dst_at += rows * cols
        elif kind == 1:  # interleaved columns: two blocks share destination rows
            left = randint(1, cols + 1)
            blocks.append((src_offset, src_stride, dst_at, cols + 3, rows, left))
            blocks.append((src_offset, src_stride, dst_at + left, cols + 3, rows, cols + 3 - left))
            dst_at += rows * (cols + 3)
        else:  # strided destination with a gap after each row
            gap = randint(0, 9)
            blocks.append((src_offset, src_stride, dst_at, cols + gap, rows, cols))
            dst_at += rows * (cols + gap) + randint(0, 5)
    order = torch.randperm(len(blocks), generator=gen)
    scale = torch.tensor([unit, unit, unit, unit, 1, unit])  # rows stay rows
    return torch.tensor(blocks, dtype=torch.int64)[order] * scale, (dst_at + 7) * unit


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_path_is_the_reference_bit_for_bit(seed, dtype):
    table, dst_numel = _random_table(seed, unit=1 + seed % 2 * 3)
    src = torch.randn(20000, generator=torch.Generator().manual_seed(seed)).to(dtype)
    src[::97] = float("nan")  # NaNs are values like any other: copied, never compared
    dst, ref = torch.randn(dst_numel).to(dtype), torch.zeros(dst_numel, dtype=dtype)
    ref.copy_(dst)  # untouched elements must stay as they were
    copy_blocks_cpu(src, dst, table)
    copy_blocks_reference(src, ref, table)
    assert torch.equal(_bits(dst), _bits(ref))


def test_buffers_may_be_slices_of_a_larger_tensor():
    gathered, table, hf, dst_at, size = _bucket(2)
    big_src, big_dst = torch.cat([torch.zeros(5), gathered]), torch.zeros(size + 9)
    copy_blocks(big_src[5:], big_dst[3 : 3 + size], table)
    _assert_bucket(big_dst[3 : 3 + size], hf, dst_at)
    assert not big_dst[:3].any() and not big_dst[3 + size :].any()


# ---- FP8 -----------------------------------------------------------------------------------------------------------


def _fp8_tensors(hf: dict[str, torch.Tensor], dst_at: dict[str, int], tile: tuple[int, int]) -> torch.Tensor:
    rows, scale_at = [], 0
    for name, t in hf.items():
        rows.append((dst_at[name], t.shape[0], t.shape[1], scale_at))
        scale_at += math.ceil(t.shape[0] / tile[0]) * math.ceil(t.shape[1] / tile[1])
    return torch.tensor(rows, dtype=torch.int64)


def _fp8_buffers(tensors: torch.Tensor, size: int, tile: tuple[int, int]):
    last = tensors[-1].tolist()
    scales = last[3] + math.ceil(last[1] / tile[0]) * math.ceil(last[2] / tile[1])
    return torch.zeros(size, dtype=FP8_DTYPE), torch.zeros(scales)


def _odd_layouts(dtype: torch.dtype = torch.float32):
    """Blocks the FP8 plan must cut up: a contiguous run wrapping rows, a block on every other row, a one-row block
    across rows of a tensor wider than a tile, uncovered elements (quantised as zeros), a -0.0."""
    src = torch.randn(3000, generator=torch.Generator().manual_seed(3)).to(dtype)
    src[7] = -0.0
    table = torch.tensor(
        [
            [0, 130, 15, 130, 1, 130],  # A [50, 40]: elements 15..144, rows 0..3
            [200, 33, 405, 80, 10, 30],  # A rows 10, 12, ..., 28 from column 5
            [1000, 250, 1205, 250, 2, 250],  # contiguous [2, 250]: a run from A row 30, column 5
            [2000, 500, 2050, 1, 1, 500],  # B [3, 300] at 2000: one row of 500 from column 50
        ],
        dtype=torch.int64,
    )
    tensors = torch.tensor([[0, 50, 40, 0], [2000, 3, 300, 20]], dtype=torch.int64)  # tile (16, 16): 4 x 3 scales
    return src, table, tensors, 2900, (16, 16), 20 + 19


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_cpu_path_is_the_reference_and_quantizes_the_hf_tensors(tp_size, dtype):
    tile = (128, 128)
    gathered, table, hf, dst_at, size = _bucket(tp_size, dtype, hidden=200, head_dim=48)  # tiles span blocks
    tensors = _fp8_tensors(hf, dst_at, tile)
    q, s = _fp8_buffers(tensors, size, tile)
    q_ref, s_ref = _fp8_buffers(tensors, size, tile)
    copy_blocks_fp8(gathered, q, s, table, tensors, tile)
    copy_blocks_fp8_reference(gathered, q_ref, s_ref, table, tensors, tile)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    for (d, r, c, so), (name, t) in zip(tensors.tolist(), hf.items()):
        q_hf, s_hf = quantize_blockwise_ref(t, tile)
        assert torch.equal(q[d : d + r * c].view(torch.uint8), q_hf.view(-1).view(torch.uint8)), name
        assert torch.equal(s[so : so + s_hf.numel()], s_hf.view(-1)), name


def test_fp8_cpu_path_handles_wrapping_strided_and_uncovered_blocks():
    src, table, tensors, size, tile, scales = _odd_layouts()
    q, q_ref = torch.zeros(size, dtype=FP8_DTYPE), torch.zeros(size, dtype=FP8_DTYPE)
    s, s_ref = torch.zeros(scales), torch.zeros(scales)
    copy_blocks_fp8(src, q, s, table, tensors, tile)
    copy_blocks_fp8_reference(src, q_ref, s_ref, table, tensors, tile)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert (q_ref[145:405].float() == 0).all() and (s_ref[:12] != 1).any() and (s_ref == 1).any()


def _e4m3_boundaries() -> torch.Tensor:
    """A [16, 128] fp32 tile whose amax is 448 (so the scale is 1 and w / s = w): every e4m3 value, every midpoint
    between neighbours (ties go to even) and one fp32 ulp either side of it, negated too, plus -0.0 and subnormals."""
    codes = torch.arange(127, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0 .. 448
    mid = (codes[:-1] + codes[1:]) / 2
    up, down = torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(0.0))
    tiny = torch.tensor([2.0**-10, 3 * 2.0**-10, 1e-40, 2.0**-7 * 0.999, -0.0])
    values = torch.cat([codes, mid, up, down, tiny])
    values = torch.cat([values, -values, torch.tensor([448.0])])
    tile = torch.zeros(16 * 128)
    tile[: len(values)] = values
    return tile


def test_fp8_rounds_ties_to_even_like_torch():
    src = _e4m3_boundaries()
    table, tensors, *_ = _e4m3_case()
    q, s = torch.zeros(src.numel(), dtype=FP8_DTYPE), torch.zeros(1)
    copy_blocks_fp8(src, q, s, table, tensors)
    assert s.item() == 1.0
    assert torch.equal(q.view(torch.uint8), src.to(FP8_DTYPE).view(torch.uint8))


# ---- bad tables ----------------------------------------------------------------------------------------------------


def _good_table() -> torch.Tensor:
    return torch.tensor([[0, 10, 0, 10, 2, 10], [20, 10, 20, 12, 3, 10]], dtype=torch.int64)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("src_offset", -1, "block 1: src_offset = -1 is negative"),
        ("rows", -2, "block 1: rows = -2 is negative"),
        ("dst_stride", 9, r"block 1: dst_stride: dst_stride 9 < cols: the block's rows overlap in dst"),
        ("src_offset", 75, r"block 1: src_offset: src_offset 75 \+ \(3 - 1\) \* 10 \+ 10 > src.numel\(\) 100"),
        ("dst_offset", 60, r"block 1: dst_offset: dst_offset 60 \+ \(3 - 1\) \* 12 \+ 10 > dst.numel\(\) 80"),
        ("src_stride", 45, r"block 1: src_offset: src_offset 20 \+ \(3 - 1\) \* 45 \+ 10 > src.numel\(\) 100"),
    ],
)
def test_bad_tables_name_the_block_and_field(field, value, message):
    table = _good_table()
    table[1, BLOCK_FIELDS.index(field)] = value
    for fn in (copy_blocks, copy_blocks_cpu, copy_blocks_reference):
        with pytest.raises(ValueError, match=message):
            fn(torch.zeros(100), torch.zeros(80), table)
    empty = table.clone()
    empty[1, 4] = 0  # an empty block is never out of bounds (only negative fields are refused)
    if value >= 0:
        copy_blocks(torch.zeros(100), torch.zeros(80), empty)


def test_bad_buffers_and_table_types_are_refused():
    src, dst, table = torch.zeros(100), torch.zeros(80), _good_table()
    with pytest.raises(ValueError, match="int64 tensor"):
        copy_blocks(src, dst, table.int())
    with pytest.raises(ValueError, match="6 columns"):
        copy_blocks(src, dst, table[:, :5])
    with pytest.raises(ValueError, match="share a dtype"):
        copy_blocks(src, dst.double(), table)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        copy_blocks(src.view(10, 10), dst, table)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        copy_blocks(torch.zeros(200)[::2], dst, table)


def test_bad_fp8_tables_are_refused():
    src, q, s = torch.zeros(100), torch.zeros(80, dtype=FP8_DTYPE), torch.zeros(4)
    tensors = torch.tensor([[0, 2, 10, 0], [20, 5, 12, 1]], dtype=torch.int64)
    table = _good_table()
    copy_blocks_fp8(src, q, s, table, tensors)  # valid as is
    with pytest.raises(ValueError, match=r"block 1: dst_stride 12 / cols 10 do not keep its rows within rows"):
        copy_blocks_fp8(src, q, s, table, torch.tensor([[0, 2, 10, 0], [20, 4, 15, 1]]))
    with pytest.raises(ValueError, match="block 1: dst_offset 20 .* is not inside one tensor"):
        copy_blocks_fp8(src, q, s, table, tensors[:1])
    with pytest.raises(ValueError, match="tensors rows 0 and 1 overlap \\(dst_offset\\)"):
        copy_blocks_fp8(src, q, s, table, torch.tensor([[0, 3, 10, 0], [20, 5, 12, 1]]))
    with pytest.raises(ValueError, match="tensors rows 0 and 1 overlap \\(scale_offset\\)"):
        copy_blocks_fp8(src, q, s, table, torch.tensor([[0, 2, 10, 1], [20, 5, 12, 1]]))
    with pytest.raises(ValueError, match=r"tensors row 1: scale_offset 4 \+ 1 > scale_inv.numel\(\) 4"):
        copy_blocks_fp8(src, q, s, table, torch.tensor([[0, 2, 10, 0], [20, 5, 12, 4]]))
    with pytest.raises(ValueError, match="tensors row 0: rows = -2 is negative"):
        copy_blocks_fp8(src, q, s, table, torch.tensor([[0, -2, 10, 0]]))
    with pytest.raises(ValueError, match="src must be one of"):
        copy_blocks_fp8(src.double(), q, s, table, tensors)
    with pytest.raises(ValueError, match="dst_fp8 must be"):
        copy_blocks_fp8(src, q.float(), s, table, tensors)


# ---- Triton: under the interpreter (a subprocess), and on CUDA ----------------------------------------------------


def _triton_checks(device: str) -> dict[str, bool]:
    """Every Triton-path result against the reference (computed on the CPU); run on CUDA, or on CPU tensors in a
    process started with TRITON_INTERPRET=1 (the flag is read when the kernels are defined, so it must be set before
    they are imported). Sizes are small: the interpreter runs each program as numpy code."""
    from mcore_rl.kernels import block_copy

    to = lambda t: t.to(device)
    results = {"triton_used": block_copy._kernels_for(torch.zeros(1, device=device)) is not None}
    for dtype in DTYPES:
        for seed, unit in ((0, 1), (1, 4)):  # unit 4: every field a multiple of 4: moved as int64 / int32 words
            table, dst_numel = _random_table(seed, n=12, unit=unit)
            src = torch.randn(20000, generator=torch.Generator().manual_seed(seed)).to(dtype)
            init = torch.randn(dst_numel).to(dtype)
            ref, dst = init.clone(), to(init)
            copy_blocks_reference(src, ref, table)
            copy_blocks(to(src), dst, table)
            results[f"random {dtype} unit {unit}"] = torch.equal(_bits(dst.cpu()), _bits(ref))
    for tp_size in (1, 2, 4):
        gathered, table, hf, dst_at, size = _bucket(tp_size, torch.bfloat16)
        dst = torch.zeros(size, dtype=torch.bfloat16, device=device)
        copy_blocks(to(gathered), dst, table)
        results[f"bucket tp {tp_size}"] = all(
            torch.equal(dst[dst_at[n] : dst_at[n] + t.numel()].cpu().view(t.shape), t) for n, t in hf.items()
        )
    cases = {"e4m3 ties": (_e4m3_boundaries(), *_e4m3_case())}
    gathered, table, hf, dst_at, size = _bucket(2, torch.bfloat16, hidden=40, head_dim=8)
    tensors = _fp8_tensors(hf, dst_at, (32, 32))  # 32 x 32 tiles keep the interpreter quick; they span blocks
    cases["fp8 bucket"] = (
        gathered,
        table,
        tensors,
        size,
        (32, 32),
        int(_fp8_buffers(tensors, size, (32, 32))[1].numel()),
    )
    cases["fp8 odd layouts"] = _odd_layouts(torch.float16)
    for name, (src, table, tensors, size, tile, scales) in cases.items():
        q_ref, s_ref = torch.zeros(size, dtype=FP8_DTYPE), torch.zeros(scales)
        copy_blocks_fp8_reference(src, q_ref, s_ref, table, tensors, tile)
        q, s = torch.zeros(size, dtype=FP8_DTYPE, device=device), torch.zeros(scales, device=device)
        copy_blocks_fp8(to(src), q, s, table, tensors, tile)
        results[name] = torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s.cpu(), s_ref)
    return results


def _e4m3_case():
    table = torch.tensor([[0, 128, 0, 128, 16, 128]], dtype=torch.int64)
    return table, torch.tensor([[0, 16, 128, 0]], dtype=torch.int64), 16 * 128, (128, 128), 1


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, bool]:
    pytest.importorskip("triton")
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_block_copy as t; "
        "print(json.dumps(t._triton_checks('cpu')))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_interpreter_runs_the_triton_kernels(interpreter_results):
    assert interpreter_results["triton_used"]


def test_triton_copy_is_the_reference_bit_for_bit_under_the_interpreter(interpreter_results):
    copies = {k: v for k, v in interpreter_results.items() if k.startswith(("random", "bucket"))}
    assert len(copies) == 9 and all(copies.values()), copies


def test_triton_fp8_is_the_reference_bit_for_bit_under_the_interpreter(interpreter_results):
    fp8 = {k: v for k, v in interpreter_results.items() if k.startswith(("e4m3", "fp8"))}
    assert len(fp8) == 3 and all(fp8.values()), fp8


@pytest.mark.gpu
def test_triton_is_the_reference_bit_for_bit_on_cuda():
    pytest.importorskip("triton")
    results = _triton_checks("cuda")
    assert all(results.values()), {k: v for k, v in results.items() if not v}


def test_bench_block_copy_smoke(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_block_copy

    assert bench_block_copy.main(["--blocks", "6", "--mib", "1", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "copy_blocks (cpu)" in out and "index_copy_" in out and "GB/s" in out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tables_traced_from_the_transforms_pack_a_bucket(tp: int) -> None:
    """resharding/sync/blocks.py: run each transform on index shards, compress to blocks, copy: the HF tensors."""
    import itertools

    from mcore_rl.resharding.sync.blocks import blocks_of, trace_outputs
    from mcore_rl.resharding.transforms import QKV, FusedColumns, Split, VocabSplit

    cases = [
        (Split(dim=0), [torch.randn(8, 6)]),
        (Split(dim=1), [torch.randn(6, 8)]),
        (FusedColumns(num_hf=2), [torch.randn(8, 6), torch.randn(8, 6)]),
        (QKV(num_heads=8, num_query_groups=4, head_dim=2), [torch.randn(16, 6), torch.randn(8, 6), torch.randn(8, 6)]),
        (VocabSplit(vocab_size=10, padded_vocab=16), [torch.randn(10, 6).bfloat16()]),
        (Split(dim=0), [torch.randn(8)]),
    ]
    for transform, hf in cases:
        shards = [transform.to_megatron(hf, g, tp) for g in range(tp)]
        row = shards[0].numel() * shards[0].element_size()
        gathered = torch.cat([s.contiguous().reshape(-1).view(torch.uint8) for s in shards])
        expected = transform.to_hf(shards)
        sizes = [t.numel() * t.element_size() for t in expected]
        offsets = list(itertools.accumulate([0, *sizes[:-1]]))
        index = trace_outputs(transform, tuple(shards[0].shape), shards[0].element_size(), [g * row for g in range(tp)])
        blocks = [b for out, off in zip(index, offsets) for b in blocks_of(out, shards[0].element_size(), off)]
        bucket = torch.zeros(sum(sizes), dtype=torch.uint8)
        copy_blocks_reference(gathered, bucket, torch.tensor(blocks, dtype=torch.int64).reshape(-1, 6))
        for t, off, n in zip(expected, offsets, sizes):
            assert torch.equal(bucket[off : off + n].view(t.dtype).view(t.shape), t.contiguous()), transform
        assert len(blocks) <= 4 * tp * len(expected) + 8, "rows with one pattern merge into few blocks"
