"""The checkpoint pre-flight's memory of checkpoints it passed, so a run of the same model skips its child process.

    key = checkpoint_key(path, divisible_by, mtp)   # None: the directory holds something not to fingerprint
    note = passed(key)                              # PASSED_BEFORE's note, or MISS
    remember(key, note, sources)                    # after the child passed it (never a refusal): the mcore_rl
                                                    # files it imported are kept with their sha256

The child (preflight.py: torch and Megatron imported, the model built on the meta device) costs about 5 s of CPU, which
a small host pays on the start-up's critical path every run. Its answer depends only on what the key covers:

    the checkpoint    model.path (resolved), and for every entry in it: its name, size and modification time (ns);
                      a .safetensors file's whole header (the bytes the child reads: names, dtypes, shapes, offsets),
                      a .json file's whole text (config.json, the index)
    the arguments     make_vocab_size_divisible_by and mtp
    the code          the installed megatron-core, torch, safetensors and transformers versions; and the record
                      keeps the sha256 of every mcore_rl source file the child imported (the weight maps, the
                      builder, mcore_rl.parallel and .resharding from their mapped folders): a record whose files
                      changed is a miss

A file rewritten in place, a new entry, an edit of our code or another release of those packages is another key, so
the child runs again. Only a pass is remembered: a refused checkpoint runs the child every time and gets its message.
Where: $MCORE_RL_CACHE_DIR, else ~/.cache/mcore_rl (a file per key under checkpoint_check/); a cache that cannot be
read or written is skipped, never an error; it keeps the MAX_RECORDS newest passes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
import struct
import tempfile
from pathlib import Path

#: the environment variable naming the cache's directory (default ~/.cache/mcore_rl)
CACHE_DIR_ENV = "MCORE_RL_CACHE_DIR"
#: passed()'s answer for a key with no remembered pass
MISS = object()
_PACKAGES = ("megatron-core", "torch", "safetensors", "transformers")
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header
_MAX_JSON = 64 * 2**20
#: records kept; the oldest go first (a test suite's temporary checkpoints would otherwise pile up)
MAX_RECORDS = 256


def cache_dir() -> Path:
    """The directory of remembered passes."""
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "mcore_rl")
    return Path(root) / "checkpoint_check"


@functools.cache
def code_fingerprint() -> str:
    """sha256 of the versions of the packages the check builds with (once per process)."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    for name in _PACKAGES:
        try:
            digest.update(f"{name}={version(name)}\0".encode())
        except PackageNotFoundError:
            digest.update(f"{name} absent\0".encode())
    return digest.hexdigest()


def checkpoint_key(path: str, divisible_by: int, mtp: str) -> str | None:
    """The key of the check of `path` (see the module docstring); None where an entry is neither a file nor a
    directory (a FIFO, a socket), a file cannot be read, or a header is not one: the child then runs and says why."""
    digest = hashlib.sha256(json.dumps([os.path.realpath(path), divisible_by, mtp, code_fingerprint()]).encode())
    try:
        for name in sorted(os.listdir(path)):
            file = os.path.join(path, name)
            info = os.stat(file)
            digest.update(f"\0{name}\0{stat.S_IFMT(info.st_mode)}\0{info.st_size}\0{info.st_mtime_ns}\0".encode())
            if stat.S_ISDIR(info.st_mode):
                continue
            if not stat.S_ISREG(info.st_mode):
                return None
            if name.endswith(".safetensors"):
                with open(file, "rb") as f:
                    head = f.read(8)
                    if len(head) < 8:
                        return None
                    (length,) = struct.unpack("<Q", head)
                    if length > min(_MAX_HEADER, info.st_size - 8):
                        return None
                    digest.update(head + f.read(length))
            elif name.endswith(".json"):
                if info.st_size > _MAX_JSON:
                    return None
                with open(file, "rb") as f:
                    digest.update(f.read())
    except OSError:
        return None
    return digest.hexdigest()


def passed(key: str | None) -> str | None | object:
    """The note of a remembered pass of `key` (None: the check had no note), or MISS."""
    if key is None:
        return MISS
    try:
        with open(cache_dir() / f"{key}.json") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return MISS
    if not isinstance(record, dict) or record.get("key") != key or not isinstance(record.get("sources"), dict):
        return MISS
    if _hashes(list(record["sources"])) != record["sources"]:  # our code the check ran has changed since
        return MISS
    note = record.get("note")
    return note if note is None or isinstance(note, str) else MISS


def _hashes(files: list[str]) -> dict[str, str] | None:
    try:
        return {file: hashlib.sha256(Path(file).read_bytes()).hexdigest() for file in files}
    except OSError:
        return None


def remember(key: str | None, note: str | None, sources: list[str]) -> None:
    """Record that the check of `key` passed, with its note and the mcore_rl source files it ran (written to a
    temporary file, then renamed: a reader never sees half a record)."""
    hashes = _hashes(sources)
    if key is None or hashes is None:
        return
    folder = cache_dir()
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "note": note, "sources": hashes}, f)
        os.replace(tmp, folder / f"{key}.json")
        tmp = None
        _prune(folder)
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _prune(folder: Path) -> None:
    records = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
    for old in records[: max(0, len(records) - MAX_RECORDS)]:
        old.unlink(missing_ok=True)
