"""Plan a recipe's weight sync at cluster scale in one process, check it, and predict its time from link bandwidths.

    python tools/plan_sync.py --recipe qwen3_235b_a22b_32n --actor-nodes 8 --engine-nodes 8 --engine-tp 8 --engine-ep 8
    python tools/plan_sync.py --recipe deepseek_v3_671b_32n --engine-tp 32 --engine-ep 32 --dp-attention 4
    python tools/plan_sync.py --recipe ... --mode shard_aware --bandwidths sweep.json   # from nccl_diag.py sweep --json

The real plan (resharding/sync/plan.py) is built from the recipe's model on the meta device (no weights, no ranks)
for the recipe's actor layout (`--actor-nodes` x `--gpus-per-node` ranks; `actor.layout` and `actor.world_size`
may be overridden with `--set key=value` as on the train command line) and the engine layout. Engines sit on
`--engine-nodes` separate nodes (split placement) or, with 0, on the actor's GPUs (colocated).

Checked: coverage (every byte each engine rank needs arrives exactly once; nothing else arrives). Printed, per mode:
bytes per link class, and a predicted time from this transfer model:

    gather     each stream's TP/ETP all-gather inside the actor node: gathered bytes x (g-1)/g / NVLink bus bandwidth
    transport  per (stream, distinct slice) one broadcast spanning the engine ranks that keep it, in every engine: a
               leader sends each byte of each distinct slice once (ring/tree broadcast; receivers forward), so its NIC
               carries the stream once; a receiving GPU takes its own slices from every stream. Over NVLink when
               sender and receiver share a node (colocated), else InfiniBand (one NIC per GPU).
    predicted  max(gather, busiest sending link, busiest receiving link) + one bucket of pipeline fill, since
               gathers, packing and sends of successive buckets overlap (double buffering)
    bound      the bytes the busiest receiving GPU must take / its link bandwidth (nothing can beat it)

The last lines are one per mode:
    plan: model=<type> ranks=<n> mode=<m> coverage=ok bytes_gb=<x> predicted_s=<p> bound_s=<b>
Exit 1 (coverage=FAIL) when a byte is missing or duplicated, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

DEFAULT_BW = {"nvlink_gbps": 370.0, "ib_gbps": 46.0}  # H100 NVLink bus bandwidth; 400G NDR per NIC, measured-ish


def load_bandwidths(path: str | None) -> dict[str, float]:
    """Link bandwidths in GB/s: defaults, or a `tools/nccl_diag.py sweep --json` file (its largest-size busbw of the
    intra-node and inter-node all-gathers / broadcasts)."""
    if path is None:
        return dict(DEFAULT_BW)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"error: --bandwidths {path}: {err}") from None
    out = dict(DEFAULT_BW)
    rows = data.get("results", data if isinstance(data, list) else [])
    for scope, key in (("intra", "nvlink_gbps"), ("inter", "ib_gbps")):
        best = [r.get("busbw_gbps", 0.0) for r in rows if isinstance(r, dict) and r.get("scope") == scope]
        if best:
            out[key] = max(best)
    for key in DEFAULT_BW:
        if key in data:
            out[key] = float(data[key])
    return out


def compose(recipe: str, overrides: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from mcore_rl.config import register_schema, to_config

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_module("mcore_rl.configs", version_base=None):
        return to_config(hydra_compose(config_name=recipe, overrides=overrides))


def meta_inventory(hf_dict: dict, layout: Any, divisible_by: int, dtype: str) -> tuple[list, Any, Any]:
    """The recipe's sources at its actor layout, from a meta-device model (torch.distributed world of 1 here)."""
    import torch
    import torch.distributed as dist

    from mcore_rl.models.base import HFConfig
    from mcore_rl.models.builder import ModelSpec, build_gpt_chunks
    from mcore_rl.parallel.groups import free_port, init_distributed, initialize_model_parallel
    from mcore_rl.parallel.layout import ParallelLayout
    from mcore_rl.resharding.sync.inventory import meta_sources

    if not dist.is_initialized():
        init_distributed("cpu", 0, 1, "127.0.0.1", free_port())
    pg = initialize_model_parallel(ParallelLayout())
    hf = HFConfig(hf_dict)
    spec = ModelSpec(
        hf,
        ParallelLayout(),
        dtype=getattr(torch, dtype),
        make_vocab_size_divisible_by=divisible_by * layout.tp,
        config_overrides={"perform_initialization": False},
    )
    shape = spec.family.shape(hf)
    sources = meta_sources(
        lambda: build_gpt_chunks(spec, pg, meta=True), spec.weight_map(), layout, shape.num_layers, shape.num_experts
    )
    return sources, shape, spec.family


def link_loads(plan: Any, actor_world: int, gpus_per_node: int, engine_nodes: int) -> dict[str, Any]:
    """Bytes per sending/receiving GPU and per link class under the transfer model in the module docstring."""
    eng = plan.engines
    sent: dict[int, float] = defaultdict(float)  # leader rank -> bytes its link sends
    per_rank: dict[int, float] = defaultdict(float)  # engine-local rank -> bytes (every engine receives the same)
    by_class = {"nvlink": 0.0, "ib": 0.0}
    gather: dict[int, float] = defaultdict(float)  # leader -> bytes through its TP/ETP all-gather
    # Colocated engines occupy the actor's GPUs in order (engine e, rank r -> GPU e * tp + r): how many engines put
    # their rank r on a given node, for the bytes that stay on a leader's node (NVLink); split engines: none do.
    on_node: dict[tuple[int, int], int] = defaultdict(int)  # (engine-local rank, node) -> engines
    if engine_nodes == 0:
        for engine in range(eng.num_engines):
            for r in range(eng.tp):
                on_node[(r, (engine * eng.tp + r) // gpus_per_node)] += 1
    for bucket in plan.buckets:
        stream = plan.streams[bucket.stream]
        g = len(stream.group)
        node = stream.leader // gpus_per_node
        for e in bucket.entries:
            source = plan.sources[e.source]
            if source.axis is not None and g > 1:
                gather[stream.leader] += e.nbytes * (g - 1) / g
            rows = e.shape[e.dim] if e.shape else 1
            per_row = e.nbytes / max(1, rows)
            slices = plan.receive_slices(e)
            # one broadcast carries a slice that several engine-local ranks keep (replicated tensors, full mode)
            for got in set(slices) - {None}:
                sent[stream.leader] += per_row * got[1]
            for r, got in enumerate(slices):
                if got is None:
                    continue
                nbytes = per_row * got[1]
                per_rank[r] += nbytes
                local = on_node.get((r, node), 0)
                by_class["nvlink"] += nbytes * local
                by_class["ib"] += nbytes * (eng.num_engines - local)
    received = {(engine, r): nbytes for engine in range(eng.num_engines) for r, nbytes in per_rank.items()}
    return {"sent": sent, "received": received, "gather": gather, "by_class": by_class}


def predict(plan: Any, loads: dict, bw: dict[str, float], engine_nodes: int, gpus_per_node: int) -> dict[str, float]:
    ib, nvl = bw["ib_gbps"] * 1e9, bw["nvlink_gbps"] * 1e9
    colocated = engine_nodes == 0
    # a colocated receiver shares its node with some senders; the model charges its whole intake at the slower
    # link unless every byte it takes comes from its own node (never the case with streams spread over nodes)
    receive_s = max(loads["received"].values(), default=0.0) / ib
    send_s = max(loads["sent"].values(), default=0.0) / ib
    gather_s = max(loads["gather"].values(), default=0.0) / nvl
    fill_s = plan.bucket_bytes / ib
    return {
        "gather_s": gather_s,
        "send_s": send_s,
        "receive_s": receive_s,
        "predicted_s": max(gather_s, send_s, receive_s) + fill_s,
        "bound_s": receive_s,
        "colocated": float(colocated),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="tools/plan_sync.py")
    parser.add_argument("--recipe", required=True, help="a configs/ name, e.g. qwen3_235b_a22b_32n")
    parser.add_argument("--actor-nodes", type=int, default=None, help="nodes of the actor (default: the recipe's)")
    parser.add_argument("--engine-nodes", type=int, default=0, help="separate rollout nodes (0: colocated)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--engines", type=int, default=None, help="engines (default: fill the engine GPUs)")
    parser.add_argument("--engine-tp", type=int, default=8)
    parser.add_argument("--engine-ep", type=int, default=8)
    parser.add_argument("--dp-attention", type=int, default=1)
    parser.add_argument("--mode", choices=("full", "shard_aware"), default=None, help="default: both")
    parser.add_argument("--bucket-mb", type=int, default=2048)
    parser.add_argument("--bandwidths", default=None, help="a tools/nccl_diag.py sweep --json file")
    parser.add_argument("--set", action="append", default=[], help="config override, e.g. actor.layout.pp=2")
    args = parser.parse_args(argv)
    try:
        cfg = compose(args.recipe, args.set)
    except Exception as err:  # noqa: BLE001 (Hydra and config errors are all bad input here)
        parser.error(f"--recipe {args.recipe}: {err}")
    from mcore_rl.resharding.sync.plan import EngineLayout, PlanError, build_plan

    layout = cfg.actor.layout.to_layout()
    actor_world = cfg.actor.world_size if args.actor_nodes is None else args.actor_nodes * args.gpus_per_node
    if actor_world != cfg.actor.world_size:
        layout.check_world_size(actor_world)
    engine_gpus = (args.engine_nodes or actor_world // args.gpus_per_node) * args.gpus_per_node
    engines = args.engines or engine_gpus // args.engine_tp
    if engines < 1:
        parser.error(f"--engine-tp {args.engine_tp} is larger than the {engine_gpus} engine GPUs")
    bw = load_bandwidths(args.bandwidths)
    hf = cfg.model.hf_config if not cfg.model.path else json.load(open(os.path.join(cfg.model.path, "config.json")))
    t0 = time.perf_counter()
    sources, shape, family = meta_inventory(dict(hf), layout, cfg.model.make_vocab_size_divisible_by, cfg.model.dtype)
    print(f"{args.recipe}: {hf['model_type']}, {len(sources)} Megatron tensors from the meta model in "
          f"{time.perf_counter() - t0:.1f} s; actor {layout.describe()} on {actor_world} GPUs; {engines} engines "
          f"tp{args.engine_tp} ep{args.engine_ep} dp-attn{args.dp_attention} on "
          f"{'the same GPUs (colocated)' if args.engine_nodes == 0 else f'{args.engine_nodes} other nodes'}; "
          f"links: NVLink {bw['nvlink_gbps']:.0f} GB/s, IB {bw['ib_gbps']:.0f} GB/s per GPU")  # fmt: skip
    ranks = actor_world + (args.engine_nodes * args.gpus_per_node)
    lines, failed = [], False
    for mode in [args.mode] if args.mode else ["full", "shard_aware"]:
        t0 = time.perf_counter()
        try:
            plan = build_plan(
                sources, actor_layout=layout, world_size=actor_world,
                engines=EngineLayout(engines, args.engine_tp, args.engine_ep, args.dp_attention),
                rules=family.engine_shards, bucket_bytes=args.bucket_mb << 20, mode=mode,
                num_experts=shape.num_experts, num_kv_heads=shape.num_query_groups,
                num_heads=shape.num_attention_heads,
            )  # fmt: skip
        except PlanError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        problems = plan.check_coverage()
        loads = link_loads(plan, actor_world, args.gpus_per_node, args.engine_nodes)
        p = predict(plan, loads, bw, args.engine_nodes, args.gpus_per_node)
        gb = plan.nbytes / 1e9
        per_gpu, sender = max(loads["received"].values()) / 1e9, max(loads["sent"].values()) / 1e9
        nvlink, ib = loads["by_class"]["nvlink"] / 1e9, loads["by_class"]["ib"] / 1e9
        print(
            f"[{mode}] {len(plan.streams)} streams, {len(plan.buckets)} buckets, model {gb:.1f} GB; per engine GPU "
            f"{per_gpu:.1f} GB; busiest sender {sender:.1f} GB; links: NVLink {nvlink:.0f} GB, IB {ib:.0f} GB in all; "
            f"phases: gather {p['gather_s']:.2f} s, send {p['send_s']:.2f} s, receive {p['receive_s']:.2f} s; "
            f"planned in {time.perf_counter() - t0:.1f} s"
        )  # fmt: skip
        for problem in problems[:10]:
            print(f"  coverage: {problem}")
        failed |= bool(problems)
        lines.append(
            f"plan: model={hf['model_type']} ranks={ranks} mode={mode} coverage={'FAIL' if problems else 'ok'} "
            f"bytes_gb={gb:.1f} predicted_s={p['predicted_s']:.2f} bound_s={p['bound_s']:.2f}"
        )
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
