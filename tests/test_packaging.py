"""parallel/, resharding/ and kernels/ install inside the mcore_rl namespace, for a regular and an editable install.

Nothing may install a top-level `parallel`, `resharding` or `kernels` package (`kernels` is another PyPI project).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = (
    "import mcore_rl.parallel.layout, mcore_rl.resharding.weight_map, mcore_rl.kernels.fp8_blockwise\n"
    "import mcore_rl.configs\n"
    "import importlib.util, sys\n"
    "print(mcore_rl.parallel.layout.__file__)\n"
    "print(all(importlib.util.find_spec(n) is None for n in ('parallel', 'resharding', 'kernels')))\n"
)


def _probe(env_path: str | None, cwd: Path) -> list[str]:
    env = {"PATH": "/usr/bin:/bin"}
    if env_path:
        env["PYTHONPATH"] = env_path
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_editable_install_imports_mapped_folders_from_the_checkout(tmp_path: Path):
    # The test environment is the editable install made by `make test`; run from outside the checkout.
    path, no_top_level = _probe(None, tmp_path)
    assert Path(path) == ROOT / "parallel" / "layout.py"
    assert no_top_level == "True"


@pytest.mark.slow
def test_regular_install_puts_mapped_folders_under_mcore_rl(tmp_path: Path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheel_dir),
            str(ROOT),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (wheel,) = wheel_dir.glob("mcore_rl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mcore_rl/parallel/layout.py" in names and "mcore_rl/kernels/fp8_blockwise.py" in names
    assert "mcore_rl/configs/default.yaml" in names
    assert not any(n.split("/")[0] in ("parallel", "resharding", "kernels") for n in names)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    site_packages = [p for p in sys.path if p.endswith("site-packages")]
    path, no_top_level = _probe(":".join([str(target), *site_packages]), tmp_path)
    assert Path(path) == target / "mcore_rl" / "parallel" / "layout.py"
    assert no_top_level == "True"


def test_unverified_megatron_is_refused_with_a_message(monkeypatch) -> None:
    from mcore_rl.parallel.cpu_runtime import VERIFIED_MEGATRON, megatron_version_problem

    monkeypatch.delenv("MCORE_RL_ALLOW_UNVERIFIED_MEGATRON", raising=False)
    assert megatron_version_problem() is None  # the installed one (constraints.txt's) is verified
    assert megatron_version_problem(VERIFIED_MEGATRON[0]) is None
    problem = megatron_version_problem("0.17.0")
    assert "megatron-core 0.17.0 is installed" in problem and "verified with 0.16.1" in problem
    monkeypatch.setenv("MCORE_RL_ALLOW_UNVERIFIED_MEGATRON", "1")
    assert megatron_version_problem("0.17.0") is None


def test_constraints_pin_what_this_environment_runs() -> None:
    """constraints.txt (used by `make setup`) names the versions installed here, for every package it lists."""
    from importlib import metadata

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower()] = version
    assert "mcore_rl" not in pins and "megatron-core" in pins and "torch" in pins
    for name in ("megatron-core", "torch", "ray", "transformers", "hydra-core"):
        assert metadata.version(name).split("+")[0] == pins[name], name
    assert "-c constraints.txt" in (ROOT / "tools" / "make_venv.sh").read_text()
    assert "tools/make_venv.sh" in (ROOT / "Makefile").read_text()
