#!/usr/bin/env python
"""NCCL/GDR doctor: what the machine offers, what NCCL picked, and whether the links deliver.

    python tools/nccl_diag.py env [--json] [--sysfs-root DIR] [--proc-root DIR] [--multi-node]
        GPUs, NVLink and topology (nvidia-ml-py, `nvidia-smi topo -m`), IB ports (sysfs), the GPUDirect RDMA module,
        and NCCL_*/GLOO_* variables with a warning per risky value. Missing hardware is reported "absent".
    python tools/nccl_diag.py sweep [--nproc N | --ray] [--min-bytes 8] [--max-bytes 64M] [--factor 2]
                                    [--iters 20] [--warmup 5] [--dtype float32] [--ops all_reduce,...] [--json FILE]
        nccl-tests style bandwidth sweep; under torchrun it uses RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR:
        torchrun --nnodes 2 --nproc-per-node 8 ... tools/nccl_diag.py sweep --max-bytes 1G
    python tools/nccl_diag.py log FILE [--json]
        Parse an NCCL_DEBUG=INFO log: version, network, transports per channel, NVLS, CollNet, diagnosis.

Exit status: 0 ok, 1 when the diagnosis (log, sweep verdict) finds a problem, 2 for bad usage or unreadable input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict
from typing import Any

from diag import env_probe, env_rules, nccl_log

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2
_SWEEP_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")  # diag.sweep.OPS, no torch
_SWEEP_DTYPES = ("float32", "float16", "bfloat16", "float64", "int32")


def parse_bytes(text: str) -> int:
    """'8', '64K', '64M', '1G' (powers of 1024, like nccl-tests) -> bytes; argparse-friendly errors."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.I)
    if match is None or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use a positive integer with optional K, M or G")
    return int(match.group(1)) * 1024 ** " KMG".index(match.group(2).upper() or " ")


def _positive(kind: type) -> Any:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    return convert


def _ops(text: str) -> list[str]:
    ops = [o.strip() for o in text.split(",") if o.strip()]
    bad = [o for o in ops if o not in _SWEEP_OPS]
    if bad or not ops:
        raise argparse.ArgumentTypeError(f"unknown op(s) {bad or text!r}; choose from {','.join(_SWEEP_OPS)}")
    return ops


def build_parser() -> argparse.ArgumentParser:
    """The CLI: env, sweep and log subcommands."""
    parser = argparse.ArgumentParser(prog="nccl_diag.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    env = sub.add_parser("env", help="GPUs, NVLink, IB ports, GDR module, risky NCCL_*/GLOO_* variables")
    env.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    env.add_argument("--sysfs-root", default="/sys", help="sysfs mount to read (default /sys)")
    env.add_argument("--proc-root", default="/proc", help="procfs mount to read (default /proc)")
    env.add_argument("--multi-node", action="store_true", help="treat the job as multi-node for the env warnings")

    sweep = sub.add_parser("sweep", help="nccl-tests style bandwidth sweep with a verdict")
    launch = sweep.add_mutually_exclusive_group()
    launch.add_argument("--nproc", type=_positive(int), help="spawn N local ranks (default: GPUs, or 2 on CPU)")
    launch.add_argument("--ray", action="store_true", help="one rank per Ray node (placement group, STRICT_SPREAD)")
    sweep.add_argument("--ray-address", default=None, help="Ray cluster address (default: RAY_ADDRESS or local)")
    sweep.add_argument("--ray-nodes", type=_positive(int), default=None, help="nodes to use (default: all alive)")
    sweep.add_argument("--min-bytes", type=parse_bytes, default=8, help="smallest message (default 8)")
    sweep.add_argument("--max-bytes", type=parse_bytes, default=64 * 2**20, help="largest message (default 64M)")
    sweep.add_argument("--factor", type=_positive(float), default=2.0, help="size multiplier per step (default 2)")
    sweep.add_argument("--iters", type=_positive(int), default=20, help="timed iterations per size (default 20)")
    sweep.add_argument("--warmup", type=int, default=5, help="untimed iterations per size (default 5)")
    sweep.add_argument("--dtype", choices=_SWEEP_DTYPES, default="float32")
    sweep.add_argument("--ops", type=_ops, default=list(_SWEEP_OPS), help="comma list (default: all five)")
    sweep.add_argument("--timeout", type=_positive(float), default=300.0, help="process-group timeout, seconds")
    sweep.add_argument("--json", metavar="FILE", help="write the whole table and verdict as JSON")

    log = sub.add_parser("log", help="diagnose an NCCL_DEBUG=INFO log")
    log.add_argument("file", help="log file (text; binary junk and truncated lines are tolerated)")
    log.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def cmd_env(args: argparse.Namespace) -> int:
    """Probe the machine and print the report; missing hardware is not an error."""
    gpus = env_probe.probe_gpus()
    ib = env_probe.probe_ib(args.sysfs_root)
    gdr = env_probe.probe_gdr(args.sysfs_root, args.proc_root)
    multi = True if args.multi_node else env_rules.detect_multi_node(os.environ)
    warnings = env_rules.check_env(os.environ, [d.name for d in ib.devices], multi)
    comm_env = env_rules.collect_comm_env(os.environ)
    gpu_nic = env_probe.gpu_nic_matrix(gpus.gpus, ib, args.sysfs_root)
    hardware = env_probe.hardware_findings(gpus, ib, gdr)
    if args.json:
        report = {"gpus": asdict(gpus), "ib": asdict(ib), "gpu_nic": gpu_nic, "gdr": asdict(gdr), "env": comm_env}
        report["multi_node"], report["hardware_warnings"] = multi, hardware
        report["warnings"] = [asdict(w) for w in warnings]
        print(json.dumps(report, indent=2))
        return EXIT_OK
    if gpus.status == "present":
        print(f"GPUs: {len(gpus.gpus)} (driver {gpus.driver_version}, CUDA driver API {gpus.cuda_driver_version})")
        for g in gpus.gpus:
            down = len(g.nvlinks) - g.active_nvlinks
            print(
                f"  GPU{g.index} {g.name} {g.pci_bus_id} {g.memory_total_mib} MiB, "
                f"NVLink {g.active_nvlinks} active" + (f", {down} down" if down else "")
            )
        if gpus.topology:
            print("  topology (NVML): " + "   ".join(f"GPU{i}" for i in range(len(gpus.topology))))
            for i, row in enumerate(gpus.topology):
                print(f"    GPU{i}  " + "  ".join(f"{c:>5}" for c in row))
    else:
        print(f"GPUs: absent ({gpus.reason})")
    if gpus.nvidia_smi_topo:
        print("nvidia-smi topo -m:\n" + "\n".join("  " + ln for ln in gpus.nvidia_smi_topo.splitlines()))
    else:
        print(f"nvidia-smi topo -m: absent ({gpus.nvidia_smi_reason})")
    if ib.status == "present":
        print(f"InfiniBand/RDMA: {len(ib.devices)} device(s)")
        for d in ib.devices:
            where = f" pci {d.pci_addr}" if d.pci_addr else ""
            numa = f" numa {d.numa_node}" if d.numa_node is not None else ""
            print(f"  {d.name} ({d.hca_type or '?'}, fw {d.fw_ver or '?'}){where}{numa}")
            for p in d.ports:
                print(f"    port {p.port}: {p.state} / {p.phys_state}, {p.rate}, {p.link_layer}")
    else:
        print(f"InfiniBand/RDMA: absent ({ib.reason})")
    if gpu_nic:
        print("GPU/NIC PCIe distance (sysfs; GDR needs PXB or closer by default):")
        for gpu, row in gpu_nic.items():
            print(f"  {gpu}: " + "  ".join(f"{nic} {label}" for nic, label in row.items()))
    if gdr.status == "loaded":
        print(f"GPUDirect RDMA: {gdr.module} loaded ({'; '.join(gdr.evidence)})")
    else:
        print(f"GPUDirect RDMA: absent ({gdr.reason})")
    print("NCCL_*/GLOO_* variables: " + (", ".join(f"{k}={v}" for k, v in comm_env.items()) or "none set"))
    print("Warnings:" if warnings or hardware else "Warnings: none")
    for line in hardware:
        print(f"  [hardware] {line}")
    for w in warnings:
        print("  " + w.format())
    return EXIT_OK


def cmd_log(args: argparse.Namespace) -> int:
    """Parse and diagnose an NCCL log; exit 1 on a problem, 2 when the file cannot be read."""
    try:
        r = nccl_log.parse_file(args.file)
    except OSError as exc:
        print(f"nccl_diag.py log: cannot read {args.file!r}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps({**asdict(r), "has_problem": r.has_problem}, indent=2))
        return EXIT_PROBLEM if r.has_problem else EXIT_OK
    print(
        f"NCCL log {r.path}: {r.total_lines} lines ({r.nccl_lines} NCCL, {r.other_lines} other, "
        f"{r.unreadable_lines} unreadable, {r.truncated_lines} truncated)"
    )
    print(f"NCCL version: {', '.join(r.versions) or 'not found'}")
    nodes = f", {r.nnodes} node(s)" if r.nnodes else ""
    print(
        f"hosts: {len(r.hosts)} ({', '.join(r.hosts[:8])}{' ...' if len(r.hosts) > 8 else ''}); ranks {r.nranks}{nodes}"
    )
    network = ", ".join(r.networks) or "not reported"
    if r.ib_devices:
        network += f"; IB devices {' '.join(r.ib_devices)}"
    if r.socket_ifaces:
        network += f"; sockets over {', '.join(r.socket_ifaces)}"
    if r.oob_ifaces:
        network += f"; OOB {', '.join(r.oob_ifaces)}"
    if r.plugins:
        network += f"; plugins {', '.join(r.plugins)}"
    print(f"network: {network}")
    print("transports (connection lines, sample rank pairs):" if r.transport_counts else "transports: none logged")
    for kind, count in r.transport_counts.items():
        print(f"  {kind:<20} {count:>6}   {' '.join(r.transport_pairs.get(kind, []))}")
    print(f"NVLS multicast: {r.nvls_available_devs} device(s) available, {r.nvls_unavailable_devs} not")
    if r.collnet_channels or r.collnet_transports:
        print(f"CollNet: {r.collnet_channels} channel(s), {r.collnet_transports}")
    if r.rings:
        first = min(r.rings)
        order = " ".join(map(str, r.rings[first]))
        print(f"rings: {len(r.rings)} channel(s), channel {first}: {order}; trees lines {r.tree_lines}")
    print("diagnosis:")
    for f in r.findings:
        print(f"  [{f.severity}] {f.message}")
    return EXIT_PROBLEM if r.has_problem else EXIT_OK


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run the sweep with the chosen launcher; rank 0 prints the table and the verdict."""
    if args.min_bytes > args.max_bytes:
        print(f"nccl_diag.py sweep: --min-bytes {args.min_bytes} > --max-bytes {args.max_bytes}", file=sys.stderr)
        return EXIT_USAGE
    if args.factor <= 1.0 or args.warmup < 0:
        print("nccl_diag.py sweep: --factor must be > 1 and --warmup >= 0", file=sys.stderr)
        return EXIT_USAGE
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        print(f"nccl_diag.py sweep: cannot write --json {args.json!r}: its folder does not exist", file=sys.stderr)
        return EXIT_USAGE
    from diag import expectations, sweep  # torch is imported here only

    cfg = sweep.SweepConfig(
        ops=args.ops,
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes,
        factor=args.factor,
        iters=args.iters,
        warmup=args.warmup,
        dtype=args.dtype,
        timeout_s=args.timeout,
    )
    try:
        if args.ray:
            result = sweep.run_ray(cfg, args.ray_nodes, args.ray_address)
        elif args.nproc is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            result = sweep.run_from_env(cfg)
            if result is None:  # not rank 0: rank 0 reports
                return EXIT_OK
        else:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            nproc = args.nproc or gpus or 2
            if gpus and nproc > gpus:
                print(f"nccl_diag.py sweep: --nproc {nproc} > {gpus} visible GPUs", file=sys.stderr)
                return EXIT_USAGE
            result = sweep.run_local(cfg, nproc)
    except Exception as exc:  # a hang-up or failure of the collectives is itself the finding
        print(f"nccl_diag.py sweep: the sweep failed: {exc}", file=sys.stderr)
        return EXIT_PROBLEM
    verdict = expectations.judge(
        result["backend"],
        result["rows"],
        result["nnodes"],
        result["ranks_per_node"],
        result["gpu_name"],
        result["nic_rate_gbps"],
        result["nics"],
    )
    print(sweep.format_table(result))
    print(f"# verdict [{verdict.status}]: {verdict.message}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**result, "verdict": asdict(verdict)}, fh, indent=2)
    return EXIT_PROBLEM if verdict.is_problem else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    return {"env": cmd_env, "sweep": cmd_sweep, "log": cmd_log}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
