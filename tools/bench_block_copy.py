"""Benchmark the weight-sync block copy (gathered TP shards -> HF-layout bucket) on CPU, and on CUDA when present.

    python tools/bench_block_copy.py                         # 100 blocks, 128..8192 rows x 128..7168 cols, 256 MiB
    python tools/bench_block_copy.py --blocks 400 --mib 64 --threads 1

The table is shaped like a real bucket's: blocks of log-uniform rows x cols, half of them whole dim-0 shards
(contiguous on both sides), half dim-1 shards (contiguous in the gathered buffer, one TP-th of each row in the
bucket); row counts are scaled down together so that the bucket holds --mib of bf16. Rates are GB/s of bytes moved
(read + write). Every result is checked bit for bit against `copy_blocks_reference`.
CPU: `copy_blocks` (CPU path: one strided copy per block) against one `index_copy_` over precomputed element indices
(building them is not timed) and a naive copy of one slice per row.
CUDA: the Triton kernel (one launch per table) and one torch copy per block, as GB/s and as a fraction of the
device's memory bandwidth (H100/H200 datasheet figures, or --hbm-gbps); then the copy fused with FP8 quantisation.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

import torch

from mcore_rl.kernels.block_copy import copy_blocks, copy_blocks_fp8, copy_blocks_reference, triton_available

# Datasheet memory bandwidth in GB/s of the SXM parts (PCIe / NVL variants differ: pass --hbm-gbps).
HBM_GBPS = {"H100": 3350.0, "H200": 4800.0, "H800": 3350.0, "A100": 2039.0, "B200": 8000.0}


def realistic_table(n_blocks: int, bucket_elements: int, tp_size: int = 4, seed: int = 0):
    """(table, src elements, dst elements, tensors) for n blocks shaped like a bucket's (see the module docstring);
    tensors: (dst_offset, rows, cols) of the bucket tensor each block writes into."""
    gen = torch.Generator().manual_seed(seed)

    def log_uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.exp(math.log(lo) + torch.rand(n_blocks, generator=gen) * math.log(hi / lo)).long()

    rows, cols = log_uniform(128, 8192), log_uniform(128, 7168)
    rows = (rows * min(1.0, bucket_elements / float((rows * cols).sum()))).long().clamp(min=1)
    out, tensors, src_at, dst_at = [], [], 0, 0
    for b, (r, c) in enumerate(zip(rows.tolist(), cols.tolist())):
        if b % 2 == 0:  # a dim-0 shard: contiguous on both sides
            out.append((src_at, c, dst_at, c, r, c))
            tensors.append((dst_at, r, c))
            dst_at += r * c
        else:  # a dim-1 shard [r, c]: columns [k*c, (k+1)*c) of a [r, tp*c] tensor; the other ranks' are not timed
            out.append((src_at, c, dst_at + (b % tp_size) * c, tp_size * c, r, c))
            tensors.append((dst_at, r, tp_size * c))
            dst_at += r * c * tp_size
        src_at += r * c
    return torch.tensor(out, dtype=torch.int64), src_at, dst_at, tensors


def _seconds(fn: Callable[[], object], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _element_indices(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    src_idx, dst_idx = [], []
    for o, s, d, ds, r, c in table.tolist():
        grid = torch.arange(r).unsqueeze(1), torch.arange(c).unsqueeze(0)
        src_idx.append((o + grid[0] * s + grid[1]).view(-1))
        dst_idx.append((d + grid[0] * ds + grid[1]).view(-1))
    return torch.cat(src_idx), torch.cat(dst_idx)


def _per_row(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor) -> None:
    for o, s, d, ds, r, c in table.tolist():
        for k in range(r):
            dst[d + k * ds : d + k * ds + c].copy_(src[o + k * s : o + k * s + c])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100, help="blocks in the table")
    parser.add_argument("--mib", type=float, default=256.0, help="bf16 bytes the blocks copy, MiB")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (best is reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--hbm-gbps", type=float, default=None, help="device memory bandwidth (default: by name)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16
    table, src_numel, dst_numel, bucket_tensors = realistic_table(args.blocks, int(args.mib * 2**20) // 2)
    moved = 2 * int((table[:, 4] * table[:, 5]).sum()) * dtype.itemsize  # read + write
    src = torch.randn(src_numel, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = torch.zeros(dst_numel, dtype=dtype)
    copy_blocks_reference(src, expected, table)
    print(f"{len(table)} blocks, {moved / 2 / 2**20:.0f} MiB copied ({dtype}); GB/s of bytes read + written")
    src_idx, dst_idx = _element_indices(table)
    cpu_paths = {
        "copy_blocks (cpu)": lambda dst: copy_blocks(src, dst, table),
        "reference": lambda dst: copy_blocks_reference(src, dst, table),
        "index_copy_": lambda dst: dst.index_copy_(0, dst_idx, src.index_select(0, src_idx)),
        "per-row slices": lambda dst: _per_row(src, dst, table),
    }
    print(f"CPU, {args.threads} thread(s):")
    for name, fn in cpu_paths.items():
        dst = torch.zeros(dst_numel, dtype=dtype)
        seconds = _seconds(lambda: fn(dst), args.repeat)  # noqa: B023 - used at once
        if not torch.equal(dst.view(torch.int16), expected.view(torch.int16)):
            print(f"{name}: differs from the reference", file=sys.stderr)
            return 1
        print(f"  {name:>18} {moved / seconds / 1e9:8.2f} GB/s  {seconds * 1e3:8.1f} ms")
    if not torch.cuda.is_available() or not triton_available():
        print("CUDA: not available here (the Triton kernel's figures need a GPU with triton)")
        return 0
    name = torch.cuda.get_device_name()
    peak = args.hbm_gbps or next((v for k, v in HBM_GBPS.items() if k in name), None)
    sync = torch.cuda.synchronize
    src_gpu, expected_gpu = src.cuda(), expected.cuda()
    print(f"CUDA ({name}, peak {peak} GB/s):")
    gpu_paths = {
        "copy_blocks (triton)": lambda dst: copy_blocks(src_gpu, dst, table),
        "torch copy per block": lambda dst: copy_blocks_reference(src_gpu, dst, table),
    }
    for label, fn in gpu_paths.items():
        dst = torch.zeros(dst_numel, dtype=dtype, device="cuda")
        seconds = _seconds(lambda: fn(dst), args.repeat, sync)  # noqa: B023
        if not torch.equal(dst.view(torch.int16), expected_gpu.view(torch.int16)):
            print(f"{label}: differs from the reference", file=sys.stderr)
            return 1
        rate = moved / seconds / 1e9
        fraction = f"{rate / peak:6.1%}" if peak else "   n/a"
        print(f"  {label:>20} {rate:8.1f} GB/s {fraction} of peak  {seconds * 1e6:8.0f} us")
    # FP8: the same blocks into one tensor per block (its own [rows, tp*cols] or [rows, cols]), quantised 128 x 128.
    tensors, scale_at = [], 0
    for base, r, c in bucket_tensors:
        tensors.append((base, r, c, scale_at))
        scale_at += math.ceil(r / 128) * math.ceil(c / 128)
    tensors = torch.tensor(tensors, dtype=torch.int64)
    q = torch.empty(dst_numel, dtype=torch.float8_e4m3fn, device="cuda")
    scale_inv = torch.empty(scale_at, dtype=torch.float32, device="cuda")
    seconds = _seconds(lambda: copy_blocks_fp8(src_gpu, q, scale_inv, table, tensors), args.repeat, sync)
    fp8_moved = int((table[:, 4] * table[:, 5]).sum()) * dtype.itemsize + int((tensors[:, 1] * tensors[:, 2]).sum())
    rate = fp8_moved / seconds / 1e9
    print(f"  {'copy_blocks_fp8':>20} {rate:8.1f} GB/s {rate / peak if peak else float('nan'):6.1%} of peak")
    return 0


if __name__ == "__main__":
    sys.exit(main())
