"""Tests of tools/nccl_diag.py (the NCCL/GDR doctor): log parsing on fixtures in NCCL's real line formats, the env
probes on this machine and on a fake sysfs tree, risky-variable rules, the gloo sweep through a real subprocess,
the verdict table and CLI errors. Runs in well under a minute on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "nccl_diag.py"
LOGS = REPO / "tests" / "fixtures" / "nccl_logs"
sys.path.insert(0, str(REPO / "tools"))

from diag import env_probe, env_rules, expectations, nccl_log  # noqa: E402


def run_tool(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real script as a user would, from the repo root."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "GLOO_"))}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(TOOL), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env
    )


def problems(report: nccl_log.LogReport) -> list[str]:
    return [f.message for f in report.findings if f.severity == "problem"]


# --- log ---------------------------------------------------------------------------------------------------------


def test_log_healthy_ib_gdr_nvls_reports_transports_and_exits_0() -> None:
    proc = run_tool("log", str(LOGS / "healthy_ib_gdr_nvls.log"), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["versions"] == ["2.21.5+cuda12.4"]
    assert report["nnodes"] == 2 and report["nranks"] == 16
    assert report["networks"] == ["IB"]
    assert report["ib_devices"] == ["mlx5_0:1/IB", "mlx5_3:1/IB", "mlx5_4:1/IB", "mlx5_5:1/IB"]
    # 4 channels x 2 node boundaries, printed on both the send and the receive side
    assert report["transport_counts"] == {"NET/IB/GDRDMA": 16, "P2P/CUMEM": 56}
    assert report["nvls_available_devs"] == 16 and report["nvls_channels"] == 16
    assert report["rings"]["0"] == list(range(16))
    assert not report["has_problem"]


def test_log_socket_fallback_names_the_ib_settings() -> None:
    proc = run_tool("log", str(LOGS / "socket_fallback.log"))
    assert proc.returncode == 1
    report = nccl_log.parse_file(LOGS / "socket_fallback.log")
    assert report.transport_counts["NET/Socket"] == 8
    assert report.socket_ifaces == ["eth0"] and report.ib_no_device
    (msg,) = [m for m in problems(report) if "NET/Socket" in m]
    assert "NCCL_IB_HCA" in msg and "NCCL_IB_DISABLE" in msg and "eth0" in msg and "container" in msg
    assert "inter-node traffic uses NET/Socket" in proc.stdout


def test_log_ib_without_gdrdma_says_load_peermem_and_check_gdr_level() -> None:
    report = nccl_log.parse_file(LOGS / "ib_no_gdr.log")
    assert report.transport_counts == {"NET/IB": 8, "P2P/CUMEM": 4}
    assert report.gdr_disabled_hcas == ["mlx5_0"] and report.rings_gdr_flags == [0] * 4
    (msg,) = problems(report)
    assert "GPUDirect RDMA is off" in msg and "nvidia_peermem" in msg and "NCCL_NET_GDR_LEVEL (log: LOC)" in msg
    assert run_tool("log", str(LOGS / "ib_no_gdr.log")).returncode == 1


def test_log_p2p_disabled_goes_through_shm_in_the_old_line_format() -> None:
    report = nccl_log.parse_file(LOGS / "p2p_disabled_shm.log")
    # NCCL 2.10 prints "Channel 00 : 0[1b000] -> 1[3b000] via SHM/direct/direct" (no /connIndex)
    assert report.transport_counts == {"SHM": 8}
    assert report.env_settings["NCCL_P2P_DISABLE"] == "1"
    (msg,) = problems(report)
    assert msg.startswith("P2P disabled, intra-node via SHM") and "NCCL_P2P_DISABLE=1 in the log" in msg
    assert "ACS" in msg and "IOMMU" in msg


def test_log_junk_binary_and_truncated_lines_are_counted_not_fatal() -> None:
    proc = run_tool("log", str(LOGS / "junk_binary_truncated.log"), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["unreadable_lines"] == 3  # NUL/ELF bytes, 0xdeadbeef run, latin-1 bytes in a channel line
    assert report["truncated_lines"] == 3  # "via P2P/CU", "-> 0[" and the unterminated last line
    assert report["other_lines"] == 2
    assert report["transport_counts"] == {"P2P/CUMEM": 8}
    assert report["nvls_available_devs"] == 2  # one of them behind a Python-logging prefix
    assert report["env_settings"] == {"NCCL_DEBUG_SUBSYS": "INIT,P2P,NET", "NCCL_IB_TIMEOUT": "22"}


def test_log_collnet_sharp_plugin_version_mismatch_and_warn() -> None:
    report = nccl_log.parse_file(LOGS / "collnet_sharp_warn.log")
    assert report.transport_counts == {"NET/IB/GDRDMA": 6}  # the IBext_v8 plugin is verbs IB
    assert report.collnet_transports == {"COLLNET/GDRDMA": 4} and report.collnet_channels == 2
    assert report.ib_devices == ["ibp0:1/IB/SHARP", "ibp1:1/IB/SHARP"]
    msgs = problems(report)
    assert any("different NCCL versions" in m for m in msgs)
    assert any("NCCL WARN" in m and "completion" in m for m in msgs)


@pytest.mark.parametrize(
    ("via", "kind"),
    [
        ("P2P/IPC/read", "P2P/IPC"),
        ("P2P/CUMEM/read/CE", "P2P/CUMEM"),
        ("P2P/direct pointer", "P2P/direct pointer"),
        ("P2P/indirect/2[2]", "P2P/indirect"),
        ("SHM/direct/direct", "SHM"),
        ("NET/IB/3/GDRDMA", "NET/IB/GDRDMA"),
        ("NET/IB/0(1)/GDRDMA(PCI)/Shared", "NET/IB/GDRDMA"),
        ("NET/IBext_v8/2", "NET/IB"),
        ("NET/Socket/0", "NET/Socket"),
        ("NET/I", None),
        ("P2P/IP", None),
    ],
)
def test_transport_kind_normalises_nccl_via_strings(via: str, kind: str | None) -> None:
    assert nccl_log.transport_kind(via) == kind


def test_log_without_nccl_lines_is_a_problem() -> None:
    report = nccl_log.parse_lines([b"epoch 1 loss 2.0", b"\xff\xfe\x00", "plain text"])
    assert report.nccl_lines == 0 and report.unreadable_lines == 1
    assert problems(report) and "NCCL_DEBUG=INFO" in problems(report)[0]


def test_log_unreadable_file_exits_2_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.log"
    proc = run_tool("log", str(missing))
    assert proc.returncode == 2
    assert str(missing) in proc.stderr and "No such file" in proc.stderr


# --- env ---------------------------------------------------------------------------------------------------------


def test_env_on_this_machine_exits_0_and_reports_absent_hardware() -> None:
    proc = run_tool("env", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    if not Path("/dev/nvidiactl").exists():
        assert report["gpus"]["status"] == "absent" and report["gpus"]["reason"]
    if not Path("/sys/class/infiniband").exists():
        assert report["ib"]["status"] == "absent" and "infiniband" in report["ib"]["reason"]
    text = run_tool("env")
    assert text.returncode == 0 and "GPUs:" in text.stdout and "InfiniBand/RDMA:" in text.stdout


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def fake_sysfs(root: Path) -> Path:
    """Two ConnectX-7 HCAs in sysfs' real layout: mlx5_0 (port 1 up at NDR) behind the same PCIe switch as a GPU,
    mlx5_1 (port 1 down) on the other socket's root complex."""
    pci = {
        "mlx5_0": "devices/pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0",
        "mlx5_1": "devices/pci0000:a0/0000:a0:01.0/0000:a1:00.0",
        "gpu0": "devices/pci0000:17/0000:17:01.0/0000:18:00.0/0000:1a:00.0",
    }
    for name, path in pci.items():
        _write(root / path / "numa_node", "1" if name == "mlx5_1" else "0")
        link = root / "bus" / "pci" / "devices" / Path(path).name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(root / path)
    for name, state, phys in (("mlx5_0", "4: ACTIVE", "5: LinkUp"), ("mlx5_1", "1: DOWN", "3: Disabled")):
        dev = root / "class" / "infiniband" / name
        _write(dev / "hca_type", "MT4129")
        _write(dev / "fw_ver", "28.39.1002")
        (dev / "device").symlink_to(root / pci[name])
        port = dev / "ports" / "1"
        _write(port / "state", state)
        _write(port / "phys_state", phys)
        _write(port / "rate", "400 Gb/sec (4X NDR)")
        _write(port / "link_layer", "InfiniBand")
    return root


def test_fake_sysfs_two_mlx5_devices_one_port_down(tmp_path: Path) -> None:
    report = env_probe.probe_ib(fake_sysfs(tmp_path))
    assert report.status == "present"
    assert [d.name for d in report.devices] == ["mlx5_0", "mlx5_1"]
    up, down = report.devices[0].ports[0], report.devices[1].ports[0]
    assert (up.state, up.phys_state, up.rate_gbps, up.link_layer) == ("ACTIVE", "LinkUp", 400.0, "InfiniBand")
    assert (down.state, down.phys_state, down.active) == ("DOWN", "Disabled", False)
    assert report.devices[1].pci_addr == "0000:a1:00.0" and report.devices[1].numa_node == 1
    assert [name for name, _ in report.active_ib_ports()] == ["mlx5_0"]
    # The CLI reads the same tree and checks NCCL_IB_HCA against the devices it found there.
    proc = run_tool("env", "--json", "--sysfs-root", str(tmp_path), env={"NCCL_IB_HCA": "=mlx5_9"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ib"]["devices"][1]["ports"][0]["state"] == "DOWN"
    assert any(w["var"] == "NCCL_IB_HCA" and w["severity"] == "error" for w in out["warnings"])
    assert out["hardware_warnings"] == ["mlx5_1 port 1 is DOWN/Disabled: NCCL will skip it"]


def test_gpu_nic_pcie_distance_from_fake_sysfs(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path)
    gpu = env_probe.GpuInfo(index=0, name="NVIDIA H100 80GB HBM3", pci_bus_id="00000000:1A:00.0", memory_total_mib=0)
    matrix = env_probe.gpu_nic_matrix([gpu], env_probe.probe_ib(root), root)
    # same PCIe switch -> PXB (GDR by default); other socket's root complex -> SYS
    assert matrix == {"GPU0": {"mlx5_0": "PXB", "mlx5_1": "SYS"}}


def test_gdr_probe_finds_nvidia_peermem_in_proc_modules(tmp_path: Path) -> None:
    _write(tmp_path / "proc" / "modules", "nvidia_peermem 16384 0 - Live 0x0000000000000000 (POE)\nmlx5_ib 1 0 - Live")
    loaded = env_probe.probe_gdr(tmp_path / "sys", tmp_path / "proc")
    assert loaded.status == "loaded" and loaded.module == "nvidia_peermem"
    _write(tmp_path / "proc2" / "modules", "mlx5_ib 1 0 - Live")
    absent = env_probe.probe_gdr(tmp_path / "sys", tmp_path / "proc2")
    assert absent.status == "absent" and "nvidia_peermem" in absent.reason


@pytest.mark.parametrize(
    ("var", "value", "severity"),
    [
        ("NCCL_IB_DISABLE", "1", "error"),
        ("NCCL_P2P_DISABLE", "1", "error"),
        ("NCCL_SHM_DISABLE", "1", "warning"),
        ("NCCL_NET_GDR_LEVEL", "0", "error"),
        ("NCCL_NET_GDR_LEVEL", "LOC", "error"),
        ("NCCL_ALGO", "Ring", "warning"),
        ("NCCL_PROTO", "Simple", "warning"),
        ("NCCL_BUFFSIZE", "65536", "warning"),
        ("NCCL_CROSS_NIC", "1", "warning"),
        ("NCCL_NVLS_ENABLE", "0", "warning"),
        ("NCCL_NET", "Socket", "error"),
    ],
)
def test_risky_env_value_warns_naming_var_value_and_reason(var: str, value: str, severity: str) -> None:
    warnings = env_rules.check_env({"NCCL_DEBUG": "INFO", var: value}, ["mlx5_0"], multi_node=True)
    (w,) = [w for w in warnings if w.var == var]
    assert (w.value, w.severity) == (value, severity) and len(w.reason) > 20
    assert w.format().startswith(f"[{severity}] {var}={value}: ")


def test_safe_env_values_do_not_warn() -> None:
    env = {
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_DISABLE": "0",
        "NCCL_P2P_DISABLE": "0",
        "NCCL_NET_GDR_LEVEL": "PHB",
        "NCCL_SOCKET_IFNAME": "ib0",
        "NCCL_BUFFSIZE": "8388608",
        "NCCL_IB_HCA": "mlx5",
    }
    assert env_rules.check_env(env, ["mlx5_0", "mlx5_1"], multi_node=True) == []
    unset = env_rules.check_env({}, [], multi_node=None)
    assert [(w.var, w.value, w.severity) for w in unset] == [("NCCL_DEBUG", None, "info")]


def test_socket_ifname_lo_or_docker0_is_an_error_only_on_multi_node() -> None:
    for iface in ("lo", "docker0"):
        (multi,) = env_rules.check_env({"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": iface}, None, multi_node=True)
        assert multi.severity == "error" and iface in multi.reason
    (single,) = env_rules.check_env({"NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "lo"}, None, multi_node=False)
    assert single.severity == "warning" and single.var == "GLOO_SOCKET_IFNAME"
    assert env_rules.detect_multi_node({"SLURM_JOB_NUM_NODES": "32"}) is True
    assert env_rules.detect_multi_node({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}) is False


def test_ib_hca_selection_follows_nccl_prefix_exact_and_exclude_syntax() -> None:
    devs = ["mlx5_0", "mlx5_1", "mlx5_10"]
    assert env_rules.ib_hca_selection("mlx5_1", devs) == (["mlx5_1", "mlx5_10"], [])  # prefix match
    assert env_rules.ib_hca_selection("=mlx5_1:1", devs) == (["mlx5_1"], [])
    assert env_rules.ib_hca_selection("^=mlx5_0", devs) == (["mlx5_1", "mlx5_10"], [])
    assert env_rules.ib_hca_selection("mlx5_0,mlx5_7", devs) == (["mlx5_0"], ["mlx5_7"])
    (w,) = env_rules.check_env({"NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5_0,mlx5_7"}, devs)
    assert w.severity == "warning" and "mlx5_7" in w.reason


# --- sweep -------------------------------------------------------------------------------------------------------


def test_sweep_nproc2_gloo_json_rows_have_nccl_tests_busbw(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    proc = run_tool(
        "sweep", "--nproc", "2", "--min-bytes", "8", "--max-bytes", "4K", "--factor", "4",
        "--iters", "3", "--warmup", "1", "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "busbw" in proc.stdout and "no reference for gloo/CPU" in proc.stdout
    result = json.loads(out.read_text())
    assert (result["backend"], result["world_size"], result["nnodes"]) == ("gloo", 2, 1)
    factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0, "all_to_all": 0.5}
    assert {r["op"] for r in result["rows"]} == set(factor)
    for row in result["rows"]:
        assert row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] * factor[row["op"]])
        assert row["algbw_gbs"] == pytest.approx(row["size_bytes"] / 1e9 / (row["time_us"] / 1e6))
        assert row["count"] * 4 == row["size_bytes"] and row["type"] == "float"
    assert [r["size_bytes"] for r in result["rows"] if r["op"] == "all_reduce"] == [8, 32, 128, 512, 2048, 4096]
    assert result["verdict"]["status"] == "no-reference"


def test_busbw_factors_are_nccl_tests_formulas() -> None:
    from diag import sweep

    n = 8
    assert sweep.busbw_factor("all_reduce", n) == pytest.approx(2 * 7 / 8)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert sweep.busbw_factor(op, n) == pytest.approx(7 / 8)
    assert sweep.busbw_factor("broadcast", n) == 1.0
    assert sweep.message_sizes(8, 100, 2) == [8, 16, 32, 64, 100]
    assert sweep.op_elements("all_gather", 40, 4, 4) == 8 and sweep.op_elements("all_reduce", 40, 4, 4) == 10


def _rows(op: str, size: int, busbw: float) -> list[dict]:
    return [{"op": op, "size_bytes": size, "busbw_gbs": busbw}]


def test_verdict_names_the_underperforming_link() -> None:
    gib = 2**30
    h100 = "NVIDIA H100 80GB HBM3"
    slow_nvlink = expectations.judge("nccl", _rows("all_reduce", gib, 150.0), 1, 8, h100, 400.0, 8)
    assert slow_nvlink.is_problem and slow_nvlink.link == "intra-node NVLink"
    assert "370-480" in slow_nvlink.message
    fine = expectations.judge("nccl", _rows("all_reduce", gib, 420.0), 1, 8, h100, 400.0, 8)
    assert fine.status == "ok"
    one_nic = expectations.judge("nccl", _rows("all_reduce", gib, 20.0), 4, 1, h100, 400.0, 8)
    assert one_nic.is_problem and one_nic.link == "inter-node network" and "46-48" in one_nic.message
    small = expectations.judge("nccl", _rows("all_reduce", 2**20, 1.0), 1, 8, h100, None, 0)
    assert small.status == "inconclusive" and not small.is_problem
    cpu = expectations.judge("gloo", _rows("all_reduce", gib, 1.0), 1, 2, None, None, 0)
    assert cpu.status == "no-reference" and "no reference for gloo/CPU" in cpu.message


# --- CLI usage ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((), "required"),
        (("frobnicate",), "invalid choice"),
        (("sweep", "--max-bytes", "12X"), "invalid size"),
        (("sweep", "--ops", "all_reduce,bogus"), "unknown op"),
        (("sweep", "--nproc", "0"), "must be > 0"),
        (("sweep", "--min-bytes", "1M", "--max-bytes", "1K"), "--min-bytes"),
        (("sweep", "--nproc", "2", "--ray"), "not allowed"),
        (("log",), "required"),
    ],
)
def test_bad_cli_usage_exits_2_with_a_message(args: tuple[str, ...], needle: str) -> None:
    proc = run_tool(*args)
    assert proc.returncode == 2
    assert needle in proc.stderr
