"""The GPU package set: constraints-gpu.txt, setup.py's `gpu` extra and mcore_rl/gpu_extra.py's GPU_PINS agree with
each other and with what the wheels declare (SGLang 0.5.23 pins torch 2.14.1, transformers 5.19.0, tokenizers
0.23.2; torch 2.14.1 its triton; megatron-core 0.16.1 bounds Transformer Engine), and a GPU run refuses an installed
package at another version, naming it (setup.py once said sglang>=0.4.6 and nothing pinned its torch).

Run: `.venv/bin/pytest tests/test_gpu_extra.py`
"""

from __future__ import annotations

import ast
import glob
import os
import zipfile
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from mcore_rl.config import RLConfig
from mcore_rl.gpu_extra import GPU_PINS, GpuExtraError, check_gpu_extra, gpu_extra_problems

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECLARED = os.path.join(REPO, "tests", "fixtures", "gpu_wheel_requirements.txt")
#: the cluster the set is for: Linux x86_64, CPython 3.11 (the SGLang wheel's tag)
ENV = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "python_version": "3.11",
       "python_full_version": "3.11.9", "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "os_name": "posix", "extra": ""}  # fmt: skip


def _pins(path: str) -> dict[str, str]:
    pins = {}
    for line in open(path).read().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path}: {line} is not an exact pin"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def _declared() -> list[tuple[str, Requirement]]:
    """(declaring distribution, requirement) from the pinned METADATA text, plus megatron-core's installed METADATA."""
    out = []
    for line in open(DECLARED).read().splitlines():
        if line and not line.startswith("#"):
            who, req = line.split(": ", 1)
            out.append((who, Requirement(req)))
    out += [(f"megatron-core {metadata.version('megatron-core')}", Requirement(r))
            for r in metadata.requires("megatron-core") or []]  # fmt: skip
    return out


def _applies(req: Requirement, extra: str = "") -> bool:
    return req.marker is None or req.marker.evaluate({**ENV, "extra": extra})


def test_constraints_gpu_satisfy_what_the_wheels_declare() -> None:
    pins = _pins(os.path.join(REPO, "constraints-gpu.txt"))
    checked = 0
    for who, req in _declared():
        name = canonicalize_name(req.name)
        # megatron-core's Transformer Engine bound sits in its `dev` extra; the rest of that extra is not installed
        # (it wants flashinfer-python~=0.5.0, which SGLang 0.5.23's ==0.7.2 excludes)
        te_bound = who.startswith("megatron-core") and name == "transformer-engine" and _applies(req, "dev")
        if name not in pins or not (_applies(req) or te_bound or _applies(req, "pytorch")):
            continue
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints-gpu.txt pins {name}=={pins[name]}, but {who} requires {req}"
        )
        checked += 1
    # sglang's torch/transformers/tokenizers/torchaudio/flashinfer/kernel, torch's triton/nccl, TE's bound, TE's torch
    assert checked >= 10


def test_sglang_pins_are_the_ones_issue_26_names() -> None:
    declared = {canonicalize_name(r.name): str(r.specifier) for who, r in _declared() if who.startswith("sglang")}
    assert declared["torch"] == "==2.14.1" and declared["transformers"] == "==5.19.0"
    assert declared["tokenizers"] == "==0.23.2"


def test_runtime_pins_and_the_setup_extra_agree_with_constraints_gpu() -> None:
    pins = _pins(os.path.join(REPO, "constraints-gpu.txt"))
    for name, version in GPU_PINS.items():
        assert pins[canonicalize_name(name)] == version, name
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kwargs = {
        k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")
    }
    for line in kwargs["install_requires"] + kwargs["extras_require"]["gpu"]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name in pins:
            assert req.specifier.contains(pins[name], prereleases=True), f"setup.py {line} excludes {pins[name]}"
    assert any(Requirement(r).name == "sglang" for r in kwargs["extras_require"]["gpu"])


def test_pinned_metadata_text_is_the_sglang_wheels() -> None:
    wheels = [os.environ.get("MCORE_RL_SGLANG_WHEEL", "")] + glob.glob("/tmp/sgl/sglang-0.5.23-*.whl")
    wheel = next((w for w in wheels if w and os.path.isfile(w)), None)
    if wheel is None:
        pytest.skip("no SGLang 0.5.23 wheel at hand (MCORE_RL_SGLANG_WHEEL)")
    text = zipfile.ZipFile(wheel).read("sglang-0.5.23.dist-info/METADATA").decode()
    in_wheel = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("Requires-Dist: ")]
    pinned = [str(r) for who, r in _declared() if who == "sglang 0.5.23"]
    assert pinned == [str(Requirement(r)) for r in in_wheel]


def test_an_installed_package_at_another_version_is_named() -> None:
    torch = metadata.version("torch")
    problems, _ = gpu_extra_problems({"torch": "0.0.1"}, gate="torch")
    assert problems == [f"torch {torch} is installed, expected torch==0.0.1 (constraints-gpu.txt)"]
    assert gpu_extra_problems({"torch": torch.split("+")[0]}, gate="torch")[0] == []


def test_a_gpu_run_with_the_wrong_sglang_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = RLConfig()
    cfg.trainer.runtime, cfg.rollout.engine = "cuda", "sglang"
    installed = {"sglang": "0.5.22", "torch": GPU_PINS["torch"]}
    monkeypatch.setattr("mcore_rl.gpu_extra._installed", installed.get)  # as if this machine had them
    with pytest.raises(GpuExtraError, match=r"sglang 0\.5\.22 is installed, expected sglang==0\.5\.23") as err:
        check_gpu_extra(cfg)
    assert isinstance(err.value, ValueError)  # a user error: the run exits 2
    cfg.rollout.engine = "hf"
    check_gpu_extra(cfg)  # our embedded engine does not use the set
