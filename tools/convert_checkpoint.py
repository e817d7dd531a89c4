"""HF <-> Megatron checkpoint conversion, streamed tensor by tensor over --nproc worker processes.

    python tools/convert_checkpoint.py hf-to-mcore --hf DeepSeek-V3 --out ds-mcore --tp 8 --ep 64 --nproc 16
    python tools/convert_checkpoint.py mcore-to-hf --mcore ds-mcore --out ds-hf --max-shard-size 5GB [--fp8]
    python tools/convert_checkpoint.py mcore-to-hf --mcore runs/save --hf-config DeepSeek-V3 --out ds-rl-hf
    python tools/convert_checkpoint.py mcore-to-hf --mcore runs/default/checkpoints --out rl-hf   # training checkpoint

No Megatron model is built or filled. Each worker builds the model on the meta device (shapes only, seconds even for
671B) to learn the chunks Megatron's torch_dist format holds, then streams its share of the parameters
(resharding/dist_ckpt.py):

hf-to-mcore:  HF safetensors (memory-mapped through bounded windows; FP8 weights dequantised with fp32 math) ->
              the family's weight map, one parameter at a time -> its chunks appended to the worker's own .distcp
              file; worker 0 writes .metadata, metadata.json and common.pt. The HF config (without
              quantization_config) and tokenizer files go under <out>/hf/, the layout under <out>/mcore_rl_convert.json.
mcore-to-hf:  the chunks covering each parameter (from this converter, or saved by Megatron under any layout: a
              checkpoint without hf-to-mcore's hf/ config is described by --hf-config, its dtype and padded
              vocabulary read from its embedding; a Megatron-LM save directory resolves to the iteration
              latest_checkpointed_iteration.txt names) ->
              the weight map back to HF names -> [--fp8: 128x128 blockwise e4m3 + weight_scale_inv] -> safetensors
              whose headers are planned up front (the weight map run on meta tensors), so every tensor goes straight
              to disk -> shards numbered, index written, directory renamed into place.

torch_dist keys are global, so the checkpoint loads under any layout with the same padded vocabulary: the layout
given to hf-to-mcore is validated against the model and fixes the vocabulary padding (a multiple of
make_vocab_size_divisible_by x tp), as Megatron's own save would. Peak memory per worker is about the largest
tensor (times the few copies a transform makes) plus a constant (imports, the meta model, a 512 MiB read window),
whatever the model's size or the output shard size.

Bad input (unsupported model_type, missing / unexpected / misshapen tensors, dtypes disagreeing with config.json,
truncated or corrupt files, a checkpoint disagreeing with its config.json, a layout that does not divide the model,
an existing output directory without --overwrite) exits with status 2 and a message naming the file or tensor.
Output is written to <out>.tmp-<pid> and renamed only when complete, so a killed conversion leaves no <out>.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mcore_rl.models.base import FP8_TARGETS, HFConfig, UnsupportedModel, padded_vocab_size
from mcore_rl.models.registry import get_family, supported_model_types
from mcore_rl.parallel.cpu_runtime import mode_suspended
from mcore_rl.parallel.harness import RankFailed, run_on_ranks
from mcore_rl.parallel.layout import LayoutError, ParallelLayout
from mcore_rl.resharding.dist_ckpt import (
    CONVERT_META_NAME,
    HF_SUBDIR,
    METADATA_NAME,
    CheckpointPlan,
    ChunkReader,
    ChunkWriter,
    finish_checkpoint,
    plan_checkpoint,
)
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
from mcore_rl.resharding.weight_map import ShardContext, WeightMapError, hf_to_megatron, megatron_to_hf

LAYOUT_FILE = CONVERT_META_NAME
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HF_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
#: the tensors FP8 releases quantise (the families' shared definition, mcore_rl/models/base.py)
QUANTIZE_RULE = FP8_TARGETS


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


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def _min_world(layout: ParallelLayout) -> int:
    """The smallest world the layout runs on (validation only: conversion itself needs no model-parallel ranks)."""
    dense, expert = layout.tp * layout.cp * layout.pp, layout.expert_tp * layout.ep * layout.pp
    return dense * expert // math.gcd(dense, expert)


def _layout_dict(layout: ParallelLayout) -> dict[str, Any]:
    return {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}


def check_inventory(
    reader: HFCheckpointReader, hf: HFConfig, weight_map: Any, shape: Any, ignore: tuple[str, ...] = ()
) -> None:
    """Refuse unexpected tensors and float dtypes that disagree with config.json, naming file and tensor (tensors
    under the `ignore` prefixes, MTP layers turned off, are not read)."""
    block = fp8_block_size(reader.config)
    want = DTYPES[_hf_dtype(reader.config)]
    unexpected, wrong = [], []
    for name in reader.names():
        if ignore and name.startswith(ignore):
            continue
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


# --------------------------------------------------------------------------------------------- process bodies
def _worker_plan(config: dict, dtype: str, vocab_multiple: int) -> CheckpointPlan:
    """The checkpoint plan, built by every worker itself (a meta-device model: seconds, no memory; cheaper than a
    separate planning process and shipping the plan around)."""
    from mcore_rl.parallel.groups import initialize_model_parallel

    pg = initialize_model_parallel(ParallelLayout())
    from mcore_rl.models.builder import build_gpt_chunks

    return plan_checkpoint(_spec(config, ParallelLayout(), dtype, vocab_multiple), pg, build_gpt_chunks)


def _worker_start(
    rank: int, world: int, config: dict, dtype: str, vocab_multiple: int, t0: float
) -> tuple[CheckpointPlan, list, Any, dict[str, float]]:
    """Every worker's first steps: its share of the cores, the plan, its run of entries, the weight map, and the
    times so far (startup: from main's start, `t0` = time.time(), to here: checks, spawn, imports)."""
    startup = time.time() - t0
    start = time.perf_counter()
    _share_cores(world)
    plan = _worker_plan(config, dtype, vocab_multiple)
    weight_map = _spec(config, ParallelLayout(), dtype, vocab_multiple).weight_map()
    return plan, plan.split(world)[rank], weight_map, dict(startup_s=startup, plan_s=time.perf_counter() - start)


def _progress(rank: int, world: int, nbytes: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=nbytes, desc=f"worker 0/{world}", unit="B", unit_scale=True, disable=rank != 0, file=sys.stderr)


def hf_to_mcore_rank(
    rank: int, world: int, hf_dir: str, tmp: str, config: dict, dtype: str, vocab_multiple: int, t0: float
) -> dict[str, Any]:
    """One worker: its run of the model's parameters, computed from the HF files, into its own .distcp file; worker
    0 then writes the checkpoint's metadata from every worker's records. `t0`: time.time() when main started."""
    plan, entries, weight_map, times = _worker_start(rank, world, config, dtype, vocab_multiple, t0)
    planned = time.perf_counter()
    reader = HFCheckpointReader(hf_dir)
    read_hf = fp8_aware_reader(reader, fp8_block_size(reader.config), dtype=plan.dtype)
    ctx, used = ShardContext(), set()
    nbytes = sum(e.numel for e in entries) * plan.dtype.itemsize
    with ChunkWriter(tmp, f"__{rank}_0.distcp") as writer, _progress(rank, world, nbytes) as bar, mode_suspended():
        if rank == 0:
            for key, data in plan.objects.items():
                writer.write_object(key, data)
        for entry in entries:
            value, names = hf_to_megatron(weight_map, entry.name, entry.shape, ctx, read_hf)
            writer.write(entry, value.to(plan.dtype))
            used.update(names)
            bar.update(entry.numel * plan.dtype.itemsize)
    written = time.perf_counter()
    parts = [None] * world if rank == 0 else None
    torch.distributed.gather_object((writer.file_name, writer.records), parts, dst=0)
    if rank == 0:
        finish_checkpoint(tmp, plan, parts)
    return dict(
        read_bytes=sum(reader.nbytes(n) for n in used),
        **times,
        convert_s=written - planned,
        metadata_s=time.perf_counter() - written,
        peak_rss=_peak_rss_bytes(),
    )


def _hf_layout(weight_map: Any, entries: list, dtype: torch.dtype, fp8: bool) -> list[tuple[str, torch.dtype, tuple]]:
    """Name, dtype and shape of every HF tensor the entries export, in order: the weight map run on meta tensors.
    Knowing them up front lets the safetensors writer stream each tensor to disk instead of holding a shard."""
    from mcore_rl.kernels.fp8_blockwise import scale_grid_shape

    out = []
    for entry in entries:
        value = torch.empty(entry.shape, dtype=dtype, device="meta")
        for name, t in megatron_to_hf(weight_map, entry.name, [value], ShardContext()):
            if fp8 and QUANTIZE_RULE.match(name) and t.dim() == 2:
                out.append((name, torch.float8_e4m3fn, tuple(t.shape)))
                out.append((name + "_scale_inv", torch.float32, tuple(scale_grid_shape(tuple(t.shape), FP8_BLOCK))))
            else:
                out.append((name, t.dtype, tuple(t.shape)))
    return out


def mcore_to_hf_rank(
    rank: int, world: int, mcore_dir: str, tmp: str, config: dict, dtype: str, vocab_multiple: int,
    shard_bytes: int, fp8: bool, t0: float,
) -> dict[str, Any]:  # fmt: skip
    """One worker: its run of the model's parameters, read from the torch_dist chunks, into its own safetensors."""
    from mcore_rl.kernels.fp8_blockwise import quantize_blockwise

    plan, entries, weight_map, times = _worker_start(rank, world, config, dtype, vocab_multiple, t0)
    planned = time.perf_counter()
    ctx = ShardContext()
    with mode_suspended():
        layout = _hf_layout(weight_map, entries, plan.dtype, fp8)
    writer = HFCheckpointWriter(tmp, shard_bytes, tmp_dir=tmp, part_prefix=f"rank{rank:05d}-", layout=layout)
    nbytes = sum(e.numel for e in entries) * plan.dtype.itemsize
    with ChunkReader(mcore_dir) as reader, _progress(rank, world, nbytes) as bar, mode_suspended():
        if rank == 0:
            unexpected = sorted(reader.model_keys() - {p.key for e in plan.entries for p in e.pieces})
            if unexpected:
                raise CheckpointError(
                    f"{mcore_dir}: {len(unexpected)} tensor(s) the model (its HF config) does not have, "
                    f"e.g. {unexpected[:5]}"
                )
        for entry in entries:
            for name, tensor in megatron_to_hf(weight_map, entry.name, [reader.read(entry)], ctx):
                if fp8 and QUANTIZE_RULE.match(name) and tensor.dim() == 2:
                    q, scale_inv = quantize_blockwise(tensor, FP8_BLOCK)
                    writer.add(name, q)
                    writer.add(name + "_scale_inv", scale_inv)
                else:
                    writer.add(name, tensor)
            bar.update(entry.numel * plan.dtype.itemsize)
        read_bytes = reader.bytes_read
    parts = writer.finish()
    return dict(
        parts=parts,
        read_bytes=read_bytes,
        written_bytes=writer.total_bytes,
        **times,
        convert_s=time.perf_counter() - planned,
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
    family = get_family(HFConfig(reader.config).model_type)
    config, note, ignore = family.resolve_mtp(dict(reader.config), set(reader.names()), args.mtp)
    if note:
        print(note)
    hf = HFConfig(config)
    layout = ParallelLayout(
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        etp=args.etp,
        vpp=args.vpp,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
        sequence_parallel=args.tp > 1,
    )
    layout.validate(_min_world(layout), family.shape(hf))
    dtype = args.dtype or _hf_dtype(config)
    vocab_multiple = args.make_vocab_size_divisible_by * layout.tp
    weight_map = _spec(config, layout, dtype, args.make_vocab_size_divisible_by).weight_map()
    check_inventory(reader, hf, weight_map, family.shape(hf), ignore)
    stored = {k: v for k, v in config.items() if k != "quantization_config"}
    stored["dtype"] = {v: k for k, v in HF_DTYPE_NAMES.items()}[dtype]
    out = Path(args.out)
    tmp = prepare_output(out, args.overwrite)
    try:
        results = _run(
            hf_to_mcore_rank, args.nproc, (str(reader.dir), str(tmp), stored, dtype, vocab_multiple, args.t0)
        )
        (tmp / HF_SUBDIR).mkdir()
        (tmp / HF_SUBDIR / "config.json").write_text(json.dumps(stored, indent=2, sort_keys=True) + "\n")
        copy_side_files(reader.dir, tmp / HF_SUBDIR)
        meta = dict(
            model_type=hf.model_type,
            dtype=dtype,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            layout=_layout_dict(layout),
            padded_vocab_size=padded_vocab_size(hf.req("vocab_size"), args.make_vocab_size_divisible_by, layout.tp),
        )
        (tmp / LAYOUT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(world=args.nproc, ranks=results, bytes=reader.total_bytes())


def resolve_iteration(mcore: Path) -> Path:
    """Megatron-LM's save directory holds latest_checkpointed_iteration.txt and iter_0000123/ (or release/): the
    checkpoint is the iteration it names. Any other directory is the checkpoint itself."""
    tracker = mcore / "latest_checkpointed_iteration.txt"
    if (mcore / METADATA_NAME).is_file() or not tracker.is_file():
        return mcore
    text = tracker.read_text().strip()
    if text == "release":
        return mcore / "release"
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number or 'release', got {text!r}")
    return mcore / f"iter_{int(text):07d}"


def resolve_training_checkpoint(path: Path) -> Path:
    """A training checkpoint (trainer.save_every) holds its model under model/, with the HF config, tokenizer and
    layout file beside it: given its step directory, or the checkpoints directory (whose `latest` names the step),
    the model directory is converted."""
    from mcore_rl.checkpoint import store

    if (path / METADATA_NAME).is_file():
        return path
    if (path / store.LATEST).is_file() and not (path / store.META).is_file():
        path = store.latest(path)
    if (path / store.META).is_file() and (path / "model").is_dir():
        return path / "model"
    return path


def _source_from_hf_config(mcore: Path, hf_config: Path) -> tuple[dict[str, Any], Path, str, int]:
    """(config, side-file directory, dtype, vocab multiple) for a checkpoint that carries no HF config (one saved by
    Megatron-LM or a trainer): the model from `hf_config`, the dtype and the padded vocabulary from the checkpoint's
    own embedding."""
    config_path = hf_config if hf_config.is_file() else hf_config / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing (--hf-config takes an HF model directory or its config.json)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err})") from None
    config.pop("quantization_config", None)  # the checkpoint holds the model dtype, whatever the release was in
    reader = ChunkReader(mcore)
    embedding = reader.tensors.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise CheckpointError(f"{mcore}: no embedding.word_embeddings.weight (not a Megatron GPT model checkpoint)")
    dtype = HF_DTYPE_NAMES.get(str(embedding.properties.dtype).replace("torch.", ""))
    if dtype is None:
        raise CheckpointError(f"{mcore}: parameters are {embedding.properties.dtype}, expected one of {sorted(DTYPES)}")
    padded, vocab = embedding.size[0], HFConfig(config).req("vocab_size")
    if padded < vocab:
        raise CheckpointError(
            f"{mcore}: the embedding has {padded} rows, {config_path} says vocab_size={vocab} (another model?)"
        )
    config["dtype"] = {v: k for k, v in HF_DTYPE_NAMES.items()}[dtype]
    return config, config_path.parent, dtype, padded  # a multiple of `padded` pads `vocab` to exactly `padded`


def mcore_to_hf(args: argparse.Namespace) -> dict[str, Any]:
    """Megatron torch_dist directory -> HF directory (sharded safetensors + index).

    The model is described by the hf/ config and layout file hf-to-mcore writes, or by --hf-config for any other
    torch_dist checkpoint (Megatron-LM's iter_XXXXXXX, given directly or through its save directory)."""
    mcore = resolve_iteration(resolve_training_checkpoint(Path(args.mcore)))
    if not (mcore / "metadata.json").is_file():
        raise CheckpointError(f"{mcore / 'metadata.json'}: missing (not a Megatron dist_checkpointing directory)")
    if not (mcore / METADATA_NAME).is_file():  # refused before anything is spawned (workers read it, ~1 s)
        raise CheckpointError(f"{mcore / METADATA_NAME}: missing (not a torch_dist checkpoint)")
    if args.hf_config is not None:
        config, side_dir, dtype, vocab_multiple = _source_from_hf_config(mcore, Path(args.hf_config))
    else:
        meta_path, config_path = mcore / LAYOUT_FILE, mcore / HF_SUBDIR / "config.json"
        for path in (meta_path, config_path):
            if not path.is_file():
                raise CheckpointError(
                    f"{path}: missing (written by hf-to-mcore; for another checkpoint name the model with --hf-config)"
                )
        meta = json.loads(meta_path.read_text())
        config = json.loads(config_path.read_text())
        side_dir, dtype = mcore / HF_SUBDIR, HF_DTYPE_NAMES.get(meta["dtype"], meta["dtype"])
        vocab_multiple = meta["make_vocab_size_divisible_by"] * meta["layout"]["tp"]
    family = get_family(HFConfig(config).model_type)
    out = Path(args.out)
    tmp = prepare_output(out, args.overwrite)
    try:
        results = _run(
            mcore_to_hf_rank,
            args.nproc,
            (str(mcore), str(tmp), config, dtype, vocab_multiple, args.max_shard_size, args.fp8, args.t0),
        )
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
        copy_side_files(side_dir, tmp)
        publish(tmp, out, parts)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(world=args.nproc, ranks=results, bytes=sum(p[2] for p in parts))


# ------------------------------------------------------------------------------------------------------- CLI
def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


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
    a.add_argument("--first-stage-layers", type=int, default=None, help="layers on the first pipeline stage (uneven)")
    a.add_argument("--last-stage-layers", type=int, default=None, help="layers on the last pipeline stage (uneven)")
    a.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="parameter dtype (default: config.json's)")
    a.add_argument(
        "--mtp",
        choices=("on", "off", "auto"),
        default="auto",
        help="multi-token-prediction layers (DeepSeek-V3): auto = on when the checkpoint holds them, off when it holds "
        "none (transformers' save_pretrained drops them); a partial MTP layer is refused, naming what is missing",
    )
    a.add_argument(
        "--make-vocab-size-divisible-by", type=_positive, default=128, help="Megatron vocab padding multiple"
    )
    b = sub.add_parser("mcore-to-hf", help="Megatron torch_dist directory -> HF directory")
    b.add_argument(
        "--mcore",
        required=True,
        help="torch_dist directory (hf-to-mcore's, or Megatron-LM's save dir), or a training checkpoint (its step_* "
        "directory, or the checkpoints directory: its latest)",
    )
    b.add_argument(
        "--hf-config",
        default=None,
        help="HF model directory (or config.json) describing a checkpoint hf-to-mcore did not write; its tokenizer "
        "and generation files are copied",
    )
    b.add_argument("--out", required=True, help="output HF directory (created; refused if it exists)")
    b.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=parse_size("5GB"),
        help="largest safetensors file, e.g. 5GB (each worker writes its own files: at least one per worker)",
    )
    b.add_argument("--fp8", action="store_true", help="write DeepSeek-style 128x128 blockwise float8_e4m3fn weights")
    for p in (a, b):
        cores = min(8, os.cpu_count() or 1)
        p.add_argument("--nproc", type=_positive, default=cores, help="worker processes (default: cores, at most 8)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    return parser


def check_out(args: argparse.Namespace) -> None:
    """--out must not be, contain or lie inside an input (--overwrite would replace the checkpoint being read), nor be
    a symbolic link: the output is written beside it and renamed into its place, which would replace the link (not
    its target) and, with --overwrite, fail after the whole conversion. Checked before anything is written."""
    given = args.out.rstrip("/") or args.out  # `link/` names the link too (the output is renamed onto `link`)
    if os.path.islink(given):
        raise ConvertError(
            f"--out {args.out} is a symbolic link (to {os.readlink(given)}); expected a directory path that is not "
            "a link: pass the link's target as --out, or remove the link"
        )
    out = Path(args.out).resolve()
    inputs = [args.hf] if args.command == "hf-to-mcore" else [args.mcore] + ([args.hf_config] if args.hf_config else [])
    for given in inputs:
        src = Path(given).resolve()
        if out == src or src.is_relative_to(out) or out.is_relative_to(src):
            raise ConvertError(f"--out {args.out} overlaps the input {given}; expected a separate output directory")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.t0 = time.time()
    start = time.perf_counter()
    try:
        check_out(args)
        stats = hf_to_mcore(args) if args.command == "hf-to-mcore" else mcore_to_hf(args)
    except (ConvertError, CheckpointError, WeightMapError, UnsupportedModel, LayoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # an unwritable --out, a directory where a file was expected: input, not a bug
        print(f"error: {err.filename or args.out}: {err.strerror or err}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    LAST_STATS.clear()
    LAST_STATS.update(stats, seconds=seconds)
    peak = max(r["peak_rss"] for r in stats["ranks"])
    print(
        f"{args.command}: {stats['bytes'] / 1e9:.3f} GB on {stats['world']} worker(s) in {seconds:.1f} s "
        f"({stats['bytes'] / 1e9 / seconds:.2f} GB/s), peak RSS per rank {peak / 2**30:.2f} GiB -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
