"""Benchmark blockwise FP8 (128x128 e4m3) dequantisation and quantisation, side by side in one run.

    python tools/bench_fp8.py                          # DeepSeek-V3 expert and attention shapes
    python tools/bench_fp8.py --shape 2048 7168 --repeat 10 --threads 1

CPU: the plain-torch reference against `dequantize_blockwise_cpu` / `quantize_blockwise_cpu` (block rows, a 256-entry
fp8 table: what checkpoint conversion runs), as GB/s of FP8 input (dequantise) or bf16 input (quantise) and their
ratios; every result is checked bit for bit against the reference.
CUDA (when present): the Triton kernels, as GB/s of bytes moved (FP8 in + output out) and that as a fraction of the
device's memory bandwidth given with --hbm-gbps (H100 SXM 3350, H200 4800).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from mcore_rl.kernels.fp8_blockwise import (
    dequantize_blockwise,
    dequantize_blockwise_cpu,
    dequantize_blockwise_ref,
    quantize_blockwise,
    quantize_blockwise_cpu,
    quantize_blockwise_ref,
)

SHAPES = [(2048, 7168), (7168, 2048), (24576, 1536), (7168, 16384)]  # expert fc1 half, fc2, q_b_proj, o_proj


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, action="append", help="weight shape (repeatable)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per measurement (best is reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (a converter worker uses its share)")
    parser.add_argument("--hbm-gbps", type=float, default=3350.0, help="device memory bandwidth for the CUDA fraction")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [tuple(s) for s in args.shape] if args.shape else SHAPES
    print(f"CPU, {args.threads} thread(s): GB/s of FP8 input (dequantise) or of bf16 input (quantise)")
    print(f"{'shape':>14} {'deq ref':>8} {'deq cpu':>8} {'ratio':>6} {'q ref':>8} {'q cpu':>8} {'ratio':>6}")
    for shape in shapes:
        w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        q, scale = quantize_blockwise_ref(w)
        q_cpu, scale_cpu = quantize_blockwise_cpu(w)
        same_q = torch.equal(q_cpu.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale_cpu, scale)
        if not same_q or not torch.equal(dequantize_blockwise_cpu(q, scale), dequantize_blockwise_ref(q, scale)):
            print(f"{shape}: the CPU path differs from the reference", file=sys.stderr)
            return 1
        ref = _seconds(lambda: dequantize_blockwise_ref(q, scale), args.repeat)  # noqa: B023 - used at once
        cpu = _seconds(lambda: dequantize_blockwise_cpu(q, scale), args.repeat)  # noqa: B023
        quant = _seconds(lambda: quantize_blockwise_ref(w), args.repeat)  # noqa: B023
        quant_cpu = _seconds(lambda: quantize_blockwise_cpu(w), args.repeat)  # noqa: B023
        n = q.numel()
        rates = (
            f"{n / ref / 1e9:8.3f} {n / cpu / 1e9:8.3f} {ref / cpu:5.1f}x "
            f"{2 * n / quant / 1e9:8.3f} {2 * n / quant_cpu / 1e9:8.3f} {quant / quant_cpu:5.1f}x"
        )
        print(f"{str(shape):>14} {rates}")
    if not torch.cuda.is_available():
        print("CUDA: not available here (the Triton kernels' figures need a GPU)")
        return 0
    print(f"CUDA ({torch.cuda.get_device_name()}): GB/s of bytes moved, fraction of {args.hbm_gbps:.0f} GB/s")
    print(f"{'shape':>14} {'dequant':>8} {'frac':>6} {'quant':>8} {'frac':>6}")
    for shape in shapes:
        w = torch.randn(shape, device="cuda").to(torch.bfloat16)
        q, scale = quantize_blockwise(w)
        sync = torch.cuda.synchronize
        deq = _seconds(lambda: dequantize_blockwise(q, scale), args.repeat, sync)  # noqa: B023
        quant = _seconds(lambda: quantize_blockwise(w), args.repeat, sync)  # noqa: B023
        moved = q.numel() * 3  # 1 byte in, 2 bytes out (bf16) each way
        print(
            f"{str(shape):>14} {moved / deq / 1e9:8.1f} {moved / deq / 1e9 / args.hbm_gbps:6.1%} "
            f"{moved / quant / 1e9:8.1f} {moved / quant / 1e9 / args.hbm_gbps:6.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
