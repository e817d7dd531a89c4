"""Reference bus bandwidths and the verdict of `nccl_diag.py sweep`.

The figures are large-message nccl-tests busbw (GB/s = 1e9 B/s) that healthy systems reach, rounded:

    intra-node NVLink + NVSwitch   H100/H200 SXM  370-480   (all_reduce, NVLS lifts it towards 480)
                                   A100 SXM       210-240
    inter-node, per NIC in use     400G NDR        46-48    (x min(ranks per node, active NICs))
                                   200G HDR        23-24.5
                                   100G EDR        11.5-12.3

Peak needs messages of a few hundred MiB; below 256 MiB the lower bound is relaxed (REDUCED_FRACTION) and below
32 MiB nothing is judged. all_gather / reduce_scatter run at about 90% of all_reduce's busbw on NVSwitch systems;
broadcast and all_to_all are reported but not judged (their busbw depends on the algorithm more than the link).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FULL_PEAK_BYTES = 256 * 2**20
MIN_JUDGED_BYTES = 32 * 2**20
REDUCED_FRACTION = 0.6  # rough: 32-256 MiB messages reach ~60-90% of peak busbw on NVLink and NDR
OP_FRACTION = {"all_reduce": 1.0, "all_gather": 0.9, "reduce_scatter": 0.9}

# (pattern on the CUDA device name, label, busbw low, busbw high); first match wins, None means "no reference".
GPU_NVLINK_REFS: list[tuple[re.Pattern[str], str | None, float, float]] = [
    (re.compile(r"\b(H100|H200|A100)\b.*\b(PCIe|NVL)\b", re.I), None, 0.0, 0.0),  # NVLink bridge, no NVSwitch
    (re.compile(r"\bH(100|200)\b", re.I), "H100/H200 SXM NVLink", 370.0, 480.0),
    (re.compile(r"\bA100\b.*\bSXM|\bA100-SXM", re.I), "A100 SXM NVLink", 210.0, 240.0),
]
# Per-NIC busbw keyed by the port rate in Gb/s read from sysfs.
NIC_REFS: dict[int, tuple[str, float, float]] = {
    400: ("400G NDR", 46.0, 48.0),
    200: ("200G HDR/NDR200", 23.0, 24.5),
    100: ("100G EDR", 11.5, 12.3),
}


@dataclass
class Reference:
    """Expected busbw band for the link a sweep crosses."""

    link: str
    label: str
    low: float
    high: float


@dataclass
class Verdict:
    """The sweep's conclusion: status "ok" | "underperforms" | "no-reference" | "inconclusive"."""

    status: str
    link: str
    message: str

    @property
    def is_problem(self) -> bool:
        """True when the measured busbw is below the reference (the CLI exits 1)."""
        return self.status == "underperforms"


def nvlink_reference(gpu_name: str | None) -> Reference | None:
    """The intra-node NVLink reference for a CUDA device name, or None when there is none."""
    for pattern, label, low, high in GPU_NVLINK_REFS:
        if gpu_name and pattern.search(gpu_name):
            return Reference("intra-node NVLink", label, low, high) if label else None
    return None


def network_reference(nic_rate_gbps: float | None, nics: int, ranks_per_node: int) -> Reference | None:
    """The inter-node reference: per-NIC band times the NICs a node's ranks can drive at once."""
    if not nic_rate_gbps or nics <= 0:
        return None
    ref = NIC_REFS.get(int(round(nic_rate_gbps)))
    if ref is None:
        return None
    label, low, high = ref
    # Each rank's rings leave the node through its nearest NIC, so a node drives min(ranks, NICs) NICs.
    used = max(1, min(nics, ranks_per_node))
    return Reference("inter-node network", f"{used} x {label}", low * used, high * used)


def judge(
    backend: str,
    rows: list[dict],
    nnodes: int,
    ranks_per_node: int,
    gpu_name: str | None,
    nic_rate_gbps: float | None,
    nics: int,
) -> Verdict:
    """Compare the largest-message busbw per judged op with the reference of the link the sweep crosses."""
    if backend != "nccl":
        return Verdict("no-reference", "none", f"no reference for {backend}/CPU: the figures are for NCCL on GPUs")
    if nnodes > 1:
        ref = network_reference(nic_rate_gbps, nics, ranks_per_node)
        if ref is None:
            return Verdict("no-reference", "inter-node network", f"no reference for NIC rate {nic_rate_gbps} Gb/s")
        nv = nvlink_reference(gpu_name)
        if nv is not None and nv.low < ref.low:  # NVLink is the tighter bound when many NICs are in use
            ref = Reference(ref.link, ref.label, nv.low, nv.high)
    else:
        ref = nvlink_reference(gpu_name)
        if ref is None:
            return Verdict("no-reference", "intra-node", f"no NVLink reference for GPU '{gpu_name}'")
    if ranks_per_node < 2 and nnodes == 1:
        return Verdict("no-reference", ref.link, "one rank: no link is crossed")
    failures, checked = [], []
    for op, fraction in OP_FRACTION.items():
        op_rows = [r for r in rows if r["op"] == op]
        if not op_rows:
            continue
        largest = max(op_rows, key=lambda r: r["size_bytes"])
        size = largest["size_bytes"]
        if size < MIN_JUDGED_BYTES:
            continue
        floor = ref.low * fraction * (1.0 if size >= FULL_PEAK_BYTES else REDUCED_FRACTION)
        checked.append(op)
        if largest["busbw_gbs"] < floor:
            failures.append(f"{op} {largest['busbw_gbs']:.1f} GB/s at {size / 2**20:.0f} MiB < {floor:.0f}")
    if not checked:
        return Verdict(
            "inconclusive", ref.link, f"largest message below {MIN_JUDGED_BYTES // 2**20} MiB: rerun --max-bytes 1G"
        )
    band = f"expected {ref.low:.0f}-{ref.high:.0f} GB/s busbw for {ref.label}"
    if failures:
        hint = (
            "check NVLink state (env), NCCL_P2P_DISABLE, NCCL_NVLS_ENABLE, and `log` on an NCCL_DEBUG=INFO run"
            if ref.link.startswith("intra")
            else "check IB port state/rate (env), nvidia_peermem/GDR, NCCL_IB_HCA, and `log` on an NCCL_DEBUG=INFO run"
        )
        return Verdict("underperforms", ref.link, f"{ref.link} underperforms: {'; '.join(failures)} ({band}); {hint}")
    return Verdict("ok", ref.link, f"{ref.link} ok: {', '.join(checked)} within reach of the {band}")
