"""Kit step `kernels`: the Triton kernels at the production 128x128 tile, bit-exact against their torch references,
with GB/s as a fraction of a measured device-to-device copy and of the datasheet, and registers / spills per kernel.

    block_copy        a bucket-shaped table of 2D blocks (tools/bench_block_copy.py: realistic_table), bf16
    block_copy_fp8    the same copy fused with 128x128 e4m3 quantisation
    fp8_quantize      a [7168, 2048] bf16 weight (a DeepSeek-V3 projection) -> e4m3 + weight_scale_inv
    fp8_dequantize    and back to bf16

GB/s counts bytes read + written once. --dry-cpu runs the CPU paths against the same references (no rates).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

#: Datasheet memory bandwidth in GB/s (SXM parts; PCIe/NVL variants are lower: the fraction then reads low).
HBM_GBPS = {"H100": 3350.0, "H200": 4800.0, "H800": 3350.0, "H20": 4000.0, "A100": 2039.0, "B200": 8000.0}
TARGET = 0.70  #: kernels at >= 70 % of the measured device-to-device copy


def datasheet_gbps(name: str) -> float | None:
    words = name.replace("-", " ").split()
    for key, gbps in HBM_GBPS.items():
        if any(w == key or w.startswith(key) for w in words):
            return gbps
    return None


def _seconds(fn: Callable[[], object], repeat: int = 20) -> float:
    """Median seconds of `fn` on the GPU (CUDA events), after two warm-up calls (compilation)."""
    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def registers(jit_fn: Any) -> dict[str, Any]:
    """Registers per thread and spills of the kernels `jit_fn` compiled in this process (Triton 3.x keeps them on
    each CompiledKernel; where this Triton keeps them elsewhere, None)."""
    caches = getattr(jit_fn, "device_caches", None) or getattr(jit_fn, "cache", None) or {}
    out = []
    for value in caches.values():
        cache = value[0] if isinstance(value, tuple) else value
        for kernel in getattr(cache, "values", lambda: [])():
            init = getattr(kernel, "_init_handles", None)
            if init:
                init()
            out.append({"regs": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None)})
    return {"kernels": out} if out else {"kernels": None}


def run(rec: Any, dry: bool) -> None:
    """The step body (see the module docstring)."""
    from mcore_rl.kernels import block_copy, fp8_blockwise
    from tools.bench_block_copy import realistic_table

    device = torch.device("cpu" if dry else "cuda")
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    # --- a measured device-to-device copy: the yardstick
    if not dry:
        name = torch.cuda.get_device_name()
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        d2d = 2 * src.numel() / _seconds(lambda: dst.copy_(src)) / 1e9
        src = dst = None  # 2 GiB back before the kernels' buffers
        rec["d2d_copy_gbps"] = round(d2d, 1)
        rec["datasheet_gbps"] = datasheet_gbps(name)
    # --- block copy (bf16) and the fused FP8 copy
    table, src_n, dst_n, tensors = realistic_table(100, (256 << 20) // 2 if not dry else 1 << 20)
    src = torch.randn(src_n, dtype=torch.bfloat16, device=device)
    dst, ref = torch.zeros(dst_n, dtype=torch.bfloat16, device=device), torch.zeros(dst_n, dtype=torch.bfloat16)
    block_copy.copy_blocks(src, dst, table)
    block_copy.copy_blocks_reference(src.cpu(), ref, table)
    moved = 2 * 2 * int((table[:, 4] * table[:, 5]).sum())
    results["block_copy"] = {"bit_exact": torch.equal(dst.cpu(), ref)}
    if not dry:
        results["block_copy"]["gbps"] = moved / _seconds(lambda: block_copy.copy_blocks(src, dst, table)) / 1e9
    rec["block_copy"] = results["block_copy"]
    results["block_copy_fp8"] = _fp8_copy(block_copy, src, dst_n, table, tensors, dry)
    rec["block_copy_fp8"] = results["block_copy_fp8"]
    # --- FP8 quantise / dequantise of one weight at the 128x128 tile
    w = torch.randn(7168, 2048, dtype=torch.bfloat16, device=device) if not dry else torch.randn(384, 256)
    q, s = fp8_blockwise.quantize_blockwise(w, (128, 128))
    q_ref, s_ref = fp8_blockwise.quantize_blockwise_ref(w.cpu(), (128, 128))
    exact = torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s.cpu(), s_ref)
    results["fp8_quantize"] = {"bit_exact": exact}
    y = fp8_blockwise.dequantize_blockwise(q, s, (128, 128), torch.bfloat16)
    y_ref = fp8_blockwise.dequantize_blockwise_ref(q_ref, s_ref, (128, 128), torch.bfloat16)
    results["fp8_dequantize"] = {"bit_exact": torch.equal(y.cpu(), y_ref)}
    if not dry:
        n = w.numel()
        results["fp8_quantize"]["gbps"] = (2 * n + n) / _seconds(lambda: fp8_blockwise.quantize_blockwise(w)) / 1e9
        results["fp8_dequantize"]["gbps"] = (n + 2 * n) / _seconds(
            lambda: fp8_blockwise.dequantize_blockwise(q, s, (128, 128), torch.bfloat16)
        ) / 1e9  # fmt: skip
    rec["fp8_quantize"], rec["fp8_dequantize"] = results["fp8_quantize"], results["fp8_dequantize"]
    if not dry:
        _rates_and_registers(rec, results)
    rec["summary"] = ", ".join(
        f"{k}: {'exact' if v['bit_exact'] else 'NOT EXACT'}" + (f" {v['of_d2d']:.0%} of d2d" if "of_d2d" in v else "")
        for k, v in results.items()
    )
    if not all(v["bit_exact"] for v in results.values()):
        rec["status"] = "failed"


def _fp8_copy(block_copy: Any, src: torch.Tensor, dst_n: int, table: torch.Tensor, tensors: list, dry: bool) -> dict:
    """The copy fused with 128x128 e4m3 quantisation, against copy_blocks_fp8_reference."""
    from mcore_rl.kernels.fp8_blockwise import scale_grid_shape

    rows = []
    scale_at = 0
    for d, r, c in tensors:
        rows.append((d, r, c, scale_at))
        g = scale_grid_shape((r, c))
        scale_at += g[0] * g[1]
    spec = torch.tensor(rows, dtype=torch.int64)
    out = torch.zeros(dst_n, dtype=torch.float8_e4m3fn, device=src.device)
    scale = torch.zeros(scale_at, dtype=torch.float32, device=src.device)
    out_ref, scale_ref = torch.zeros(dst_n, dtype=torch.float8_e4m3fn), torch.zeros(scale_at)
    block_copy.copy_blocks_fp8(src, out, scale, table, spec)
    block_copy.copy_blocks_fp8_reference(src.cpu(), out_ref, scale_ref, table, spec)
    exact = torch.equal(out.cpu().view(torch.uint8), out_ref.view(torch.uint8)) and torch.equal(scale.cpu(), scale_ref)
    result: dict[str, Any] = {"bit_exact": exact}
    if not dry:
        elements = int((table[:, 4] * table[:, 5]).sum())
        seconds = _seconds(lambda: block_copy.copy_blocks_fp8(src, out, scale, table, spec))
        result["gbps"] = (2 * elements + elements) / seconds / 1e9  # bf16 read, e4m3 written
    return result


def _rates_and_registers(rec: Any, results: dict[str, Any]) -> None:
    """Each kernel's GB/s as a fraction of the measured copy and the datasheet; its registers and spills."""
    from mcore_rl.kernels import block_copy_triton, fp8_blockwise_triton

    d2d, sheet = rec["d2d_copy_gbps"], rec["datasheet_gbps"]
    jit = {
        "block_copy": block_copy_triton._copy_blocks_kernel,
        "block_copy_fp8": block_copy_triton._copy_quantize_kernel,
        "fp8_quantize": fp8_blockwise_triton._quantize_kernel,
        "fp8_dequantize": fp8_blockwise_triton._dequantize_kernel,
    }
    for name, value in results.items():
        value["gbps"] = round(value["gbps"], 1)
        value["of_d2d"] = round(value["gbps"] / d2d, 3)
        value["of_datasheet"] = round(value["gbps"] / sheet, 3) if sheet else None
        value["meets_70pct_of_d2d"] = value["of_d2d"] >= TARGET
        value.update(registers(jit[name]))
        rec[name] = value
    rec["timed_at"] = time.strftime("%H:%M:%S")
