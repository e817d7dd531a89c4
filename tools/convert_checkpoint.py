"""HF <-> Megatron checkpoint conversion, streamed tensor by tensor over spawned ranks.

    python tools/convert_checkpoint.py hf-to-mcore --hf Qwen3-30B-A3B --out q3-mcore --tp 2 --pp 2 --ep 4
    python tools/convert_checkpoint.py mcore-to-hf --mcore q3-mcore --out q3-hf --max-shard-size 5GB [--fp8]

hf-to-mcore:  HF safetensors (memory-mapped, read by the ranks that need each tensor; FP8 weights dequantised with
              fp32 math) -> the family's weight map -> this rank's Megatron shards -> dist_checkpointing (torch_dist).
              The HF config (without quantization_config) and tokenizer files are stored under <out>/hf/, and the
              layout under <out>/mcore_rl_convert.json, so mcore-to-hf can rebuild the model alone.
mcore-to-hf:  dist_checkpointing, loaded under any layout -> export_hf_weights (TP/ETP gathers; PP stages and EP
              ranks emit their own tensors) -> [--fp8: 128x128 blockwise e4m3 + weight_scale_inv] -> every rank
              writes its own safetensors shards -> shards numbered, index written, directory renamed into place.

Ranks are CPU processes on gloo (the Megatron model is built with the local spec; torch_dist checkpoints are
layout- and spec-independent). The world is the layout's (tp x pp x ep ..., see ParallelLayout) or --nproc, a
multiple of it whose extra ranks are data-parallel replicas. Each rank holds only its own shard of the model; the
HF side holds at most one output shard per rank and maps input files through bounded windows (hf_io.py).

Bad input (unsupported model_type, missing / unexpected / misshapen tensors, dtypes disagreeing with config.json,
truncated files, a layout that does not divide the model, an existing output directory without --overwrite) exits
with status 2 and a message naming the file or tensor. Output is written to <out>.tmp-<pid> and renamed only when
complete, so a killed conversion leaves no <out>.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mcore_rl.models.base import HFConfig, UnsupportedModel, get_family, supported_model_types
from mcore_rl.parallel.harness import RankFailed, run_on_ranks
from mcore_rl.parallel.layout import LayoutError, ParallelLayout
from mcore_rl.resharding.hf_io import (
    FP8_BLOCK,
    CheckpointError,
    HFCheckpointReader,
    HFCheckpointWriter,
    copy_side_files,
    fp8_aware_reader,
    fp8_block_size,
    move_into_place,
    parse_size,
    prepare_output,
    publish,
)
from mcore_rl.resharding.weight_map import WeightMapError

LAYOUT_FILE = "mcore_rl_convert.json"
HF_SUBDIR = "hf"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HF_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
#: the tensors DeepSeek-V3 / Qwen3 FP8 releases quantise: attention and MLP projections (shared and routed experts
#: included); embeddings, lm_head, norms, the router and MTP's eh_proj stay in the model dtype
QUANTIZE_RULE = re.compile(
    r"^model\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?"
    r"(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|gate_proj|up_proj|down_proj)\.weight$"
)


#: statistics of the last `main` call in this process (per-rank peak RSS, bytes, world): read by bench_convert.py
LAST_STATS: dict[str, Any] = {}


class ConvertError(Exception):
    """Bad input: the message names the file, tensor or argument (exit status 2)."""


# ----------------------------------------------------------------------------------------------------- helpers
def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _rss_bytes() -> int:
    """Resident memory right now (from /proc, no psutil)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _hf_dtype(config: dict[str, Any]) -> str:
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return HF_DTYPE_NAMES.get(str(name).replace("torch.", ""), "bf16")


def _min_world(layout: ParallelLayout) -> int:
    dense, expert = layout.tp * layout.cp * layout.pp, layout.expert_tp * layout.ep * layout.pp
    return dense * expert // math.gcd(dense, expert)


def _world(layout: ParallelLayout, nproc: int | None) -> int:
    world = nproc or _min_world(layout)
    layout.check_world_size(world)
    return world


def check_inventory(reader: HFCheckpointReader, hf: HFConfig, weight_map: Any, shape: Any) -> None:
    """Refuse unexpected tensors and float dtypes that disagree with config.json, naming file and tensor."""
    block = fp8_block_size(reader.config)
    want = DTYPES[_hf_dtype(reader.config)]
    unexpected, wrong = [], []
    for name in reader.names():
        dtype = reader.dtype(name)
        if name.endswith("_scale_inv"):
            weight = name[: -len("_scale_inv")]
            if block is None or weight not in reader or reader.dtype(weight) != torch.float8_e4m3fn:
                unexpected.append(name)
            continue
        if not weight_map.is_known_hf(name, shape.num_layers, shape.num_experts):
            unexpected.append(name)
        elif dtype == torch.float8_e4m3fn and block is None:
            wrong.append(f"{name} ({reader.file_of(name).name}) is float8 but config.json has no quantization_config")
        elif dtype.is_floating_point and dtype not in (want, torch.float32, torch.float8_e4m3fn):
            wrong.append(f"{name} ({reader.file_of(name).name}) is {dtype}, config.json says {want}")
    if unexpected:
        raise ConvertError(
            f"{reader.dir}: {len(unexpected)} tensor(s) not in the {hf.model_type} weight map, e.g. "
            + ", ".join(f"{n} ({reader.file_of(n).name})" for n in unexpected[:5])
        )
    if wrong:
        raise ConvertError(f"{reader.dir}: dtype disagrees with config.json: " + "; ".join(wrong[:5]))


def _spec(config: dict[str, Any], layout: ParallelLayout, dtype: str, divisible_by: int) -> Any:
    from mcore_rl.models.builder import ModelSpec

    # Every weight is overwritten by the load, so skip Megatron's random init (minutes of randn for a big model).
    return ModelSpec(
        HFConfig(config),
        layout,
        dtype=DTYPES[dtype],
        make_vocab_size_divisible_by=divisible_by,
        config_overrides={"perform_initialization": False},
    )


def _share_cores(world: int) -> None:
    """Give each rank its share of the cores: ranks that each start one intra-op thread per core oversubscribe
    the machine, and the spinning OpenMP threads made copies ~20x slower (4 ranks on 2 cores, measured)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def _sharded_state_dict(chunks: list[torch.nn.Module], pg: Any) -> dict[str, Any]:
    # Megatron-LM's convention: "model" for one chunk, "model0", "model1", ... under virtual pipelining. Tensor keys
    # inside are global (layer offsets applied), so a checkpoint loads under any other (v)pp.
    metadata = {"dp_cp_group": pg.dp_cp}
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=metadata)}
    return {f"model{i}": c.sharded_state_dict(metadata=metadata) for i, c in enumerate(chunks)}


def _layout_of(meta: dict[str, Any]) -> ParallelLayout:
    return ParallelLayout(**meta)


# ------------------------------------------------------------------------------------------------ rank bodies
def hf_to_mcore_rank(
    rank: int, world: int, hf_dir: str, tmp: str, layout: ParallelLayout, config: dict, dtype: str, div: int
) -> dict[str, Any]:
    """One rank: build its Megatron shard, fill it from the HF files, save its part of the torch_dist checkpoint."""
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    from mcore_rl.models.builder import build_gpt_chunks
    from mcore_rl.parallel.groups import initialize_model_parallel
    from mcore_rl.resharding.weight_map import load_hf_weights

    start = time.perf_counter()
    _share_cores(world)
    pg = initialize_model_parallel(layout)
    reader = HFCheckpointReader(hf_dir)
    spec = _spec(config, layout, dtype, div)
    torch.manual_seed(0)
    chunks, contexts = build_gpt_chunks(spec, pg)
    rss, built = {"built": _rss_bytes()}, time.perf_counter()
    with tqdm(desc=f"rank 0/{world} load", unit="B", unit_scale=True, disable=rank != 0, file=sys.stderr) as bar:
        used = load_hf_weights(
            chunks, contexts, spec.weight_map(), fp8_aware_reader(reader, fp8_block_size(reader.config), bar)
        )
    read_bytes = sum(reader.nbytes(n) for n in used)
    loaded = time.perf_counter()
    rss["loaded"] = _rss_bytes()
    dist_checkpointing.save(_sharded_state_dict(chunks, pg), tmp)
    rss["saved"] = _rss_bytes()
    return dict(
        rss=rss,
        used=sorted(used),
        read_bytes=read_bytes,
        build_s=built - start,
        load_s=loaded - built,
        save_s=time.perf_counter() - loaded,
        peak_rss=_peak_rss_bytes(),
    )


def mcore_to_hf_rank(
    rank: int, world: int, mcore_dir: str, tmp: str, layout: ParallelLayout, meta: dict, shard_bytes: int, fp8: bool
) -> dict[str, Any]:
    """One rank: build its shard, load it from torch_dist, export its HF tensors into its own safetensors parts."""
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    from mcore_rl.kernels.fp8_blockwise import quantize_blockwise
    from mcore_rl.models.builder import build_gpt_chunks
    from mcore_rl.parallel.groups import initialize_model_parallel
    from mcore_rl.resharding.weight_map import export_hf_weights

    start = time.perf_counter()
    _share_cores(world)
    pg = initialize_model_parallel(layout)
    config = json.loads((Path(mcore_dir) / HF_SUBDIR / "config.json").read_text())
    spec = _spec(config, layout, meta["dtype"], meta["make_vocab_size_divisible_by"])
    torch.manual_seed(0)
    chunks, contexts = build_gpt_chunks(spec, pg)
    rss, built = {"built": _rss_bytes()}, time.perf_counter()
    state = dist_checkpointing.load(_sharded_state_dict(chunks, pg), mcore_dir)
    rss["loaded"] = _rss_bytes()
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"], strict=True)
    del state
    loaded = time.perf_counter()
    writer = HFCheckpointWriter(tmp, shard_bytes, tmp_dir=tmp, part_prefix=f"rank{rank:05d}-")
    tensors = export_hf_weights(chunks, contexts, spec.weight_map(), pg.tp, pg.expt_tp)
    with tqdm(desc=f"rank 0/{world} export", unit="B", unit_scale=True, disable=rank != 0, file=sys.stderr) as bar:
        for name, tensor in tensors:
            if fp8 and QUANTIZE_RULE.match(name) and tensor.dim() == 2:
                q, scale_inv = quantize_blockwise(tensor, FP8_BLOCK)
                writer.add(name, q)
                writer.add(name + "_scale_inv", scale_inv)
            else:
                writer.add(name, tensor)
            bar.update(tensor.numel() * tensor.element_size())
    parts = writer.finish()
    rss["exported"] = _rss_bytes()
    return dict(
        rss=rss,
        parts=parts,
        written_bytes=writer.total_bytes,
        build_s=built - start,
        load_s=loaded - built,
        export_s=time.perf_counter() - loaded,
        peak_rss=_peak_rss_bytes(),
    )


def _run(fn: Any, world: int, args: tuple) -> list[dict[str, Any]]:
    try:
        return run_on_ranks(fn, world, args, timeout_s=24 * 3600)
    except RankFailed as err:
        # The rank's traceback ends with the exception line; bad input there (a missing or misshapen tensor, a
        # truncated file) is the user's error, anything else is a bug worth the whole traceback.
        lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else str(err)
        for kind in (WeightMapError, CheckpointError, UnsupportedModel, LayoutError):
            if last.split(":", 1)[0].endswith(kind.__name__):
                raise ConvertError(last.split(":", 1)[1].strip()) from None
        raise


# ------------------------------------------------------------------------------------------------ directions
def hf_to_mcore(args: argparse.Namespace) -> dict[str, Any]:
    """HF directory -> Megatron torch_dist directory (plus hf/ config and tokenizer, and the layout file)."""
    reader = HFCheckpointReader(args.hf)
    config = dict(reader.config)
    hf = HFConfig(config)
    family = get_family(hf.model_type)
    layout = ParallelLayout(
        tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, vpp=args.vpp, sequence_parallel=args.tp > 1
    )
    world = _world(layout, args.nproc)
    shape = family.shape(hf)
    layout.validate(world, shape)
    dtype = args.dtype or _hf_dtype(config)
    family.transformer_config(hf, layout, "cpu", DTYPES[dtype])  # refuses untranslatable settings before spawning
    spec = _spec(config, layout, dtype, args.make_vocab_size_divisible_by)
    check_inventory(reader, hf, spec.weight_map(), shape)
    stored = {k: v for k, v in config.items() if k != "quantization_config"}
    stored["dtype"] = {v: k for k, v in HF_DTYPE_NAMES.items()}[dtype]
    out = Path(args.out)
    tmp = prepare_output(out, args.overwrite)
    try:
        results = _run(
            hf_to_mcore_rank,
            world,
            (str(reader.dir), str(tmp), layout, stored, dtype, args.make_vocab_size_divisible_by),
        )
        (tmp / HF_SUBDIR).mkdir()
        (tmp / HF_SUBDIR / "config.json").write_text(json.dumps(stored, indent=2, sort_keys=True) + "\n")
        copy_side_files(reader.dir, tmp / HF_SUBDIR)
        meta = dict(
            model_type=hf.model_type,
            dtype=dtype,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            layout=dict(
                tp=layout.tp,
                pp=layout.pp,
                ep=layout.ep,
                etp=layout.etp,
                vpp=layout.vpp,
                sequence_parallel=layout.sequence_parallel,
            ),
            world=world,
        )
        (tmp / LAYOUT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(world=world, ranks=results, bytes=reader.total_bytes())


def mcore_to_hf(args: argparse.Namespace) -> dict[str, Any]:
    """Megatron torch_dist directory written by hf-to-mcore -> HF directory (sharded safetensors + index)."""
    mcore = Path(args.mcore)
    meta_path, config_path = mcore / LAYOUT_FILE, mcore / HF_SUBDIR / "config.json"
    for path in (mcore / "metadata.json", meta_path, config_path):
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (is {mcore} a checkpoint written by hf-to-mcore?)")
    meta = json.loads(meta_path.read_text())
    config = json.loads(config_path.read_text())
    hf = HFConfig(config)
    family = get_family(hf.model_type)
    saved = _layout_of(meta["layout"])
    layout = ParallelLayout(
        tp=args.tp or saved.tp,
        pp=args.pp or saved.pp,
        ep=args.ep or saved.ep,
        etp=args.etp or saved.etp,
        vpp=args.vpp or saved.vpp,
        sequence_parallel=(args.tp or saved.tp) > 1,
    )
    world = _world(layout, args.nproc)
    layout.validate(world, family.shape(hf))
    out = Path(args.out)
    tmp = prepare_output(out, args.overwrite)
    try:
        results = _run(mcore_to_hf_rank, world, (str(mcore), str(tmp), layout, meta, args.max_shard_size, args.fp8))
        parts = [part for r in results for part in r["parts"]]
        out_config = dict(config, architectures=[family.architecture])
        if args.fp8:
            out_config["quantization_config"] = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": list(FP8_BLOCK),
            }
        (tmp / "config.json").write_text(json.dumps(out_config, indent=2, sort_keys=True) + "\n")
        copy_side_files(mcore / HF_SUBDIR, tmp)
        publish(tmp, out, parts)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(world=world, ranks=results, bytes=sum(p[2] for p in parts))


# ------------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert checkpoints between HF safetensors and Megatron dist_checkpointing (torch_dist).",
        epilog=f"Supported model_type values: {', '.join(supported_model_types())}.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF directory -> Megatron torch_dist directory")
    a.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output directory (created; refused if it exists)")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size to build the model with")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    a.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    a.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: tp)")
    a.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per pipeline rank")
    a.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="parameter dtype (default: config.json's)")
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="Megatron vocab padding multiple")
    b = sub.add_parser("mcore-to-hf", help="Megatron torch_dist directory (from hf-to-mcore) -> HF directory")
    b.add_argument("--mcore", required=True, help="directory written by hf-to-mcore")
    b.add_argument("--out", required=True, help="output HF directory (created; refused if it exists)")
    b.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), help="per-file size, e.g. 5GB")
    b.add_argument("--fp8", action="store_true", help="write DeepSeek-style 128x128 blockwise float8_e4m3fn weights")
    for name in ("tp", "pp", "ep", "etp", "vpp"):
        b.add_argument(f"--{name}", type=int, default=None, help=f"{name} to load under (default: as saved)")
    for p in (a, b):
        p.add_argument("--nproc", type=int, default=None, help="ranks to spawn (default: the layout's world size)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        stats = hf_to_mcore(args) if args.command == "hf-to-mcore" else mcore_to_hf(args)
    except (ConvertError, CheckpointError, WeightMapError, UnsupportedModel, LayoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    LAST_STATS.clear()
    LAST_STATS.update(stats, seconds=seconds)
    peak = max(r["peak_rss"] for r in stats["ranks"])
    print(
        f"{args.command}: {stats['bytes'] / 1e9:.3f} GB on {stats['world']} rank(s) in {seconds:.1f} s "
        f"({stats['bytes'] / 1e9 / seconds:.2f} GB/s), peak RSS per rank {peak / 2**30:.2f} GiB -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
