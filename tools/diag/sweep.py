"""Collective bandwidth sweep in the manner of nccl-tests, through torch.distributed.

    launcher (torchrun env | local spawn | Ray, one worker per node) -> run_rank() on every rank
      -> per op, per size: warmup, barrier, timed iterations, slowest rank's time -> rows on rank 0
      -> algbw = S / t, busbw = algbw * factor (nccl-tests doc/PERFORMANCE.md) -> table, JSON, verdict

S is the size column: the whole buffer for all_reduce / broadcast, the gathered (all_gather) or scattered
(reduce_scatter) buffer, and each rank's send buffer for all_to_all; sizes are rounded down so every rank gets an
equal chunk. Backend: NCCL on CUDA, else gloo on CPU tensors (so the tool runs on any machine).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .env_probe import probe_ib

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
# torch dtype name -> nccl-tests' type column
DTYPES = {"float32": "float", "float16": "half", "bfloat16": "bfloat16", "float64": "double", "int32": "int32"}
# Ops whose buffer is split in equal per-rank chunks.
_CHUNKED = ("all_gather", "reduce_scatter", "all_to_all")


@dataclass
class SweepConfig:
    """What to measure; the same on every rank."""

    ops: list[str] = field(default_factory=lambda: list(OPS))
    min_bytes: int = 8
    max_bytes: int = 64 * 2**20
    factor: float = 2.0
    iters: int = 20
    warmup: int = 5
    dtype: str = "float32"
    timeout_s: float = 300.0


@dataclass
class SweepRow:
    """One line of the nccl-tests style table."""

    op: str
    size_bytes: int
    count: int
    type: str
    time_us: float
    algbw_gbs: float
    busbw_gbs: float


def busbw_factor(op: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n;
    broadcast 1."""
    if op == "all_reduce":
        return 2.0 * (nranks - 1) / nranks
    if op in _CHUNKED:
        return (nranks - 1) / nranks
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def message_sizes(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """Geometric series min, min*factor, ... <= max (max itself is always included, as in nccl-tests)."""
    sizes, size = [], float(min_bytes)
    while size <= max_bytes:
        sizes.append(int(size))
        size *= factor
    if sizes and sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


def op_elements(op: str, size_bytes: int, elem_size: int, nranks: int) -> int:
    """Elements in the op's size-column buffer (0 when the size is too small for one element per rank)."""
    count = size_bytes // elem_size
    return (count // nranks) * nranks if op in _CHUNKED else count


def _collective(op: str, total: int, nranks: int, dtype: torch.dtype, device: torch.device) -> Any:
    chunk = total // nranks
    if op == "all_reduce":
        buf = torch.zeros(total, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buf)
    if op == "broadcast":
        buf = torch.zeros(total, dtype=dtype, device=device)
        return lambda: dist.broadcast(buf, src=0)
    big = torch.zeros(total, dtype=dtype, device=device)
    small = torch.zeros(chunk, dtype=dtype, device=device)
    if op == "all_gather":
        # torch 2.13 renamed all_gather_into_tensor -> all_gather_single (the old name warns); take what exists.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(big, small)
    if op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(small, big)
    out = torch.zeros(total, dtype=dtype, device=device)
    return lambda: dist.all_to_all_single(out, big)


def _time(fn: Any, cfg: SweepConfig, sync: Any, device: torch.device) -> float:
    for _ in range(cfg.warmup):
        fn()
    sync()
    # NCCL's barrier must be told the device, or it guesses from the rank and may pick another GPU.
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(cfg.iters):
        fn()
    sync()
    elapsed = torch.tensor([(time.perf_counter() - start) / cfg.iters], dtype=torch.float64, device=device)
    # A collective is as slow as its slowest member: report the maximum over ranks.
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def run_rank(cfg: SweepConfig, rank: int, world_size: int, local_rank: int, init_method: str) -> dict | None:
    """Join the process group, sweep, and return the result dict on rank 0 (None elsewhere)."""
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=cfg.timeout_s)
    )
    try:
        hosts: list[Any] = [None] * world_size
        dist.all_gather_object(hosts, socket.gethostname())
        dtype = getattr(torch, cfg.dtype)
        elem = torch.tensor([], dtype=dtype).element_size()
        sync = torch.cuda.synchronize if use_cuda else (lambda: None)
        rows = []
        for op in cfg.ops:
            for size in message_sizes(cfg.min_bytes, cfg.max_bytes, cfg.factor):
                total = op_elements(op, size, elem, world_size)
                if total == 0:
                    continue
                seconds = _time(_collective(op, total, world_size, dtype, device), cfg, sync, device)
                nbytes = total * elem
                algbw = nbytes / 1e9 / seconds
                rows.append(
                    SweepRow(
                        op, nbytes, total, DTYPES[cfg.dtype], seconds * 1e6, algbw, algbw * busbw_factor(op, world_size)
                    )
                )
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    per_host = Counter(hosts)
    ib = probe_ib("/sys")
    ports = [p for _, p in ib.active_ib_ports() if p.rate_gbps]
    return {
        "backend": backend,
        "world_size": world_size,
        "nnodes": len(per_host),
        "ranks_per_node": max(per_host.values()),
        "hosts": sorted(per_host),
        "gpu_name": torch.cuda.get_device_name(device) if use_cuda else None,
        "nic_rate_gbps": max((p.rate_gbps for p in ports), default=None),
        "nics": len(ports),
        "config": asdict(cfg),
        "rows": [asdict(r) for r in rows],
    }


def _spawn_entry(local_rank: int, nproc: int, cfg: SweepConfig, init_method: str, out_path: str) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc))
    os.environ["LOCAL_WORLD_SIZE"] = str(nproc)
    result = run_rank(cfg, local_rank, nproc, local_rank, init_method)
    if result is not None:
        import json

        with open(out_path, "w") as fh:
            json.dump(result, fh)


def run_local(cfg: SweepConfig, nproc: int) -> dict:
    """Spawn `nproc` local ranks (torch.multiprocessing) and return rank 0's result."""
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="nccl_diag_") as tmp:
        # A file store needs no free TCP port, so concurrent sweeps on one machine cannot collide.
        init_method = f"file://{os.path.join(tmp, 'store')}"
        out_path = os.path.join(tmp, "result.json")
        mp.spawn(_spawn_entry, args=(nproc, cfg, init_method, out_path), nprocs=nproc, join=True)
        with open(out_path) as fh:
            return json.load(fh)


def run_from_env(cfg: SweepConfig) -> dict | None:
    """Run under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); rank 0 gets the result."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return run_rank(cfg, rank, world, int(os.environ.get("LOCAL_RANK", "0")), "env://")


class _RayWorker:
    """One sweep rank per node; the class is wrapped with ray.remote in run_ray."""

    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def run(self, cfg: SweepConfig, rank: int, world: int, master: str, port: int) -> dict | None:
        # Ray sets CUDA_VISIBLE_DEVICES to this worker's one GPU, so the local device is always 0.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        return run_rank(cfg, rank, world, 0, f"tcp://{master}:{port}")


def run_ray(cfg: SweepConfig, nodes: int | None = None, address: str | None = None) -> dict:
    """Place one rank on each of `nodes` Ray nodes (STRICT_SPREAD placement group) and sweep across them."""
    import sys

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # Workers import diag.sweep by name: ship tools/ on their PYTHONPATH (the repo sits on a shared filesystem).
    tools_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": tools_dir}}, log_to_driver=True)
    alive = [n for n in ray.nodes() if n.get("Alive")]
    nodes = nodes or len(alive)
    gpus = 1 if all(n.get("Resources", {}).get("GPU", 0) >= 1 for n in alive) else 0
    bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in range(nodes)], strategy="STRICT_SPREAD")
    try:
        ray.get(pg.ready(), timeout=cfg.timeout_s)
        actor = ray.remote(num_cpus=1, num_gpus=gpus)(_RayWorker)
        workers = [
            actor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
            ).remote()
            for i in range(nodes)
        ]
        master, port = ray.get(workers[0].address.remote())
        results = ray.get([w.run.remote(cfg, i, nodes, master, port) for i, w in enumerate(workers)])
    finally:
        remove_placement_group(pg)
        ray.shutdown()
    print(f"ray: {nodes} node(s), one rank each", file=sys.stderr)
    return results[0]


def format_table(result: dict) -> str:
    """Rank 0's rows in nccl-tests' columns, one block per op."""
    lines = [
        f"# {result['world_size']} rank(s) on {result['nnodes']} node(s), backend {result['backend']}"
        + (f", {result['gpu_name']}" if result.get("gpu_name") else "")
    ]
    for op in dict.fromkeys(r["op"] for r in result["rows"]):
        lines.append(f"#\n# {op}")
        lines.append(f"# {'size':>10} {'count':>12} {'type':>9} {'time':>10} {'algbw':>8} {'busbw':>8}")
        lines.append(f"# {'(B)':>10} {'(elements)':>12} {'':>9} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}")
        for r in result["rows"]:
            if r["op"] == op:
                lines.append(
                    f"  {r['size_bytes']:>10} {r['count']:>12} {r['type']:>9} {r['time_us']:>10.2f} "
                    f"{r['algbw_gbs']:>8.2f} {r['busbw_gbs']:>8.2f}"
                )
    return "\n".join(lines)
