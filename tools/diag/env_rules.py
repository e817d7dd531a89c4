"""The NCCL_* / GLOO_* variables of a process and the values among them that quietly cost bandwidth or break
multi-node runs.

Each rule is a small function of (name, value, context) that returns warnings naming the variable, its value and
why it is risky. Severities: "error" (will break or cripple a multi-node job), "warning" (likely slower than it
should be), "info" (worth knowing). Semantics follow the NCCL environment-variable documentation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

# Interfaces that never reach another node: loopback, the docker bridge, libvirt and container veth pairs.
_LOCAL_ONLY_IFACES = ("lo", "docker", "virbr", "veth", "br-")
_DEFAULT_BUFFSIZE = 4 * 2**20  # NCCL's default NCCL_BUFFSIZE (4 MiB)
_Warn = Callable[[str, str, str], None]  # warn(var, severity, reason)


@dataclass
class EnvWarning:
    """One risky setting: variable, value (None when unset), severity and the reason."""

    var: str
    value: str | None
    severity: str
    reason: str

    def format(self) -> str:
        """One line: `[severity] VAR=value: reason`."""
        shown = "<unset>" if self.value is None else self.value
        return f"[{self.severity}] {self.var}={shown}: {self.reason}"


def collect_comm_env(env: Mapping[str, str]) -> dict[str, str]:
    """The NCCL_* and GLOO_* variables of `env`, sorted by name."""
    return {k: env[k] for k in sorted(env) if k.startswith(("NCCL_", "GLOO_"))}


def detect_multi_node(env: Mapping[str, str]) -> bool | None:
    """True/False when the launcher says how many nodes the job spans (Slurm, torchrun), else None."""
    for key in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "NNODES", "PET_NNODES"):
        value = env.get(key, "")
        if value.isdigit():
            return int(value) > 1
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit():
        return int(world) > int(local)
    return None


def ib_hca_selection(value: str, devices: list[str]) -> tuple[list[str], list[str]]:
    """Which of `devices` NCCL_IB_HCA selects, and which listed names match no device.

    Syntax (NCCL docs): comma list of `dev[:port]`; a leading `^` excludes the list; a leading `=` (after any `^`)
    asks for exact names, otherwise each entry is a prefix ("mlx5" matches mlx5_0, mlx5_1, ...).
    """
    spec = value.strip()
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    entries = [e.split(":")[0].strip() for e in spec.split(",") if e.strip()]

    def matches(dev: str, entry: str) -> bool:
        return dev == entry if exact else dev.startswith(entry)

    picked = [d for d in devices if any(matches(d, e) for e in entries)]
    unknown = [e for e in entries if not any(matches(d, e) for d in devices)]
    selected = [d for d in devices if d not in picked] if exclude else picked
    return selected, unknown


def check_env(
    env: Mapping[str, str], ib_devices: list[str] | None = None, multi_node: bool | None = None
) -> list[EnvWarning]:
    """Warnings for risky NCCL_*/GLOO_* values in `env`.

    `ib_devices` are the RDMA device names present (None or [] when there are none) and `multi_node` whether the
    job spans nodes (None: unknown, in which case node-local-only settings are reported as warnings, not errors).
    """
    warnings: list[EnvWarning] = []

    def warn(var: str, severity: str, reason: str) -> None:
        warnings.append(EnvWarning(var, env.get(var), severity, reason))

    value = {k: env[k].strip() for k in env if k.startswith(("NCCL_", "GLOO_"))}
    if "NCCL_DEBUG" not in value:
        warn("NCCL_DEBUG", "info", "NCCL stays silent; set NCCL_DEBUG=INFO to see the transports it picks")
    elif value["NCCL_DEBUG"].upper() == "TRACE":
        warn("NCCL_DEBUG", "warning", "TRACE logs every operation and slows the job; use INFO for diagnosis")
    if value.get("NCCL_IB_DISABLE") == "1":
        warn("NCCL_IB_DISABLE", "error", "disables InfiniBand/RoCE: inter-node traffic falls back to TCP sockets")
    if value.get("NCCL_NET", "").lower() == "socket":
        warn("NCCL_NET", "error", "forces the TCP socket transport: inter-node traffic will not use IB/RDMA")
    if value.get("NCCL_P2P_DISABLE") == "1":
        warn("NCCL_P2P_DISABLE", "error", "disables NVLink/PCIe peer-to-peer: intra-node traffic goes through SHM")
    if value.get("NCCL_P2P_LEVEL", "").upper() in ("0", "LOC"):
        warn("NCCL_P2P_LEVEL", "error", "LOC/0 never uses P2P: intra-node traffic goes through host memory")
    if value.get("NCCL_SHM_DISABLE") == "1":
        warn("NCCL_SHM_DISABLE", "warning", "disables the shared-memory transport: pairs without P2P use the NIC")
    if value.get("NCCL_NET_GDR_LEVEL", "").upper() in ("0", "LOC"):
        warn(
            "NCCL_NET_GDR_LEVEL", "error", "disables GPUDirect RDMA: every network transfer bounces through host memory"
        )
    if value.get("NCCL_NET_GDR_READ") == "0":
        warn("NCCL_NET_GDR_READ", "warning", "send side stages through host memory (GDR read off)")
    if value.get("NCCL_NVLS_ENABLE") == "0":
        warn("NCCL_NVLS_ENABLE", "warning", "disables NVLink SHARP: H100/H200 all-reduce loses its fastest algorithm")
    if value.get("NCCL_CROSS_NIC") == "1":
        warn(
            "NCCL_CROSS_NIC",
            "warning",
            "rings may leave on one rail and arrive on another: extra spine hops on rail-optimised fabrics",
        )
    for var in ("NCCL_ALGO", "NCCL_PROTO"):
        if var in value:
            warn(
                var,
                "warning",
                "forced: overrides NCCL's tuner for every size (e.g. loses NVLS/Tree or LL at small sizes)",
            )
    _check_sizes(value, warn)
    _check_ifname(value, multi_node, warn)
    _check_ib_hca(value, ib_devices, warn)
    return warnings


def _check_sizes(value: dict[str, str], warn: _Warn) -> None:
    buff = value.get("NCCL_BUFFSIZE")
    if buff is not None:
        size = _parse_int(buff)
        if size is None:
            warn("NCCL_BUFFSIZE", "warning", "not an integer byte count: NCCL ignores it")
        elif size < 2**20:
            warn(
                "NCCL_BUFFSIZE",
                "warning",
                f"{size} B is tiny (default {_DEFAULT_BUFFSIZE} B): large messages are chopped into many small steps",
            )
    channel_var = "NCCL_MAX_NCHANNELS" if "NCCL_MAX_NCHANNELS" in value else "NCCL_MAX_NRINGS"  # older name
    channels = _parse_int(value.get(channel_var, ""))
    if channels is not None and channels < 4:
        warn(channel_var, "warning", f"{channels} channel(s) cannot fill NVLink or several NICs (H100 uses 16-32)")
    timeout = _parse_int(value.get("NCCL_IB_TIMEOUT", ""))
    if timeout is not None and timeout < 14:
        warn(
            "NCCL_IB_TIMEOUT",
            "warning",
            f"{timeout} (4.096us * 2^{timeout}) is short for large fabrics: spurious 'retry exceeded' errors",
        )


def _check_ifname(value: dict[str, str], multi_node: bool | None, warn: _Warn) -> None:
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        spec = value.get(var)
        if spec is None or spec.startswith("^"):  # an exclusion list never *selects* lo or docker0
            continue
        names = [n.lstrip("=") for n in spec.split(",") if n]
        local = [n for n in names if n.startswith(_LOCAL_ONLY_IFACES)]
        if local and len(local) == len(names):
            severity = "error" if multi_node else "warning"
            scope = "this job spans nodes" if multi_node else "fine on one node only"
            warn(
                var, severity, f"{', '.join(local)} cannot reach other nodes ({scope}): bootstrap or traffic will hang"
            )


def _check_ib_hca(value: dict[str, str], ib_devices: list[str] | None, warn: _Warn) -> None:
    spec = value.get("NCCL_IB_HCA")
    if spec is None:
        return
    if not ib_devices:
        warn("NCCL_IB_HCA", "warning", "set, but no RDMA device is visible here: NCCL will use sockets")
        return
    selected, unknown = ib_hca_selection(spec, ib_devices)
    present = ", ".join(ib_devices)
    if not selected:
        warn("NCCL_IB_HCA", "error", f"selects none of the present devices ({present}): NCCL falls back to sockets")
    elif unknown and not spec.startswith("^"):
        warn("NCCL_IB_HCA", "warning", f"names {', '.join(unknown)}, not present (present: {present})")


def _parse_int(text: str) -> int | None:
    try:
        return int(text.strip(), 0)
    except (ValueError, AttributeError):
        return None
