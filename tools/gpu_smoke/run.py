"""The GPU check kit's driver: runs each step in a child process with its own timeout, collects what each step wrote
as it went, and writes `results.json` and `results.md` (a table) into --out after every step.

    python -m tools.gpu_smoke --out DIR [--wheels DIR] [--only STEP ...]     # one GPU, < 8 minutes
    python tools/gpu_smoke/run.py --dry-cpu --out DIR                       # the CPU parts (CI)

A GPU box needs only torch and triton: megatron-core and the small pure dependencies are carried as wheels
(tools/gpu_smoke/wheels/, or --wheels) and installed with `pip install --no-deps --target` into a directory of the
kit's own (--site), or unzipped there where pip is missing; nothing is installed into the box's Python. How to fetch
them: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WHEELS = Path(__file__).resolve().parent / "wheels"
#: (step, timeout on a GPU in seconds, timeout in --dry-cpu). The GPU timeouts add up to 450 s: the whole kit stays
#: under 8 minutes even when every step runs to its limit.
STEPS = (
    ("env", 30, 30),
    ("gpu_tests", 120, 5),
    ("kernels", 60, 30),
    ("actor_qwen3_moe", 90, 60),
    ("actor_dsv3", 90, 60),
    ("sglang_ipc", 30, 30),
    ("sglang_nccl", 30, 30),
)


# ------------------------------------------------------------------------------------------------ inside a step
class Recorder:
    """A step's results, rewritten to its JSON file after every record (a step killed by its timeout keeps what it
    recorded)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def skip(self, reason: str) -> None:
        self["status"] = "skipped"
        self["reason"] = reason


def bootstrap(site: Path | None) -> None:
    """Make `mcore_rl` importable from this checkout on a bare box: the carried wheels' directory first on the path,
    then the repo root, then the folders setup.py maps into the `mcore_rl` namespace (parallel/, resharding/,
    kernels/: `mcore_rl.__path__` gains the repo root, which holds them)."""
    for path in (str(REPO), str(site) if site else None):
        if path and path not in sys.path:
            sys.path.insert(0, path)
    import mcore_rl

    try:
        import mcore_rl.parallel  # noqa: F401
    except ImportError:
        mcore_rl.__path__.append(str(REPO))


def run_step(name: str, out: Path, dry: bool, site: Path | None) -> int:
    """The body of one step (child process): its results go to out/<name>.json."""
    rec = Recorder(out / f"{name}.json")
    rec["status"] = "running"
    try:
        bootstrap(site)
        if name == "env":
            step_env(rec, dry)
        elif name == "gpu_tests":
            step_gpu_tests(rec, dry, out)
        elif name == "kernels":
            from tools.gpu_smoke import kernels_check

            kernels_check.run(rec, dry)
        elif name.startswith("actor_"):
            from tools.gpu_smoke import actor_check

            actor_check.run(rec, dry, name.removeprefix("actor_"))
        elif name.startswith("sglang_"):
            from tools.gpu_smoke import sglang_check

            getattr(sglang_check, name.removeprefix("sglang_"))(rec, dry)
        else:
            raise ValueError(f"unknown step {name!r}")
        if rec.data.get("status") == "running":
            rec["status"] = "ok"
        return 0
    except Exception as err:  # noqa: BLE001 - the kit reports every failure and goes on with the next step
        rec["status"] = "failed"
        rec["error"] = f"{type(err).__name__}: {err}"
        rec["traceback"] = traceback.format_exc()[-4000:]
        return 1


def step_env(rec: Recorder, dry: bool) -> None:
    """Versions, the device, and which optional pieces are there (TE, transformers, pytest)."""
    import torch

    rec["python"] = sys.version.split()[0]
    rec["torch"] = torch.__version__
    rec["cuda"] = torch.version.cuda
    rec["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    from importlib.metadata import PackageNotFoundError, version

    # distribution versions, without importing them (megatron and transformers take seconds to import)
    for dist in ("triton", "megatron-core", "transformers", "transformer-engine", "safetensors", "pytest"):
        try:
            rec[dist] = version(dist)
        except PackageNotFoundError:
            rec[dist] = None
    rec["summary"] = (
        f"{rec['device']}; torch {torch.__version__} (CUDA {torch.version.cuda}), triton {rec['triton']}, "
        f"megatron-core {rec['megatron-core']}, TE {rec['transformer-engine']}, transformers {rec['transformers']}"
    )
    if not dry and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible: run with --dry-cpu on a machine without a GPU")


def step_gpu_tests(rec: Recorder, dry: bool, out: Path) -> None:
    """The project's `gpu` tests (kernels bit-exact, the CUDA runtime), with pytest when it is importable."""
    if dry:
        return rec.skip("--dry-cpu: the gpu tests skip without CUDA")
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        return rec.skip("pytest is not installed (carry its wheels: docs/gpu.md)")
    report = out / "gpu_tests.junit.xml"
    # the files that hold gpu tests (collecting every test file would import Ray, Hydra ... which the box lacks)
    files = sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").glob("test_*.py") if "mark.gpu" in f.read_text())
    rec["files"] = files
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={report}",
           "--continue-on-collection-errors", *files]  # fmt: skip
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ))
    rec["tail"] = res.stdout[-3000:] + res.stderr[-1000:]
    import xml.etree.ElementTree as ET

    if report.exists():
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        rec["counts"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        rec["failed"] = [
            f"{case.get('classname')}::{case.get('name')}"
            for case in suite.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None
        ]
    counts = rec.data.get("counts", {})
    rec["summary"] = ", ".join(f"{v} {k}" for k, v in counts.items()) or "no JUnit report"
    rec["status"] = "ok" if res.returncode == 0 else "failed"


# ------------------------------------------------------------------------------------------------ the driver
def install_wheels(wheels: Path, site: Path) -> list[str]:
    """Install every carried wheel into `site` without dependencies (pip --target; unzipped where pip is missing)."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return []
    site.mkdir(parents=True, exist_ok=True)
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if pip.returncode == 0:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--upgrade", "--target", str(site)]
        subprocess.run([*cmd, *map(str, found)], check=True, capture_output=True)
    else:
        for wheel in found:  # a wheel is a zip of the files as installed
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
    return [w.name for w in found]


def table(results: dict[str, Any]) -> str:
    """The markdown table of a run: one row per step, with its headline figures."""
    lines = [f"GPU check kit: {results.get('device', '?')} ({results.get('mode')})", "",
             "| step | status | seconds | figures |", "| --- | --- | --- | --- |"]  # fmt: skip
    for name, step in results["steps"].items():
        figures = step.get("summary") or step.get("reason") or step.get("error") or ""
        lines.append(f"| {name} | {step.get('status')} | {step.get('seconds', 0):.1f} | {figures} |")
    return "\n".join(lines) + "\n"


def write(out: Path, results: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(table(results))


def main(argv: list[str] | None = None) -> int:
    """Run the kit; exit 0 when no step failed (skipped steps say why)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu_smoke_results"), help="where results.json/.md go")
    p.add_argument("--dry-cpu", action="store_true", help="only the CPU parts (no GPU needed)")
    p.add_argument("--wheels", type=Path, default=WHEELS, help="carried wheels to install with --no-deps")
    p.add_argument("--site", type=Path, default=None, help="where carried wheels go (default: <out>/site)")
    p.add_argument("--only", nargs="*", help="run only these steps")
    p.add_argument("--step", help=argparse.SUPPRESS)  # internal: run one step's body in this process
    args = p.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    site = (args.site or out / "site").resolve()
    if args.step:
        return run_step(args.step, out, args.dry_cpu, site if site.is_dir() else None)
    mode = "--dry-cpu" if args.dry_cpu else "cuda"
    results: dict[str, Any] = {"mode": mode, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "steps": {}}  # fmt: skip
    try:
        results["wheels"] = install_wheels(args.wheels, site)
    except subprocess.CalledProcessError as err:
        results["wheels_error"] = (err.stderr or b"").decode(errors="replace")[-2000:]
    path = os.pathsep.join(filter(None, [str(site), str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    if args.dry_cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU runtime refuses to shadow a GPU
    failed = 0
    for name, gpu_timeout, cpu_timeout in STEPS:
        if args.only and name not in args.only:
            continue
        timeout = cpu_timeout if args.dry_cpu else gpu_timeout
        cmd = [sys.executable, "-m", "tools.gpu_smoke.run", "--step", name, "--out", str(out), "--site", str(site)]
        cmd += ["--dry-cpu"] if args.dry_cpu else []
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
            status, tail = None, proc.stdout[-1500:] + proc.stderr[-1500:]
        except subprocess.TimeoutExpired as err:
            status = "timeout"
            tail = str((err.stderr or b"")[-1500:] if isinstance(err.stderr, bytes) else err.stderr or "")
        path = out / f"{name}.json"
        step = json.loads(path.read_text()) if path.exists() else {"status": "failed", "error": "no result written"}
        if status:
            step["status"], step["reason"] = status, f"cut off after {timeout} s; figures so far kept"
        step["seconds"] = time.perf_counter() - start
        if step.get("status") in ("failed", "timeout"):
            step["log_tail"] = tail
            failed += 1
        if name == "env":
            results["device"] = step.get("device")
        results["steps"][name] = step
        write(out, results)
        summary = step.get("summary") or step.get("reason") or step.get("error") or ""
        print(f"gpu_smoke: {name}: {step.get('status')} ({step['seconds']:.1f} s) {summary}", flush=True)
    print(table(results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
