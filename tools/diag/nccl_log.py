"""Parse an NCCL_DEBUG=INFO log and say, in plain words, which transports NCCL picked and what to change.

    bytes -> lines (undecodable / binary lines counted, never fatal) -> NCCL prefix `host:pid:tid [dev] NCCL INFO`
          -> message patterns (version, NET/IB|Socket "Using", "Channel .. via ..", NVLS, CollNet, rings, env echo)
          -> LogReport -> diagnose() -> findings ("problem" makes `nccl_diag.py log` exit 1)

Formats are those NCCL's sources print (init.cc, transport/{p2p,shm,net,coll_net,nvls}.cc, net_ib, net_socket),
old (`Channel 00 : 0[0] -> 1[1] via P2P/IPC`) and new (`Channel 00/0 : ...`, `[send] via NET/IB/0/GDRDMA`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# `host:pid:tid [cudaDev] [file.cc:line ]NCCL INFO msg`; anything may precede it (timestamps, logger prefixes).
_PREFIX = re.compile(
    r"(?:^|\s)(?P<host>[^\s:\[\]]+):\d+:\d+ \[\d+\] (?:\S+ )?NCCL (?P<level>INFO|WARN|TRACE)\b ?(?P<msg>.*)"
)
_BARE = re.compile(r"NCCL (?P<level>INFO|WARN|TRACE)\b ?(?P<msg>.*)")
_VERSION = re.compile(r"NCCL version (\S+)")
_CONN = re.compile(
    r"^Channel (?P<ch>\d+)(?:/(?P<ci>\d+))? : (?P<src>\d+)\[[0-9a-fA-Fx]+\] -> (?P<dst>\d+)\[[0-9a-fA-Fx]+\]"
    r"(?: \[(?P<dir>send|receive)\])? via (?P<via>.+?)\s*$"
)
_RING = re.compile(r"^Channel (?P<ch>\d+)/(?P<n>\d+) :(?P<ranks>(?:\s+\d+)+)\s*$")
_COLLNET = re.compile(r"^CollNet (?P<ch>\d+)/\d+ : \d+ \[(?:send|receive)\] via (?P<via>COLLNET/\S+)")
_TRANSPORT = re.compile(
    r"^(?:P2P/(?:IPC|CUMEM|MNNVL|direct pointer|indirect/\d+\[[0-9a-fA-Fx]+\])(?:/read)?(?:/CE)?"
    r"|SHM(?:/[A-Za-z]+)*"
    r"|NET/(?P<net>[^/]+)/\d+(?:\(\d+\))?(?P<gdr>/GDRDMA)?(?:\(PCI\))?(?:/Shared)?)$"
)
_NET_USING = re.compile(r"^NET/(?P<net>[^\s/]+) ?: Using(?P<rest>.*)$")
_IB_DEV = re.compile(r"\[\d+\](?P<dev>[^\s:\[\]]+:\d+/[\w/]+)")
_SOCK_DEV = re.compile(r"\[\d+\](?P<iface>[^\s:\[\]]+):")
_OOB = re.compile(r"OOB (?P<iface>[^\s:]+)")
_USING_NET = re.compile(r"^Using network (?P<name>.+?)\s*$")
_ENV = re.compile(r"^(?P<var>(?:NCCL|GLOO)_\w+) set by environment to (?P<val>.*?)\.?\s*$")
_GDR_HCA = re.compile(r"GPU Direct RDMA (?P<state>Enabled|Disabled) for (?:HCA \d+ '(?P<hca>[^']+)'|(?P<other>.+))")
_RINGS_GDR = re.compile(r"Connected all rings(?:, use ring PXN \d+ GDR (?P<gdr>\d+))?")
_NVLS = re.compile(r"NVLS multicast support is (?P<not>not )?available on dev (?P<dev>\d+)")
_SUMMARY = re.compile(r"(?P<coll>\d+) coll channels, (?P<collnet>\d+) collnet channels, (?P<nvls>\d+) nvls channels")
_NRANKS_NEW = re.compile(r"nRanks (?P<n>\d+) nNodes (?P<nodes>\d+)")
_NRANKS_OLD = re.compile(r"\brank \d+ nranks (?P<n>\d+)\b")
_TREES = re.compile(r"^Trees \[\d+\]")
_PLUGIN = re.compile(r"(?:Loaded (?:net|collnet) plugin (?P<a>.+?)\s*$|P2P plugin (?P<b>\S+))")
_FATAL_WARN = re.compile(r"fail|error|timeout|timed out|abort|unhandled|completion|unreachable|refused|mismatch", re.I)
_MAX_SAMPLES = 8


@dataclass
class Finding:
    """One diagnosis line; severity "problem" (exit 1), "note" or "ok"."""

    severity: str
    message: str


@dataclass
class LogReport:
    """Everything `log` extracts from one NCCL log, plus the diagnosis."""

    path: str = ""
    total_lines: int = 0
    nccl_lines: int = 0
    other_lines: int = 0
    unreadable_lines: int = 0
    truncated_lines: int = 0
    versions: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    nranks: int | None = None
    nnodes: int | None = None
    networks: list[str] = field(default_factory=list)
    ib_devices: list[str] = field(default_factory=list)
    ib_no_device: bool = False
    socket_ifaces: list[str] = field(default_factory=list)
    oob_ifaces: list[str] = field(default_factory=list)
    plugins: list[str] = field(default_factory=list)
    env_settings: dict[str, str] = field(default_factory=dict)
    gdr_disabled_hcas: list[str] = field(default_factory=list)
    rings_gdr_flags: list[int] = field(default_factory=list)
    transport_counts: dict[str, int] = field(default_factory=dict)
    transport_pairs: dict[str, list[str]] = field(default_factory=dict)
    net_lines_without_gdr: dict[str, int] = field(default_factory=dict)
    nvls_available_devs: int = 0
    nvls_unavailable_devs: int = 0
    nvls_channels: int | None = None
    collnet_channels: int | None = None
    collnet_transports: dict[str, int] = field(default_factory=dict)
    rings: dict[int, list[int]] = field(default_factory=dict)
    tree_lines: int = 0
    warn_count: int = 0
    warn_samples: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def has_problem(self) -> bool:
        """True when any finding is a problem (the CLI's exit status 1)."""
        return any(f.severity == "problem" for f in self.findings)


def transport_kind(via: str) -> str | None:
    """Normalise the text after `via` to a transport kind ("P2P/CUMEM", "NET/IB/GDRDMA", ...); None if not one."""
    match = _TRANSPORT.match(via)
    if match is None:
        return None
    if via.startswith("P2P/"):
        return "P2P/" + via[4:].split("/")[0].split("[")[0]
    if via.startswith("SHM"):
        return "SHM"
    net = match.group("net")
    # IB, IBext (the SHARP/RDMA plugin) and IBext_v8 are all verbs-based InfiniBand/RoCE.
    name = "IB" if net.lower().startswith("ib") else net
    return f"NET/{name}" + ("/GDRDMA" if match.group("gdr") else "")


def _decode(raw: bytes | str) -> str | None:
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    text = text.rstrip("\r\n")
    if "\ufffd" in text or any(ord(c) < 32 and c != "\t" or ord(c) == 127 for c in text):
        return None
    return text


def parse_lines(lines: Iterable[bytes | str], path: str = "") -> LogReport:
    """Parse log lines (bytes or text) into a diagnosed LogReport; never raises on a malformed line."""
    r = LogReport(path=path)
    counts: Counter[str] = Counter()
    pairs: dict[str, set[str]] = {}
    nvls: dict[tuple[str, int], bool] = {}
    hosts: set[str] = set()
    for raw in lines:
        r.total_lines += 1
        text = _decode(raw)
        if text is None:
            r.unreadable_lines += 1
            continue
        match = _PREFIX.search(text) or _BARE.search(text)
        if match is None:
            version = _VERSION.search(text)  # NCCL prints its version line without the usual prefix
            if version:
                r.nccl_lines += 1
                _add(r.versions, version.group(1))
            else:
                r.other_lines += 1
            continue
        r.nccl_lines += 1
        host = match.groupdict().get("host")
        if host:
            hosts.add(host)
        msg = match.group("msg").strip()
        if match.group("level") == "WARN":
            r.warn_count += 1
            if len(r.warn_samples) < _MAX_SAMPLES:
                r.warn_samples.append(msg)
            continue
        _parse_message(r, msg, host or "", counts, pairs, nvls)
    r.hosts = sorted(hosts)
    r.transport_counts = dict(sorted(counts.items()))
    r.transport_pairs = {k: sorted(v, key=_pair_key)[:_MAX_SAMPLES] for k, v in sorted(pairs.items())}
    r.nvls_available_devs = sum(1 for ok in nvls.values() if ok)
    r.nvls_unavailable_devs = sum(1 for ok in nvls.values() if not ok)
    r.findings = diagnose(r)
    return r


def _pair_key(pair: str) -> tuple[int, ...]:
    return tuple(int(x) for x in pair.split("->"))


def _add(items: list[str], value: str) -> None:
    if value not in items:
        items.append(value)


def _parse_message(
    r: LogReport,
    msg: str,
    host: str,
    counts: Counter[str],
    pairs: dict[str, set[str]],
    nvls: dict[tuple[str, int], bool],
) -> None:
    if (m := _CONN.match(msg)) is not None:
        kind = transport_kind(m.group("via"))
        if kind is None:  # "via NET/I" or "via P2P/IP": a line cut short
            r.truncated_lines += 1
            return
        counts[kind] += 1
        pairs.setdefault(kind, set()).add(f"{m.group('src')}->{m.group('dst')}")
        if kind.startswith("NET/") and not kind.endswith("/GDRDMA") and kind != "NET/Socket":
            side = m.group("dir") or "unknown"
            r.net_lines_without_gdr[side] = r.net_lines_without_gdr.get(side, 0) + 1
        return
    if (m := _RING.match(msg)) is not None:
        r.rings.setdefault(int(m.group("ch")), [int(x) for x in m.group("ranks").split()])
        return
    if msg.startswith("Channel "):  # neither a connection nor a ring line: cut short mid-line
        r.truncated_lines += 1
        return
    if (m := _COLLNET.match(msg)) is not None:
        key = "COLLNET" + ("/GDRDMA" if "/GDRDMA" in m.group("via") else "")
        r.collnet_transports[key] = r.collnet_transports.get(key, 0) + 1
        return
    if (m := _VERSION.search(msg)) is not None:
        _add(r.versions, m.group(1))
    elif (m := _NET_USING.match(msg)) is not None and m.group("net") != "Plugin":
        rest = m.group("rest")
        if m.group("net") == "Socket":
            for iface in _SOCK_DEV.findall(rest.split("; OOB")[0]):
                _add(r.socket_ifaces, iface)
        else:
            for dev in _IB_DEV.findall(rest):
                _add(r.ib_devices, dev)
        if (oob := _OOB.search(rest)) is not None:
            _add(r.oob_ifaces, oob.group("iface"))
    elif "NET/IB : No device found" in msg:
        r.ib_no_device = True
    elif (m := _USING_NET.match(msg)) is not None:
        _add(r.networks, m.group("name"))
    elif (m := _ENV.match(msg)) is not None:
        r.env_settings[m.group("var")] = m.group("val")
    elif (m := _GDR_HCA.search(msg)) is not None:
        if m.group("state") == "Disabled":
            _add(r.gdr_disabled_hcas, m.group("hca") or m.group("other"))
    elif (m := _RINGS_GDR.search(msg)) is not None:
        if m.group("gdr") is not None:
            r.rings_gdr_flags.append(int(m.group("gdr")))
    elif (m := _NVLS.search(msg)) is not None:
        nvls[(host, int(m.group("dev")))] = m.group("not") is None
    elif (m := _SUMMARY.search(msg)) is not None:
        r.nvls_channels = max(r.nvls_channels or 0, int(m.group("nvls")))
        r.collnet_channels = max(r.collnet_channels or 0, int(m.group("collnet")))
    elif (m := _NRANKS_NEW.search(msg)) is not None:
        r.nranks, r.nnodes = int(m.group("n")), max(r.nnodes or 0, int(m.group("nodes")))
    elif (m := _NRANKS_OLD.search(msg)) is not None:
        r.nranks = int(m.group("n"))
    elif _TREES.match(msg):
        r.tree_lines += 1
    elif (m := _PLUGIN.search(msg)) is not None:
        _add(r.plugins, m.group("a") or m.group("b"))


def parse_file(path: str | Path) -> LogReport:
    """Parse the NCCL log at `path`; raises OSError when the file cannot be opened or read."""
    with open(path, "rb") as fh:
        return parse_lines(fh, str(path))


def diagnose(r: LogReport) -> list[Finding]:
    """Plain-language findings for a parsed log; each problem names the setting to look at."""
    out: list[Finding] = []
    if r.nccl_lines == 0:
        return [Finding("problem", "no NCCL log lines found: rerun with NCCL_DEBUG=INFO (NCCL_DEBUG_SUBSYS=INIT,NET)")]
    if len(r.versions) > 1:
        out.append(Finding("problem", f"ranks load different NCCL versions ({', '.join(r.versions)}): use one build"))
    env, counts = r.env_settings, r.transport_counts
    ib = counts.get("NET/IB", 0) + counts.get("NET/IB/GDRDMA", 0)
    socket = counts.get("NET/Socket", 0)
    multi_node = (r.nnodes or 0) > 1 or len(r.hosts) > 1
    if socket or (multi_node and not ib and "Socket" in r.networks):
        hints = [f"{v}={env[v]} in the log" for v in ("NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_NET") if v in env]
        if r.ib_no_device:
            hints.append("NCCL printed 'NET/IB : No device found'")
        out.append(
            Finding(
                "problem",
                f"inter-node traffic uses NET/Socket over {', '.join(r.socket_ifaces) or 'a TCP interface'} "
                f"({socket} connection lines): IB was not found/used — check NCCL_IB_HCA / NCCL_IB_DISABLE / that "
                "the RDMA devices (/dev/infiniband, /sys/class/infiniband) are visible in the container"
                + (f" [{'; '.join(hints)}]" if hints else ""),
            )
        )
    _diagnose_gdr(r, out, ib)
    _diagnose_intra(r, out)
    if r.nvls_available_devs:
        chans = f", {r.nvls_channels} nvls channels" if r.nvls_channels is not None else ""
        out.append(
            Finding("ok", f"NVLS (NVLink SHARP) multicast available on {r.nvls_available_devs} device(s){chans}")
        )
        if r.nvls_channels == 0:
            out.append(Finding("note", "NVLS is supported but 0 nvls channels were built: is NCCL_NVLS_ENABLE=0 set?"))
    elif r.nvls_unavailable_devs:
        out.append(
            Finding(
                "note",
                f"NVLS multicast not available on {r.nvls_unavailable_devs} device(s): no NVLink SHARP (needs "
                "NVSwitch + fabric manager, CUDA >= 12.1, NCCL_NVLS_ENABLE not 0); expected on PCIe or pre-Hopper",
            )
        )
    if r.collnet_channels or r.collnet_transports:
        out.append(
            Finding("ok", f"CollNet/SHARP in use: {r.collnet_channels or 0} collnet channels, {r.collnet_transports}")
        )
    if r.warn_count:
        fatal = any(_FATAL_WARN.search(w) for w in r.warn_samples)
        out.append(
            Finding("problem" if fatal else "note", f"{r.warn_count} NCCL WARN line(s), first: {r.warn_samples[0]}")
        )
    if not counts:
        out.append(Finding("note", "no 'Channel .. via ..' lines: keep INIT in NCCL_DEBUG_SUBSYS to see transports"))
    if r.unreadable_lines or r.truncated_lines:
        out.append(
            Finding("note", f"skipped {r.unreadable_lines} unreadable and {r.truncated_lines} truncated line(s)")
        )
    return out


def _diagnose_gdr(r: LogReport, out: list[Finding], ib: int) -> None:
    if not ib:
        return
    without = r.net_lines_without_gdr
    recv_or_unknown = without.get("receive", 0) + without.get("unknown", 0)
    level = r.env_settings.get("NCCL_NET_GDR_LEVEL")
    hcas = f"; GDR disabled for HCA {', '.join(r.gdr_disabled_hcas)}" if r.gdr_disabled_hcas else ""
    if recv_or_unknown:
        out.append(
            Finding(
                "problem",
                f"NET/IB without GDRDMA on {sum(without.values())} of {ib} connection lines: GPUDirect RDMA is off "
                "— load nvidia_peermem (or use DMA-BUF), check NCCL_NET_GDR_LEVEL"
                + (f" (log: {level})" if level else "")
                + f" and that GPU and NIC share a PCIe switch; traffic bounces through host memory{hcas}",
            )
        )
    elif without.get("send"):
        out.append(
            Finding(
                "note", f"{without['send']} send-side NET/IB lines without GDRDMA: GDR read off (NCCL_NET_GDR_READ)"
            )
        )
    else:
        devs = f" over {', '.join(r.ib_devices)}" if r.ib_devices else ""
        out.append(Finding("ok", f"inter-node NET/IB with GDRDMA on all {ib} connection lines{devs}"))


def _diagnose_intra(r: LogReport, out: list[Finding]) -> None:
    counts = r.transport_counts
    p2p = {k: v for k, v in counts.items() if k.startswith("P2P/")}
    shm = counts.get("SHM", 0)
    if shm:
        hints = [
            f"{v}={r.env_settings[v]} in the log" for v in ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL") if v in r.env_settings
        ]
        others = f" (P2P on {sum(p2p.values())} others)" if p2p else ""
        out.append(
            Finding(
                "problem",
                f"P2P disabled, intra-node via SHM on {shm} connection lines{others} — check NCCL_P2P_DISABLE / "
                "NCCL_P2P_LEVEL, PCIe ACS and the IOMMU (they block GPU peer access); NVLink systems never need SHM"
                + (f" [{'; '.join(hints)}]" if hints else ""),
            )
        )
    elif p2p:
        out.append(Finding("ok", "intra-node via " + ", ".join(f"{k} ({v})" for k, v in p2p.items())))
    if counts.get("P2P/indirect"):
        out.append(Finding("note", "P2P/indirect: some pairs relay through a third GPU (no direct P2P between them)"))
