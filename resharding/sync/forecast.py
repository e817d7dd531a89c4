"""Predicted weight-sync time of a plan from link bandwidths: the transfer model of `tools/plan_sync.py` and of
`launch/submit.py --dry-run`'s recipe check (pure arithmetic over the plan's buckets; no ranks, no network).

    gather     each stream's TP/ETP all-gather inside the actor node: gathered bytes x (g-1)/g / NVLink bus bandwidth
    transport  per (stream, distinct slice) one broadcast spanning the engine ranks that keep it, in every engine: a
               leader sends each byte of each distinct slice once (ring/tree broadcast; receivers forward), so its NIC
               carries the stream once; a receiving GPU takes its own slices from every stream. Over NVLink when
               sender and receiver share a node (colocated), else InfiniBand (one NIC per GPU).
    predicted  max(gather, busiest sending link, busiest receiving link) + one bucket of pipeline fill, since
               gathers, packing and sends of successive buckets overlap (double buffering)
    bound      the bytes the busiest receiving GPU must take / its link bandwidth (nothing can beat it)
"""

from __future__ import annotations

import json
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
        raise ValueError(f"bandwidths file {path}: {err}") from None
    out = dict(DEFAULT_BW)
    rows = data if isinstance(data, list) else data.get("results", [])
    data = data if isinstance(data, dict) else {}
    for scope, key in (("intra", "nvlink_gbps"), ("inter", "ib_gbps")):
        best = [r.get("busbw_gbps", 0.0) for r in rows if isinstance(r, dict) and r.get("scope") == scope]
        if best:
            out[key] = max(best)
    for key in DEFAULT_BW:
        if key in data:
            out[key] = float(data[key])
    return out


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
    fill_s = plan.max_bucket_bytes / ib
    return {
        "gather_s": gather_s,
        "send_s": send_s,
        "receive_s": receive_s,
        "predicted_s": max(gather_s, send_s, receive_s) + fill_s,
        "bound_s": receive_s,
        "colocated": float(colocated),
    }
