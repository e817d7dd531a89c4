"""Plan a recipe's weight sync at cluster scale in one process, check it, and predict its time from link bandwidths.

    python tools/plan_sync.py --recipe qwen3_235b_a22b_32n --actor-nodes 8 --engine-nodes 8 --engine-tp 8 --engine-ep 8
    python tools/plan_sync.py --recipe deepseek_v3_671b_32n --engine-tp 32 --engine-ep 32 --dp-attention 4
    python tools/plan_sync.py --recipe ... --mode shard_aware --bandwidths sweep.json   # from nccl_diag.py sweep --json
    python tools/plan_sync.py --recipe ... --engine-nodes 1 --one-leader    # every stream from one rank (vLLM)

The real plan (resharding/sync/plan.py) is built from the recipe's model on the meta device (no weights, no ranks)
for the recipe's actor layout (`--actor-nodes` x `--gpus-per-node` ranks; `actor.layout` and `actor.world_size`
may be overridden with `--set key=value` as on the train command line) and the engine layout. Engines sit on
`--engine-nodes` separate nodes (split placement) or, with 0, on the actor's GPUs (colocated). Stream leaders
are spread over the actor ranks, or all on one rank where the run puts them there (rollout.engine=vllm,
trainer.runtime=cuda, sync.transport=distributed: vLLM's one NCCL weight-transfer group; controller/weight_sync.py
one_sync_leader), or as `--one-leader` / `--no-one-leader` say.

Checked: coverage (every byte each engine rank needs arrives exactly once; nothing else arrives; tensors an engine must
receive together share a bucket). Printed, per mode:
bytes per link class, and a predicted time from the transfer model of resharding/sync/forecast.py (its docstring
says what each term counts), which `launch/submit.py --dry-run` also prints for a recipe's own engine layout.

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
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script from a checkout: import the package beside tools/
    sys.path.insert(0, REPO)

from mcore_rl.controller.recipe_check import meta_inventory  # noqa: E402
from mcore_rl.resharding.sync.forecast import link_loads, load_bandwidths, predict  # noqa: E402


def compose(recipe: str, overrides: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from mcore_rl.config import register_schema, to_config

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_module("mcore_rl.configs", version_base=None):
        return to_config(hydra_compose(config_name=recipe, overrides=overrides))


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
    parser.add_argument(
        "--one-leader", action=argparse.BooleanOptionalAction, default=None,
        help="every stream from one actor rank (default: as the run; on for vLLM's NCCL backend)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        cfg = compose(args.recipe, args.set)
    except Exception as err:  # noqa: BLE001 (Hydra and config errors are all bad input here)
        parser.error(f"--recipe {args.recipe}: {err}")
    from mcore_rl.controller.weight_sync import one_sync_leader
    from mcore_rl.resharding.sync.plan import EngineLayout, PlanError, build_plan

    one_leader = args.one_leader
    if one_leader is None:  # as the run's ranks plan it
        one_leader = one_sync_leader(cfg.rollout.engine, cfg.trainer.runtime, cfg.sync.transport)

    layout = cfg.actor.layout.to_layout()
    actor_world = cfg.actor.world_size if args.actor_nodes is None else args.actor_nodes * args.gpus_per_node
    if actor_world != cfg.actor.world_size:
        layout.check_world_size(actor_world)
    engine_gpus = (args.engine_nodes or actor_world // args.gpus_per_node) * args.gpus_per_node
    engines = args.engines or engine_gpus // args.engine_tp
    if engines < 1:
        parser.error(f"--engine-tp {args.engine_tp} is larger than the {engine_gpus} engine GPUs")
    try:
        bw = load_bandwidths(args.bandwidths)
    except ValueError as err:
        parser.error(f"--bandwidths: {err}")
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
                rules=family.engine_shards, receive_together=family.engine_receive_together,
                bucket_bytes=args.bucket_mb << 20, mode=mode,
                num_experts=shape.num_experts, num_kv_heads=shape.num_query_groups,
                num_heads=shape.num_attention_heads, one_leader=one_leader,
            )  # fmt: skip
        except PlanError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        problems = plan.check_coverage() + plan.split_groups(family.engine_receive_together)
        loads = link_loads(plan, actor_world, args.gpus_per_node, args.engine_nodes)
        p = predict(plan, loads, bw, args.engine_nodes, args.gpus_per_node)
        gb = plan.nbytes / 1e9
        per_gpu, sender = max(loads["received"].values()) / 1e9, max(loads["sent"].values()) / 1e9
        nvlink, ib = loads["by_class"]["nvlink"] / 1e9, loads["by_class"]["ib"] / 1e9
        print(
            f"[{mode}] {len(plan.streams)} streams from {len({s.leader for s in plan.streams})} leader rank(s), "
            f"{len(plan.buckets)} buckets, model {gb:.1f} GB; per engine GPU "
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
