"""Fetch the few SGLang 0.5.23 source files our tests check against, without installing SGLang.

    python tools/fetch_sglang_contract.py [--dest .venv/sglang-0.5.23]

`make setup` runs it after installing the package. It downloads the SGLang wheel from PyPI (`pip download --no-deps`,
about 39 MB) into a temporary directory and extracts only the files below, under their `sglang/...` paths:

    sglang/api/v1/api_types.py               /generate request and response structs (tests/test_sglang_contract.py)
    sglang/srt/weight_sync/tensor_bucket.py  FlattenedTensorBucket, the flattened_bucket weight payload (same test)
    sglang/srt/server_args.py                launch flags declared with add_argument (tests/test_sglang_launcher.py)
    sglang/srt/arg_groups/fields/*.py        launch flags declared as dataclass fields (same test)

SGLang itself is not installed: importing `sglang` needs triton and CUDA, and these files load on their own by path.
The files go to a temporary directory beside the destination, which is then renamed into place, so an interrupted
run never leaves a half-written copy. Exits non-zero with a message naming what failed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.5.23"
FILES = ("sglang/api/v1/api_types.py", "sglang/srt/weight_sync/tensor_bucket.py", "sglang/srt/server_args.py")
FIELDS_DIR = "sglang/srt/arg_groups/fields/"
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
    """The wheel members to extract; FetchError naming any expected file the wheel lacks."""
    present = set(names)
    missing = [f for f in FILES if f not in present]
    fields = sorted(
        n for n in names if n.startswith(FIELDS_DIR) and n.endswith(".py") and "/" not in n[len(FIELDS_DIR) :]
    )
    if not fields:
        missing.append(FIELDS_DIR + "*.py")
    if missing:
        raise FetchError(f"the wheel lacks {missing}: is this SGLang {VERSION}?")
    return [*FILES, *fields]


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
                    archive.extract(name, staging)
        except zipfile.BadZipFile as err:
            raise FetchError(f"{wheel.name} is not a valid wheel: {err}") from err
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
    print(f"SGLang {VERSION}: {len(members)} files in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
