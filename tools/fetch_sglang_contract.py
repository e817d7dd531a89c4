"""Fetch the few SGLang 0.5.23 source files our tests check against, without installing SGLang.

    python tools/fetch_sglang_contract.py [--dest .venv/sglang-0.5.23]

`make setup` runs it after installing the package. It downloads the SGLang wheel from PyPI (`pip download --no-deps`,
about 39 MB) into a temporary directory and extracts only the files below, under their `sglang/...` paths:

    sglang/api/v1/api_types.py               /generate request and response structs (tests/test_sglang_contract.py)
    sglang/srt/weight_sync/tensor_bucket.py  FlattenedTensorBucket, the flattened_bucket weight payload (same test)
    sglang/srt/server_args.py                launch flags declared with add_argument (tests/test_sglang_launcher.py)
    sglang/srt/arg_groups/fields/*.py        launch flags declared as dataclass fields (same test)
    sglang/srt/utils/common.py               init_custom_process_group, MultiprocessingSerializer, SafeUnpickler
    sglang/srt/utils/patch_torch.py          monkey_patch_torch_reductions (CUDA IPC device index -> GPU UUID)
    sglang/srt/managers/communicator.py      FanOutCommunicator: one control request at a time per engine, FIFO
                                             (tests/_sglang_receiver.py queues its control requests through it)

Every kept file's sha256 is pinned below (as the wheel's RECORD lists it) and a mismatch is refused.

From tensor_bucket.py, common.py and patch_torch.py it builds `sglang_cpu_receiver.py` in the destination: SGLang's
own weight-receiving code that runs on CPU (the update-group rendezvous, the tensor-payload normaliser, deserializer
and its allow-list, the torch reduction patch, the flattened bucket), each definition an exact source segment of its
file found by AST, behind a short header of imports and one shim (`RECEIVER_HEADER`). Tests load it with
tests/_sglang_code.py::load_sglang_receiver; tests/test_sglang_receiver.py checks that it matches the pinned files.
It is the receiving side only: a process that applied its `monkey_patch_torch_reductions` before pickling would name
`sglang_cpu_receiver._rebuild_cuda_tensor_modified`, which SGLang's allow-list (rightly) refuses.

SGLang itself is not installed: importing `sglang` needs triton and CUDA, and these files load on their own by path.
The files go to a temporary directory beside the destination, which is then renamed into place, so an interrupted
run never leaves a half-written copy. Exits non-zero with a message naming what failed.
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.5.23"
#: every kept wheel file -> its sha256 as the wheel's RECORD writes it (urlsafe base64, no padding)
SHA256 = {
    "sglang/api/v1/api_types.py": "YP2Le2GxuIQkE59Xh54WtLdWRzsm8g4hQxS3TexSNSs",
    "sglang/srt/weight_sync/tensor_bucket.py": "pLe89AiVSiRDxuzI94ssky9yq_Mwjg0O6SIWECO-Rww",
    "sglang/srt/server_args.py": "-kHm5CmOqxX9WYF55Nhfsx7YFeVxRvC-j00nYc26COg",
    "sglang/srt/utils/common.py": "YMO1FPyrpH3OKx97dEhNuAnA1jW6ZG2UVUVSFwzwHXM",
    "sglang/srt/utils/patch_torch.py": "6wOccAos0QgTV5WsnmOHHoPrfPYU_qfgKm3k20hyxDY",
    "sglang/srt/managers/communicator.py": "gihpHWk8wod7I_x3eGamd5we2FEd_wxkrQAtLGAuBVI",
    "sglang/srt/arg_groups/fields/__init__.py": "ESMyKQj-8pzIREVt7mJ-pXklFza_S-om5OAr3yZeRG8",
    "sglang/srt/arg_groups/fields/device.py": "S7S04pmTWJRsUQo_1tVsG7v18cKXLFzajNV-T1WVzdc",
    "sglang/srt/arg_groups/fields/disagg.py": "I_FKE6LR0WP9hXx2tjPScRUfQTlXsMJPjRf1D71p6xg",
    "sglang/srt/arg_groups/fields/exec_.py": "w_ByUKDi6W6H3poIDRqV3l8hdz8InZZFMkLkwXHRNa8",
    "sglang/srt/arg_groups/fields/lora.py": "6PunkB3w8J3qVaCWu9-G5ENsKABhd6adX2nv-WiUYqI",
    "sglang/srt/arg_groups/fields/memory.py": "ZeImy2dvcoW_A785VJVEzVYLn7QRF9Em3SH_aNo0g4g",
    "sglang/srt/arg_groups/fields/mm.py": "Wh0-qRHWsUR8ojX9oB-X8GuO8TU113tdO_FXTWb7NGI",
    "sglang/srt/arg_groups/fields/model.py": "HcNmaqI60doV50F-OXAlNIvfptUXiYsuvNn-4eu4TkQ",
    "sglang/srt/arg_groups/fields/observability.py": "uLUIav3_n8vGWTSx-_lIGIBnzryCLMZ0UogdvHjBzpI",
    "sglang/srt/arg_groups/fields/parallel.py": "G0_-Oz4XKBYHYQorVU33DhPBeoJYCAegRgPUF7EUQ3o",
    "sglang/srt/arg_groups/fields/schedule.py": "Z6pvGa3ZOCGgqnWKXVSkLJxlqeQIqAw_pEArrEWar54",
    "sglang/srt/arg_groups/fields/serving.py": "0Hb4DUebNiBi9D-JfgF7_WnwNBvQJoAY4-rlgdzEc6g",
    "sglang/srt/arg_groups/fields/spec.py": "P_EYdDTZ_vatbSkNkMAr4g2YmfhR7tXYefZcS1uNpfs",
}  # fmt: skip
FILES = tuple(SHA256)
#: the wheel's list of its files and their sha256, kept beside them (tests check the pins against it)
RECORD = f"sglang-{VERSION}.dist-info/RECORD"

RECEIVER = "sglang_cpu_receiver.py"
#: (kept file, its top-level definitions in the order they go into RECEIVER); a name is a def, a class or an
#: assignment target. The npu branch of patch_torch.py (`if _is_npu:`) is left out: `_is_npu` is False off Ascend.
RECEIVER_PARTS = (
    ("sglang/srt/weight_sync/tensor_bucket.py", ("FlattenedTensorMetadata", "FlattenedTensorBucket")),
    (
        "sglang/srt/utils/common.py",
        ("torch_release", "is_npu", "is_musa", "init_custom_process_group", "MultiprocessingSerializer",
         "SerializedTensorPayload", "_looks_like_pickle_payload", "normalize_serialized_named_tensor_payload",
         "normalize_serialized_named_tensor_payloads", "_safe_load_torch_storage", "SafeUnpickler"),
    ),
    (
        "sglang/srt/utils/patch_torch.py",
        ("_is_npu", "_is_musa", "SGLANG_TP_RANK", "monkey_patch_torch_reductions", "_REDUCE_TENSOR_ARG_DEVICE_INDEX",
         "register_sgl_tp_rank", "_reduce_tensor_modified", "_rebuild_cuda_tensor_modified", "_device_to_uuid",
         "_device_from_maybe_uuid", "_modify_tuple"),
    ),
)  # fmt: skip
#: what RECEIVER has besides the segments: the imports the segments use (as their files import them) and one shim
RECEIVER_HEADER = f'''"""SGLang {VERSION}'s own weight-receiving code that runs on CPU, cut from the pinned wheel.

Generated by tools/fetch_sglang_contract.py (`make setup`); do not edit. Every definition below is the exact source
segment of the file and lines named in the comment above it; tests/test_sglang_receiver.py checks that.
"""

from __future__ import annotations  # as sglang/srt/utils/common.py

import binascii  # as common.py
import io  # as common.py
import pickle  # as common.py
from dataclasses import dataclass  # as tensor_bucket.py
from functools import lru_cache  # as common.py
from multiprocessing.reduction import ForkingPickler  # as common.py
from typing import Callable, List, Tuple, Union  # as common.py, patch_torch.py and tensor_bucket.py

import torch  # as all three
from packaging import version as pkg_version  # as common.py
from torch.multiprocessing import reductions  # as patch_torch.py

try:
    import pybase64  # as common.py
except ImportError:  # shim: SGLang's dependency pybase64 -> the standard base64 (same b64encode/b64decode(validate=))
    import base64 as pybase64
'''
REPO = Path(__file__).resolve().parents[1]


class FetchError(RuntimeError):
    """A step of the fetch failed; the message says which and why."""


def download_wheel(version: str, into: Path) -> Path:
    """`pip download` the SGLang wheel into `into`; the wheel's path."""
    # The files we read are pure Python and the same in every platform wheel. SGLang 0.5.23 ships cp311
    # manylinux_2_34_x86_64 wheels, so ask for exactly that one: the fetch then works from any interpreter and
    # machine, and --only-binary keeps pip from building an sdist.
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64", f"sglang=={version}", "--dest", str(into),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise FetchError(f"`pip download sglang=={version}` failed (exit {result.returncode}):\n{tail}")
    wheels = sorted(into.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        raise FetchError(f"`pip download sglang=={version}` succeeded but left no wheel in {into}")
    return wheels[0]


def wanted_members(names: list[str]) -> list[str]:
    """The wheel members to extract (the pinned files); FetchError naming any the wheel lacks."""
    present = set(names)
    missing = [f for f in FILES if f not in present]
    if missing:
        raise FetchError(f"the wheel lacks {missing}: is this SGLang {VERSION}?")
    return list(FILES)


def record_hash(data: bytes) -> str:
    """sha256 of `data` as a wheel's RECORD writes it."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")


def check_pinned(name: str, data: bytes) -> None:
    """FetchError unless `data` (wheel member `name`) has the pinned sha256."""
    got = record_hash(data)
    if got != SHA256[name]:
        raise FetchError(f"{name} has sha256 {got}, expected {SHA256[name]} (the pinned SGLang {VERSION} wheel's)")


def top_level_segments(source: str, path: str) -> dict[str, tuple[int, int, str]]:
    """Top-level defs, classes and single-target assignments of `source` -> (first line, last line, exact text).

    A definition's text starts at its first decorator, so `@lru_cache` and `@dataclass` come with it."""
    lines = source.splitlines(keepends=True)
    found: dict[str, tuple[int, int, str]] = {}
    for node in ast.parse(source, filename=path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, first = node.targets[0].id, node.lineno
        else:
            continue
        found[name] = (first, node.end_lineno, "".join(lines[first - 1 : node.end_lineno]))
    return found


def build_receiver(root: Path) -> str:
    """The text of RECEIVER from the kept files under `root`: RECEIVER_HEADER, then each part's segments, each
    under a comment naming its file and lines. FetchError naming a definition a file lacks."""
    out = [RECEIVER_HEADER]
    for path, names in RECEIVER_PARTS:
        segments = top_level_segments((root / path).read_text(encoding="utf-8"), path)
        for name in names:
            if name not in segments:
                raise FetchError(f"{path} has no top-level {name}: is this SGLang {VERSION}?")
            first, last, text = segments[name]
            out.append(f"\n\n# {path}:{first}-{last}\n{text}")
    return "".join(out)


def extract(wheel: Path, dest: Path) -> list[str]:
    """Extract the wanted files of `wheel` to `dest` (replacing it) through a temporary sibling directory."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary readable directory
    old = dest.parent / f".{dest.name}.old"
    try:
        try:
            with zipfile.ZipFile(wheel) as archive:
                members = wanted_members(archive.namelist())
                for name in members:
                    check_pinned(name, archive.read(name))
                    archive.extract(name, staging)
                if RECORD not in archive.namelist():
                    raise FetchError(f"{wheel.name} has no {RECORD}: is this SGLang {VERSION}'s wheel?")
                archive.extract(RECORD, staging)  # the wheel's own list of hashes, which the pins must be
        except zipfile.BadZipFile as err:
            raise FetchError(f"{wheel.name} is not a valid wheel: {err}") from err
        (staging / RECEIVER).write_text(build_receiver(staging), encoding="utf-8")
        shutil.rmtree(old, ignore_errors=True)
        if dest.exists():
            dest.rename(old)  # keep the previous copy until the new one is in place
        try:
            staging.rename(dest)
        except OSError:
            if old.exists() and not dest.exists():
                old.rename(dest)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return members


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dest", type=Path, default=REPO / ".venv" / f"sglang-{VERSION}", help="where the sglang/... tree goes"
    )
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="sglang-wheel-") as tmp:
            wheel = download_wheel(VERSION, Path(tmp))
            members = extract(wheel, args.dest)
    except (FetchError, OSError) as err:
        print(f"error: could not fetch SGLang {VERSION}'s contract files into {args.dest}: {err}", file=sys.stderr)
        return 1
    print(f"SGLang {VERSION}: {len(members)} files and {RECEIVER} in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
