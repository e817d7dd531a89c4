"""The tested GPU package set (`pip install -c constraints-gpu.txt -e '.[gpu]'`), and the check a GPU run makes of
what is installed before any engine starts.

SGLang 0.5.23 pins its torch, transformers and tokenizers exactly (its wheel's METADATA: `torch==2.14.1`,
`transformers==5.19.0`, `tokenizers==0.23.2`); torch 2.14.1 pins `triton~=3.8.0`; megatron-core 0.16.1 declares
`transformer-engine>=2.9,<2.12`. A cluster image that drifted from them (a newer torch pulled by another package, a
transformers upgrade) fails deep inside SGLang's or Megatron's start, minutes later and without naming the package;
here it is refused at once, naming the package and the version expected (exit 2).

    problems, note = gpu_extra_problems()   # [] and what was checked, or one line per package at a wrong version

`tests/test_gpu_extra.py` checks that constraints-gpu.txt and setup.py's `gpu` extra agree with GPU_PINS, and GPU_PINS
with the requirements the wheels declare.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

#: distribution -> the version of the tested GPU set (constraints-gpu.txt holds the same, with the reasons)
GPU_PINS: dict[str, str] = {
    "sglang": "0.5.23",
    "torch": "2.14.1",
    "transformers": "5.19.0",
    "tokenizers": "0.23.2",
    "triton": "3.8.0",
    "transformer-engine": "2.11.0",
    "megatron-core": "0.16.1",
}


class GpuExtraError(ValueError):
    """An installed GPU package at another version than the tested set's (a ValueError: exit 2)."""


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def gpu_extra_problems(pins: dict[str, str] | None = None, gate: str = "sglang") -> tuple[list[str], str]:
    """(one line per pinned package installed at another version, a note saying what was checked). Packages that are
    not installed are not problems here: where `gate` (SGLang) is absent nothing of its set is checked (a login node
    running a dry run), and a GPU run without SGLang is refused by the launcher's own check."""
    pins = GPU_PINS if pins is None else pins
    if _installed(gate) is None:
        return [], f"{gate} is not installed here: the GPU set is checked where the run starts"
    problems = []
    for name, want in pins.items():
        got = _installed(name)
        base = (got or "").split("+")[0]  # a local build tag (torch's +cu130) is the same release
        if got is not None and base != want:
            problems.append(f"{name} {got} is installed, expected {name}=={want} (constraints-gpu.txt)")
    checked = ", ".join(f"{n} {_installed(n)}" for n in pins if _installed(n) is not None)
    return problems, f"the tested set ({checked})"


def check_gpu_extra(cfg: Any) -> None:
    """GpuExtraError naming each package at a wrong version, for a run on real SGLang engines (rollout.engine=sglang
    on CUDA); other runs do not use the set."""
    if cfg.trainer.runtime != "cuda" or not cfg.rollout.kind.uses_gpu_extra:
        return
    problems, _ = gpu_extra_problems()
    if problems:
        raise GpuExtraError(
            "rollout.engine=sglang: the GPU packages are not the tested set: " + "; ".join(problems)
            + " (install with: pip install -c constraints-gpu.txt -e '.[gpu]')"
        )  # fmt: skip
