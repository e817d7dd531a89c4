"""tools/bench_sync.py's report: one layout's table (a row per transport and mode, against the raw media and the v1
path) and the profile of each median attempt. Split from the runner, which measures; this prints."""

from __future__ import annotations

import os
from typing import Any

GB = 1e9
MB = 1 << 20


def _median(attempts: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return sorted(attempts, key=lambda a: a[key])[(len(attempts) - 1) // 2]


def _row(layout: str, info: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """The figures of one (transport, mode): its median attempt; every attempt must pass its checks."""
    attempts = run["attempts"]
    median = _median(attempts, "seconds")
    raw = info["raw"][run["transport"]]["seconds"]
    peak = max(s["peak_extra_bytes"] for a in attempts for s in a["stats"])
    ok = all(not a["problems"] and a["committed"] == info["entries"] and a["checked"] > 0 for a in attempts)
    seconds = median["seconds"]
    return dict(
        layout=layout, transport=run["transport"], mode=run["mode"], gb=info["nbytes"] / GB, seconds=seconds,
        gbps=info["nbytes"] / GB / seconds, vs_raw=raw / seconds,
        vs_v1=info["v1"]["seconds"] / seconds, peak_mb=peak / MB, bucket_mb=info["bucket_bytes"] / MB,
        largest_mb=info["largest"] / MB, ok=ok, median=median, spread=sorted(a["seconds"] for a in attempts),
    )  # fmt: skip


def _print_raw_and_v1(info: dict[str, Any]) -> None:
    n, raw, v1 = info["nbytes"], info["raw"], info["v1"]
    parts = []
    if "distributed" in raw or "sglang_code" in raw:
        r = raw.get("distributed") or raw["sglang_code"]
        parts.append(f"distributed {r['seconds']:.2f} s = {n / GB / r['seconds']:.2f} GB/s (one gloo broadcast, two "
                     "processes)")  # fmt: skip
    if "tensor" in raw:
        r = raw["tensor"]
        parts.append(f"tensor {r['seconds']:.2f} s = {n / GB / r['seconds']:.2f} GB/s (copy into mapped shared "
                     f"memory {r['copy_in_s']:.2f} s + the engine's staging copy out of it)")  # fmt: skip
    if "disk" in raw:
        r = raw["disk"]
        parts.append(f"disk {r['seconds']:.2f} s = {n / GB / r['seconds']:.2f} GB/s (write one safetensors file "
                     f"{r['write_s']:.2f} s + read it back)")  # fmt: skip
    print("raw media, same bytes, buffers faulted in beforehand, median of the attempts: " + "; ".join(parts))
    verdict = "OK" if not v1["problems"] else "FAIL " + "; ".join(v1["problems"][:3])
    print(
        f"v1 (every rank exports full HF tensors -> driver -> one /update_weights_from_tensor): {v1['seconds']:.2f} "
        f"s = {n / GB / v1['seconds']:.2f} GB/s: export {v1['export_s']:.2f} + travel {v1['travel_s']:.2f} (slowest "
        f"rank's torch.save + put {v1['save_s']:.2f}; driver's torch.load {v1['load_s']:.2f}) + push "
        f"{v1['push_s']:.2f} (shared-memory encode {v1['encode_s']:.2f}) + end {v1['end_s']:.2f}; every one of "
        f"{v1['tensors']} engine tensors == export: {verdict}"
    )


def _print_profile(run: dict[str, Any], row: dict[str, Any]) -> None:
    attempt, cores = row["median"], os.cpu_count() or 1
    leaders = [s for s in attempt["stats"] if s["buckets"]]
    slow = max(leaders, key=lambda s: s["seconds"])
    eng = attempt["engine"]
    ranks = {k: sum(s[k] for s in attempt["stats"]) for k in ("cpu_s", "sys_s", "fault_bytes")}
    total = ranks["cpu_s"] + eng.get("cpu_s", 0.0)
    resident = max(s.get("resident_bytes", 0) for s in attempt["stats"])
    print(
        f"  {run['transport']} {run['mode']}: fence {attempt['seconds']:.2f} s = begin {attempt['begin_s']:.2f} + "
        f"send {attempt['send_s']:.2f} + disk {attempt['disk_s']:.2f} + end {attempt['end_s']:.2f}; slowest of "
        f"{len(leaders)} leaders ({slow['buckets']} buckets, {slow['seconds']:.2f} s): gather {slow['gather_s']:.2f} "
        f"pack {slow['pack_s']:.2f} wait {slow['wait_s']:.2f}\n"
        f"      cpu: ranks {ranks['cpu_s']:.2f} s (sys {ranks['sys_s']:.2f}, fresh pages "
        f"{ranks['fault_bytes'] / GB:.2f} GB) + engine {eng.get('cpu_s', 0):.2f} s (sys {eng.get('sys_s', 0):.2f}, "
        f"fresh pages {eng.get('fault_bytes', 0) / GB:.2f} GB; thread-s receiving {eng.get('receive_s', 0):.2f}, "
        f"staging {eng.get('stage_s', 0):.2f}) = {total:.2f} cpu-s of {cores * attempt['seconds']:.2f} core-s\n"
        f"      resident between syncs: largest rank {resident / MB:.1f} MB (its reused bucket and gather buffers); "
        f"engine {eng.get('resident_bytes', 0) / MB:.1f} MB (reused staging and receive buffers)"
        + (
            "\n      (engine figures: the SGLang-code receiver runs in its own process, not profiled)"
            if not eng
            else ""
        )
    )


def report(layout: str, info: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Print one layout's figures and profile (`world` actor ranks); return its rows."""
    n, bucket, largest = info["nbytes"], info["bucket_bytes"], info["largest"]
    bound = 2 * bucket + largest
    print(
        f"\n== {layout}: actor {info['actor']} ({world} gloo ranks) -> one embedded engine (1 rank, fp32)\n"
        f"plan: {n / GB:.3f} GB, {info['entries']} HF tensors in {info['buckets']} buckets over "
        f"{len(info['streams'])} streams ({', '.join(info['streams'])}); bucket {bucket / MB:g} MB, largest tensor "
        f"{largest / MB:g} MB, bound 2 x bucket + largest = {bound / MB:g} MB"
    )
    _print_raw_and_v1(info)
    print(
        f"{'transport':<12}{'mode':<12}{'GB':>6}{'seconds':>8}{'GB/s':>6}{'vs_raw':>7}{'vs_v1':>7}{'peak_MB':>8}"
        f"{'/bucket':>8}{'/bound':>7}  attempts (s)      check"
    )
    rows = []
    for run in info["runs"]:
        row = _row(layout, info, run)
        rows.append(row)
        last = run["attempts"][-1]
        spread = " ".join(f"{s:.2f}" for s in row["spread"])
        print(
            f"{row['transport']:<12}{row['mode']:<12}{row['gb']:>6.3f}{row['seconds']:>8.2f}{row['gbps']:>6.2f}"
            f"{row['vs_raw']:>7.2f}{row['vs_v1']:>7.2f}{row['peak_mb']:>8.1f}{row['peak_mb'] * MB / bucket:>8.2f}"
            f"{row['peak_mb'] * MB / bound:>7.2f}  {spread:<17} {'OK' if row['ok'] else 'FAIL'} ({last['checked']} "
            f"tensors read back, {last['committed']}/{info['entries']} committed, each attempt)"
        )
        for problem in [p for a in run["attempts"] for p in a["problems"]][:3]:
            print(f"    FAIL: {problem}")
    if any(r["mode"] == "shard_aware" for r in rows):
        print("shard_aware = full here: the engine has one rank, which keeps every byte of every tensor in both modes")
    print(f"profile of each median attempt ({os.cpu_count()} cores here for {world} ranks and the engine):")
    for run, row in zip(info["runs"], rows):
        _print_profile(run, row)
    return rows
