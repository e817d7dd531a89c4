"""Hardware probes for `nccl_diag.py env`: GPUs and NVLink through nvidia-ml-py, IB ports from sysfs, and the
GPUDirect RDMA kernel module.

Every probe returns a report with `status` ("present" / "absent" / "loaded") and a `reason`, never raises on missing
hardware: a doctor that crashes on the broken machine is no doctor. The sysfs and procfs roots are parameters so
tests can build a fake tree with the kernel's real file formats.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# nvidia-smi's legend for `topo -m`, keyed by NVML's common-ancestor levels (nvml.h nvmlGpuTopologyLevel_t).
_TOPO_LABELS = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


@dataclass
class NvLinkState:
    """One NVLink of a GPU."""

    link: int
    active: bool
    version: int | None = None
    remote_pci: str | None = None


@dataclass
class GpuInfo:
    """One GPU as NVML sees it."""

    index: int
    name: str
    pci_bus_id: str | None
    memory_total_mib: int | None
    nvlinks: list[NvLinkState] = field(default_factory=list)

    @property
    def active_nvlinks(self) -> int:
        """Number of NVLinks in the active state."""
        return sum(1 for link in self.nvlinks if link.active)


@dataclass
class GpuReport:
    """GPUs, driver and the GPU-pair topology matrix (nvidia-smi's labels: NV#, PIX, PXB, PHB, NODE, SYS)."""

    status: str
    reason: str = ""
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    gpus: list[GpuInfo] = field(default_factory=list)
    topology: list[list[str]] = field(default_factory=list)
    nvidia_smi_topo: str | None = None
    nvidia_smi_reason: str = ""


@dataclass
class IbPort:
    """One port of an RDMA device, read from /sys/class/infiniband/<dev>/ports/<n>/."""

    port: int
    state: str
    phys_state: str
    rate: str
    link_layer: str
    rate_gbps: float | None

    @property
    def active(self) -> bool:
        """True when the port is ACTIVE and its physical link is up."""
        return self.state == "ACTIVE" and self.phys_state == "LinkUp"


@dataclass
class IbDevice:
    """One RDMA device (an HCA such as mlx5_0)."""

    name: str
    hca_type: str | None
    fw_ver: str | None
    pci_addr: str | None
    numa_node: int | None
    ports: list[IbPort] = field(default_factory=list)


@dataclass
class IbReport:
    """RDMA devices under <sysfs>/class/infiniband."""

    status: str
    reason: str = ""
    devices: list[IbDevice] = field(default_factory=list)

    def active_ib_ports(self) -> list[tuple[str, IbPort]]:
        """(device, port) for every ACTIVE port whose link layer is InfiniBand or Ethernet (RoCE)."""
        return [(dev.name, port) for dev in self.devices for port in dev.ports if port.active]


@dataclass
class GdrReport:
    """Whether a GPUDirect RDMA peer-memory module is loaded."""

    status: str
    module: str | None = None
    evidence: list[str] = field(default_factory=list)
    reason: str = ""


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def _sysfs_enum(text: str | None) -> str:
    # sysfs writes enums as "4: ACTIVE" / "5: LinkUp": keep the name, which is what people grep for.
    if not text:
        return "unknown"
    return text.split(":", 1)[1].strip() if ":" in text else text


def parse_rate_gbps(rate: str | None) -> float | None:
    """Parse sysfs' `rate` file ("400 Gb/sec (4X NDR)") to Gb/s."""
    match = re.match(r"\s*([\d.]+)\s*Gb/sec", rate or "")
    return float(match.group(1)) if match else None


def probe_ib(sysfs_root: str | os.PathLike = "/sys") -> IbReport:
    """Read every RDMA device and port from `<sysfs_root>/class/infiniband`."""
    base = Path(sysfs_root) / "class" / "infiniband"
    if not base.is_dir():
        return IbReport("absent", f"{base} does not exist: no RDMA driver loaded, or not visible in this container")
    try:
        names = sorted(p.name for p in base.iterdir())
    except OSError as exc:
        return IbReport("absent", f"cannot list {base}: {exc}")
    if not names:
        return IbReport("absent", f"{base} is empty (no RDMA device)")
    devices = []
    for name in names:
        dev_dir = base / name
        pci_addr = None
        device_link = dev_dir / "device"
        if device_link.exists():
            pci_addr = Path(os.path.realpath(device_link)).name
        numa = _read(device_link / "numa_node")
        ports = []
        ports_dir = dev_dir / "ports"
        port_names = sorted((p.name for p in ports_dir.iterdir()), key=_int_or_zero) if ports_dir.is_dir() else []
        for port_name in port_names:
            pdir = ports_dir / port_name
            rate = _read(pdir / "rate") or "unknown"
            ports.append(
                IbPort(
                    port=_int_or_zero(port_name),
                    state=_sysfs_enum(_read(pdir / "state")),
                    phys_state=_sysfs_enum(_read(pdir / "phys_state")),
                    rate=rate,
                    link_layer=_read(pdir / "link_layer") or "unknown",
                    rate_gbps=parse_rate_gbps(rate),
                )
            )
        devices.append(
            IbDevice(
                name=name,
                hca_type=_read(dev_dir / "hca_type"),
                fw_ver=_read(dev_dir / "fw_ver"),
                pci_addr=pci_addr,
                numa_node=int(numa) if numa and numa.lstrip("-").isdigit() else None,
                ports=ports,
            )
        )
    return IbReport("present", "", devices)


def _int_or_zero(text: str) -> int:
    return int(text) if text.isdigit() else 0


def probe_gdr(sysfs_root: str | os.PathLike = "/sys", proc_root: str | os.PathLike = "/proc") -> GdrReport:
    """Look for nvidia_peermem (or the legacy nv_peer_mem) in /proc/modules, /sys/module and memory_peers."""
    sysfs, proc = Path(sysfs_root), Path(proc_root)
    evidence = []
    module = None
    modules_text = _read(proc / "modules") or ""
    loaded = {line.split()[0] for line in modules_text.splitlines() if line.split()}
    for name in ("nvidia_peermem", "nv_peer_mem"):
        if name in loaded:
            evidence.append(f"{proc / 'modules'}: {name}")
            module = module or name
        if (sysfs / "module" / name).is_dir():
            evidence.append(str(sysfs / "module" / name))
            module = module or name
    # MLNX_OFED's peer-memory API lists its clients here; nv_mem is the NVIDIA one.
    peers = sysfs / "kernel" / "mm" / "memory_peers"
    if (peers / "nv_mem").exists():
        evidence.append(str(peers / "nv_mem"))
        module = module or "nv_peer_mem"
    if module:
        return GdrReport("loaded", module, evidence)
    reason = f"nvidia_peermem/nv_peer_mem not in {proc / 'modules'}, {sysfs / 'module'} or {peers}"
    driver = _read(proc / "driver" / "nvidia" / "version") or ""
    if "Open Kernel Module" in driver:
        # NCCL >= 2.19 can do GDR through DMA-BUF with the open kernel module and no peermem module at all.
        reason += "; the open NVIDIA kernel module is loaded, so DMA-BUF GDR may still work (NCCL_DMABUF_ENABLE)"
    return GdrReport("absent", None, [], reason)


def probe_gpus(run_nvidia_smi: bool = True) -> GpuReport:
    """Query GPUs, NVLink state and the GPU-pair topology through nvidia-ml-py; never raises."""
    report = _probe_nvml()
    if run_nvidia_smi:
        report.nvidia_smi_topo, report.nvidia_smi_reason = nvidia_smi_topo()
    return report


def _probe_nvml() -> GpuReport:
    try:
        import pynvml
    except ImportError as exc:
        return GpuReport("absent", f"nvidia-ml-py is not installed ({exc})")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...: all mean "no usable GPU here"
        return GpuReport("absent", f"NVML init failed: {exc}")
    try:
        report = GpuReport("present")
        report.driver_version = _nvml(pynvml.nvmlSystemGetDriverVersion)
        report.cuda_driver_version = _nvml(pynvml.nvmlSystemGetCudaDriverVersion)
        count = _nvml(pynvml.nvmlDeviceGetCount) or 0
        if count == 0:
            return GpuReport("absent", "NVML reports 0 GPUs", report.driver_version)
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        for index, handle in enumerate(handles):
            report.gpus.append(_gpu_info(pynvml, index, handle))
        report.topology = _topology_matrix(pynvml, handles, report.gpus)
        return report
    finally:
        _nvml(pynvml.nvmlShutdown)


def _nvml(fn: Any, *args: Any) -> Any:
    # A feature the GPU or driver lacks raises NVMLError_NotSupported: report it as unknown, keep going.
    try:
        value = fn(*args)
    except Exception:
        return None
    return value.decode() if isinstance(value, bytes) else value


def _gpu_info(pynvml: Any, index: int, handle: Any) -> GpuInfo:
    pci = _nvml(pynvml.nvmlDeviceGetPciInfo, handle)
    mem = _nvml(pynvml.nvmlDeviceGetMemoryInfo, handle)
    bus_id = pci.busId if pci is not None else None
    info = GpuInfo(
        index=index,
        name=str(_nvml(pynvml.nvmlDeviceGetName, handle) or "unknown"),
        pci_bus_id=bus_id.decode() if isinstance(bus_id, bytes) else bus_id,
        memory_total_mib=int(mem.total // 2**20) if mem is not None else None,
    )
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        state = _nvml(pynvml.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:  # links past the GPU's count raise InvalidArgument
            continue
        remote = _nvml(pynvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
        remote_id = remote.busId if remote is not None else None
        info.nvlinks.append(
            NvLinkState(
                link=link,
                active=bool(state == pynvml.NVML_FEATURE_ENABLED),
                version=_nvml(pynvml.nvmlDeviceGetNvLinkVersion, handle, link),
                remote_pci=remote_id.decode() if isinstance(remote_id, bytes) else remote_id,
            )
        )
    return info


def _topology_matrix(pynvml: Any, handles: list[Any], gpus: list[GpuInfo]) -> list[list[str]]:
    matrix = []
    for i, hi in enumerate(handles):
        row = []
        for j, hj in enumerate(handles):
            if i == j:
                row.append("X")
                continue
            nvlink_ok = _nvml(pynvml.nvmlDeviceGetP2PStatus, hi, hj, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            if nvlink_ok == pynvml.NVML_P2P_STATUS_OK:
                # Direct links to the peer when the remote end is that GPU; behind an NVSwitch the remote end is
                # the switch, and nvidia-smi then shows every pair with the GPU's total active link count.
                peer = (gpus[j].pci_bus_id or "").lower()
                direct = sum(1 for ln in gpus[i].nvlinks if ln.active and (ln.remote_pci or "").lower() == peer)
                row.append(f"NV{direct or gpus[i].active_nvlinks}")
                continue
            level = _nvml(pynvml.nvmlDeviceGetTopologyCommonAncestor, hi, hj)
            row.append(_TOPO_LABELS.get(level, "?"))
        matrix.append(row)
    return matrix


def _pci_path(sysfs_root: Path, pci_addr: str) -> list[str] | None:
    # /sys/bus/pci/devices/<addr> links to /sys/devices/pci0000:17/0000:17:01.0/.../<addr>: the PCIe tree path.
    link = sysfs_root / "bus" / "pci" / "devices" / pci_addr.lower()[-12:]  # NVML's 8-digit domain -> sysfs' 4
    if not link.exists():
        return None
    parts = Path(os.path.realpath(link)).parts
    start = next((i for i, p in enumerate(parts) if p.startswith("pci")), None)
    return list(parts[start:]) if start is not None else None


def pci_distance(a: list[str], b: list[str], numa_a: int | None, numa_b: int | None) -> str:
    """nvidia-smi-like label for two PCIe tree paths: PXB (share a switch below the root port; PIX is not told
    apart), PHB (meet at the host bridge), NODE (other root complex, same NUMA node), SYS (across sockets)."""
    if a[0] != b[0]:
        return "NODE" if numa_a is not None and numa_a == numa_b else "SYS"
    common = len(os.path.commonprefix([a, b]))
    return "PXB" if common >= 2 else "PHB"


def gpu_nic_matrix(gpus: list[GpuInfo], ib: IbReport, sysfs_root: str | os.PathLike = "/sys") -> dict[str, dict]:
    """GPU -> {NIC: label} from sysfs PCIe paths. NCCL uses GPUDirect RDMA by default only up to PXB, so a PHB or
    worse pairing of a GPU with its nearest NIC explains missing GDRDMA. Empty when either side is absent."""
    root = Path(sysfs_root)
    matrix: dict[str, dict] = {}
    for gpu in gpus:
        gpath = _pci_path(root, gpu.pci_bus_id) if gpu.pci_bus_id else None
        if gpath is None:
            continue
        gnuma = _read(root / "bus" / "pci" / "devices" / gpu.pci_bus_id.lower()[-12:] / "numa_node")
        row = {}
        for dev in ib.devices:
            npath = _pci_path(root, dev.pci_addr) if dev.pci_addr else None
            if npath is not None:
                numa = int(gnuma) if gnuma and gnuma.lstrip("-").isdigit() else None
                row[dev.name] = pci_distance(gpath, npath, numa, dev.numa_node)
        if row:
            matrix[f"GPU{gpu.index}"] = row
    return matrix


def hardware_findings(gpus: GpuReport, ib: IbReport, gdr: GdrReport) -> list[str]:
    """Plain warnings about the hardware itself: links down, and IB without a GPUDirect RDMA module."""
    out = []
    for gpu in gpus.gpus:
        down = [ln.link for ln in gpu.nvlinks if not ln.active]
        if down and gpu.active_nvlinks:  # some links up, some down: a degraded NVLink, not a PCIe-only GPU
            out.append(f"GPU{gpu.index} NVLink(s) {down} inactive while {gpu.active_nvlinks} are up: degraded NVLink")
    for dev in ib.devices:
        for port in dev.ports:
            if not port.active:
                out.append(f"{dev.name} port {port.port} is {port.state}/{port.phys_state}: NCCL will skip it")
    if ib.status == "present" and gpus.status == "present" and gdr.status != "loaded":
        out.append("RDMA devices and GPUs present but no peermem module: NET/IB may run without GDRDMA")
    return out


def nvidia_smi_topo(timeout_s: float = 20.0) -> tuple[str | None, str]:
    """Run `nvidia-smi topo -m` (it also shows the GPU/NIC matrix NVML lacks); (output, reason when absent)."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None, "nvidia-smi not on PATH"
    try:
        proc = subprocess.run([binary, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"nvidia-smi topo -m failed: {exc}"
    if proc.returncode != 0:
        return None, f"nvidia-smi topo -m exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:200]}"
    return proc.stdout.rstrip(), ""
