"""Benchmark checkpoint conversion on a synthetic checkpoint with DeepSeek-V3's structure, both directions.

    python tools/bench_convert.py --size-gb 10 --workdir /tmp/bench --nproc 2
    python tools/bench_convert.py --size-gb 10 --workdir /tmp/bench --nproc 2 --cold    # reads from disk (root)
    python tools/bench_convert.py --size-gb 0.05 --layers 4 --experts 8 --nproc 2    # a quick smoke run

Builds (streaming, one shard in memory) an HF checkpoint shaped like DeepSeek-V3: 61 layers (3 dense, then MoE),
256 routed experts + 1 shared, MLA attention, 1 MTP layer stored as model.layers.61.* with its embedding/head copies,
and small hidden sizes; the routed-expert width is chosen so the checkpoint reaches --size-gb (bf16). Then, in one
run, for each direction:

    raw read of the input files       (sequential 64 MiB reads: the ceiling for reading these bytes here)
    raw copy of the input files       (the same reads, each chunk written to a scratch file: reading plus writing)
    the conversion                    (tools/convert_checkpoint.py with --nproc workers)

and prints GB/s for each, the conversion's rate as a fraction of the raw read (the target: >= 50%) and of the raw
copy, the slowest worker's time per phase, and the peak RSS (getrusage ru_maxrss) of every worker and of this
process (target: <= 2 GB). Dirty pages are written back (sync) before each measurement; with --cold the page cache
is also evicted, so every read comes from the disk, the regime of a real checkpoint (1.3 TB) that memory cannot
cache. Without it the just-written files are read from memory, and the raw read is a memory copy rate. Free disk
is checked first (three copies of the checkpoint plus a scratch copy); when short, the size is reduced and the
report says so. Nothing is verified numerically here (tests/test_convert.py does that); the output is spot-checked
by tensor count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convert_checkpoint  # noqa: E402

from mcore_rl.resharding.hf_io import HFCheckpointReader, HFCheckpointWriter  # noqa: E402

GB = 1e9


def deepseek_like_config(layers: int, experts: int, moe_width: int, hidden: int = 256) -> dict:
    """A DeepSeek-V3 config.json with small hidden sizes (3 dense layers, MLA, 1 MTP layer, group routing)."""
    groups = 8 if experts % 8 == 0 and experts >= 16 else 1
    return dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=moe_width,
        num_hidden_layers=layers,
        first_k_dense_replace=min(3, layers - 1),
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=hidden // 2,
        kv_lora_rank=hidden // 4,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=8 if groups > 1 else 2,
        n_group=groups,
        topk_group=4 if groups > 1 else 1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        num_nextn_predict_layers=1,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every HF tensor name and shape of the config (main layers, MTP layer with its copies, embeddings)."""
    h, heads, q_lora, kv_lora = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out = [("model.embed_tokens.weight", (c["vocab_size"], h)), ("model.norm.weight", (h,))]
    out.append(("lm_head.weight", (c["vocab_size"], h)))
    L, E, moe = c["num_hidden_layers"], c["n_routed_experts"], c["moe_intermediate_size"]
    for layer in range(L + c["num_nextn_predict_layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_a_proj.weight", (q_lora, h)),
            (p + "self_attn.q_a_layernorm.weight", (q_lora,)),
            (p + "self_attn.q_b_proj.weight", (heads * qk, q_lora)),
            (p + "self_attn.kv_a_proj_with_mqa.weight", (kv_lora + c["qk_rope_head_dim"], h)),
            (p + "self_attn.kv_a_layernorm.weight", (kv_lora,)),
            (p + "self_attn.kv_b_proj.weight", (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), kv_lora)),
            (p + "self_attn.o_proj.weight", (h, heads * c["v_head_dim"])),
        ]
        if layer < c["first_k_dense_replace"]:
            inter = c["intermediate_size"]
            out += [(p + f"mlp.{n}_proj.weight", (inter, h)) for n in ("gate", "up")]
            out.append((p + "mlp.down_proj.weight", (h, inter)))
            continue
        out += [(p + "mlp.gate.weight", (E, h)), (p + "mlp.gate.e_score_correction_bias", (E,))]
        for e in range(E):
            out += [(p + f"mlp.experts.{e}.{n}_proj.weight", (moe, h)) for n in ("gate", "up")]
            out.append((p + f"mlp.experts.{e}.down_proj.weight", (h, moe)))
        shared = moe * c["n_shared_experts"]
        out += [(p + f"mlp.shared_experts.{n}_proj.weight", (shared, h)) for n in ("gate", "up")]
        out.append((p + "mlp.shared_experts.down_proj.weight", (h, shared)))
        if layer >= L:
            out += [
                (p + "enorm.weight", (h,)),
                (p + "hnorm.weight", (h,)),
                (p + "eh_proj.weight", (h, 2 * h)),
                (p + "shared_head.norm.weight", (h,)),
                (p + "embed_tokens.weight", (c["vocab_size"], h)),
                (p + "shared_head.head.weight", (c["vocab_size"], h)),
            ]
    return out


def checkpoint_bytes(config: dict) -> int:
    return sum(2 * math.prod(s) for _, s in tensor_shapes(config))  # bf16 (the fp32 expert bias is negligible)


def moe_width_for(size_bytes: float, layers: int, experts: int) -> int:
    """The routed-expert width (multiple of 16) whose checkpoint is closest to `size_bytes`."""
    fixed = checkpoint_bytes(deepseek_like_config(layers, experts, 16))
    per_width = checkpoint_bytes(deepseek_like_config(layers, experts, 32)) - fixed
    return max(16, 16 + 16 * round((size_bytes - fixed) / per_width))


def write_synthetic(path: Path, config: dict, shard_bytes: int) -> int:
    """Write the checkpoint with random bf16 values sliced from one pool (generating 10 GB of randn would dominate)."""
    pool = torch.randn(64 << 20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    offset = 0
    with HFCheckpointWriter(path, max_shard_bytes=shard_bytes, overwrite=True) as writer:
        for name, shape in tensor_shapes(config):
            n = math.prod(shape)
            if name.endswith("e_score_correction_bias"):
                writer.add(name, torch.zeros(shape))  # DeepSeek keeps it fp32
                continue
            if n > pool.numel():
                pool = torch.cat([pool] * (n // pool.numel() + 1))
            if offset + n > pool.numel():
                offset = 0
            t = pool[offset : offset + n].view(shape)
            if "norm" in name:
                t = t.abs() + 0.5
            writer.add(name, t)
            offset += n
        writer.write_config(config)
        return writer.total_bytes


def raw_read(files: list[Path]) -> tuple[int, float]:
    """Bytes and seconds to read `files` sequentially in 64 MiB chunks (no parsing, no copies)."""
    buf = memoryview(bytearray(64 << 20))
    total, start = 0, time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total, time.perf_counter() - start


def raw_copy(files: list[Path], scratch: Path) -> tuple[int, float]:
    """Bytes and seconds to read `files` as `raw_read` does and write every chunk to one scratch file."""
    buf = memoryview(bytearray(64 << 20))
    total, start = 0, time.perf_counter()
    with open(scratch, "wb", buffering=0) as out:
        for file in files:
            with open(file, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    out.write(buf[:n])
                    total += n
    seconds = time.perf_counter() - start
    scratch.unlink()
    return total, seconds


DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache() -> None:
    """Write back dirty pages and evict the page cache, so the next read comes from the disk (Linux, root only)."""
    os.sync()
    DROP_CACHES.write_text("1\n")


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=10.0, help="HF checkpoint size to build (bf16), GB")
    parser.add_argument("--workdir", default="/tmp/bench_convert", help="scratch directory (emptied first)")
    parser.add_argument("--nproc", type=int, default=min(8, os.cpu_count() or 1), help="conversion worker processes")
    parser.add_argument("--layers", type=int, default=61, help="decoder layers (DeepSeek-V3: 61)")
    parser.add_argument("--experts", type=int, default=256, help="routed experts (DeepSeek-V3: 256)")
    parser.add_argument("--shard-size", default="2GB", help="HF shard size for input and output")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints in --workdir")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="evict the page cache before every measurement (needs root): reads come from the disk, as they do for "
        "a checkpoint larger than memory; by default the files are in the page cache (raw read = memory copy rate)",
    )
    args = parser.parse_args(argv)
    if args.cold:
        try:
            drop_page_cache()
        except OSError as err:
            print(f"error: --cold needs to write {DROP_CACHES} (root on Linux): {err}", file=sys.stderr)
            return 2
    settle = drop_page_cache if args.cold else os.sync
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    free = shutil.disk_usage(work).free
    size = args.size_gb * GB
    note = ""
    if 4.3 * size > free:  # HF in, torch_dist, HF out, a scratch copy, plus slack
        size = free / 4.3 * 0.9
        note = f" (reduced from {args.size_gb:.1f} GB: {free / GB:.1f} GB free)"
    width = moe_width_for(size, args.layers, args.experts)
    config = deepseek_like_config(args.layers, args.experts, width)
    shard = convert_checkpoint.parse_size(args.shard_size)
    hf_in, mcore, hf_out = work / "hf", work / "mcore", work / "hf_out"

    t = time.perf_counter()
    written = write_synthetic(hf_in, config, shard)
    print(
        f"synthetic DeepSeek-V3-shaped checkpoint: {len(tensor_shapes(config))} tensors, {args.layers} layers, "
        f"{args.experts} experts x width {width}, {written / GB:.2f} GB{note}, "
        f"written in {time.perf_counter() - t:.1f} s"
    )

    rows = []
    for direction, src, argv_ in (
        ("hf-to-mcore", hf_in, ["hf-to-mcore", "--hf", hf_in, "--out", mcore]),
        ("mcore-to-hf", mcore, ["mcore-to-hf", "--mcore", mcore, "--out", hf_out, "--max-shard-size", args.shard_size]),
    ):
        settle()
        raw_bytes, raw_s = raw_read(_files(src))
        settle()
        copy_bytes, copy_s = raw_copy(_files(src), work / "scratch")
        settle()
        t = time.perf_counter()
        code = convert_checkpoint.main([str(a) for a in [*argv_, "--nproc", args.nproc]])
        seconds = time.perf_counter() - t
        if code:
            print(f"{direction} failed with status {code}")
            return code
        ranks = convert_checkpoint.LAST_STATS["ranks"]
        phases = {k: max(r[k] for r in ranks) for k in ranks[0] if k.endswith("_s")}
        print(f"{direction}: slowest worker per phase " + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in phases.items()))
        rows.append(
            dict(
                direction=direction,
                gb=written / GB,
                seconds=seconds,
                gbps=written / seconds / GB,
                raw_read_gbps=raw_bytes / raw_s / GB,
                raw_copy_gbps=copy_bytes / copy_s / GB,
                peak_rss_gib=max(r["peak_rss"] for r in ranks) / 2**30,
            )
        )
    out_names = len(HFCheckpointReader(hf_out).names())
    assert out_names == len(tensor_shapes(config)), (
        f"exported {out_names} tensors, expected {len(tensor_shapes(config))}"
    )

    print(
        f"\n{'direction':<12} {'GB':>6} {'s':>6} {'GB/s':>6} {'raw read':>9} {'ratio':>6} {'raw copy':>9} {'ratio':>6} "
        f"{'peak RSS/worker GiB':>20}"
    )
    for r in rows:
        print(
            f"{r['direction']:<12} {r['gb']:6.2f} {r['seconds']:6.1f} {r['gbps']:6.3f} {r['raw_read_gbps']:9.2f} "
            f"{r['gbps'] / r['raw_read_gbps']:6.1%} {r['raw_copy_gbps']:9.2f} {r['gbps'] / r['raw_copy_gbps']:6.1%} "
            f"{r['peak_rss_gib']:20.2f}"
        )
    print(
        "page cache: "
        + ("evicted before each measurement (--cold: disk reads)" if args.cold else "warm (files just written or read)")
    )
    print(
        f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB; "
        f"{args.nproc} worker processes on {os.cpu_count()} cores; "
        f"{shutil.disk_usage(work).free / GB:.0f} GB free after"
    )
    print(json.dumps({"rows": rows}))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
