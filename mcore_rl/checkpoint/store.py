"""Training checkpoints on disk: the directory layout, atomic publication, retention, and the checks a resume runs
before anything starts.

    <run_dir>/checkpoints/
        latest                        "step_00000040": the newest complete checkpoint (replaced atomically, last)
        step_00000040/
            meta.json                 format, step, weight version, the model (HF config, dtype, padded vocabulary),
                                      the layout it was saved under
            loop_state.json           controller/state.py's LoopState (data position, history, controller states)
            model/                    Megatron torch_dist checkpoint of the policy (loads under any TP/PP/EP layout;
                                      `tools/convert_checkpoint.py mcore-to-hf` exports it)
            optimizer/                torch_dist: optimizer tensors by global parameter key, Adam step, LR scheduler
            reference/                torch_dist: the frozen reference (hard links to the first checkpoint's files)
            rng/rank_00000.pt ...     per-rank RNG states
        .tmp-step_00000042-<id>/      a save in progress; renamed to step_00000042/ when complete

A crash at any point leaves either the old `latest` and a `.tmp-` directory (ignored, with a message, and removed by
the next successful save) or the new checkpoint published; never a half-written `step_*` directory. A kill between
the rename and the move of `latest` leaves a complete `step_*` newer than `latest` names (or no `latest` at all, on
the first save): `latest()` finds the newest complete directory either way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mcore_rl.checkpoint.rank_io import CRITIC_DIR, MODEL_DIR, OPTIMIZER_DIR, REFERENCE_DIR, RNG_DIR
from mcore_rl.resharding.hf_io import CheckpointError as _UnusableCheckpoint
from mcore_rl.resharding.hf_io import not_readable_as

FORMAT, VERSION = "mcore_rl training checkpoint", 1
ROOT_NAME, LATEST, META, LOOP_STATE, TMP_PREFIX = "checkpoints", "latest", "meta.json", "loop_state.json", ".tmp-"
STEP_NAME = re.compile(r"step_\d+")
#: HF config keys that do not change the model (names, versions, the dtype is checked as model.dtype)
COSMETIC_KEYS = {"architectures", "transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype"}


class CheckpointError(_UnusableCheckpoint):
    """A training checkpoint that cannot be resumed from (or saved); the message names the file and field. (A
    ValueError, like every checkpoint error: the CLIs report it as bad input.)"""


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / ROOT_NAME


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    """The step of a `step_<n>` directory name, else None."""
    name = path.name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def half_written(root: Path) -> list[Path]:
    """Temporary directories of saves that did not finish (a symbolic link is none: never removed through)."""
    return sorted(p for p in root.glob(TMP_PREFIX + "*") if p.is_dir() and not p.is_symlink()) if root.is_dir() else []


def check_root(root: Path) -> None:
    """The run's own checkpoints directory is not a symbolic link: its saves, and trainer.keep_last's pruning, would
    change the checkpoints of whatever it points to (another run's, when a run dir was copied with its links)."""
    if root.is_symlink():
        raise CheckpointError(
            f"{root} is a symbolic link to {os.readlink(root)!r}; a run reads and writes its checkpoints only in a "
            "directory of its own in trainer.run_dir (its saves and trainer.keep_last's pruning would change what the "
            "link points to): remove the link, or set trainer.run_dir to a directory on that disk (trainer.resume="
            "<a checkpoint directory> resumes from one elsewhere)"
        )


def _no_link_out(path: Path, root: Path) -> None:
    """A step directory of `root` is one the run wrote, never a symbolic link: resume does not follow one out of it."""
    if path.is_symlink():
        raise CheckpointError(
            f"{path} is a symbolic link to {os.readlink(path)!r}; the checkpoints in {root} are directories the run "
            "wrote itself, and resume does not follow a link out of it: remove the link, or resume from that "
            "checkpoint with trainer.resume=<its path>"
        )


def newest_complete(root: Path) -> Path | None:
    """The published `step_<n>` directory of the highest step (one holding meta.json, which a save writes last,
    before the rename), or None. A `step_<n>` that is a symbolic link is refused (_no_link_out)."""
    if not root.is_dir():
        return None
    steps = [p for p in root.iterdir() if step_of(p) is not None]
    for path in steps:
        _no_link_out(path, root)
    complete = [p for p in steps if (p / META).is_file()]
    return max(complete, key=step_of, default=None)


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint of `root`: the one `root/latest` names, or a complete `step_<n>` directory of a
    later step, which a save killed after its rename and before `latest` moved leaves (on the first save, with no
    `latest` at all); None when there is neither. `latest` must be the regular file a save writes, holding the name
    of a step directory of `root` (not a path, not a symbolic link): resume never follows it out of `root`."""
    newest = newest_complete(root)
    pointer = root / LATEST
    if not os.path.lexists(pointer):
        return newest
    if pointer.is_symlink() or not pointer.is_file():
        why = not_readable_as(pointer) or f"{pointer} is a symbolic link to {os.readlink(pointer)!r}"
        raise CheckpointError(
            f"{why}; `{LATEST}` is a regular file a save writes, naming a step directory beside it: remove it (the "
            "newest complete checkpoint is then found without it)"
        )
    with open(pointer, "rb") as f:
        name = f.read(64).decode(errors="replace").strip()
    if not STEP_NAME.fullmatch(name):
        raise CheckpointError(
            f"{pointer}: expected a checkpoint name such as step_00000040 (a directory beside it), found {name[:40]!r}"
        )
    target = root / name
    _no_link_out(target, root)
    if not target.is_dir():
        raise CheckpointError(f"{pointer}: names {name}, which does not exist in {root}")
    if newest is not None and step_of(newest) > step_of(target):
        return newest
    return target


def resolve(resume: str, root: Path) -> Path | None:
    """The checkpoint `trainer.resume` designates: `auto` = root's latest (None if there is none); a directory =
    that checkpoint, or the latest of a checkpoints root."""
    if resume == "auto":
        return latest(root)
    path = Path(resume)
    if path.name.startswith(TMP_PREFIX):
        raise CheckpointError(
            f"trainer.resume={resume!r} is a half-written checkpoint (a save that did not finish; its name starts with "
            f"{TMP_PREFIX!r}): resume from the checkpoint {path.parent / LATEST} names instead"
        )
    if not path.is_dir():
        raise CheckpointError(f"trainer.resume={resume!r}: no such directory")
    if not (path / META).is_file() and ((path / LATEST).is_file() or newest_complete(path) is not None):
        return latest(path)  # a checkpoints root
    return path


def check_tree(path: Path) -> None:
    """Every file of checkpoint `path` is readable as one: symbolic links are followed (a copy of a checkpoint may
    link to its files), but one to a FIFO, a device or a socket (a rank's read would block or never end), a dangling
    one and a loop are refused, naming the file."""
    seen = set()
    for folder, dirs, files in os.walk(path, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a link back to a directory already walked
            dirs[:] = []
            continue
        seen.add(real)
        for name in dirs + files:  # os.walk puts dangling links, FIFOs and devices among the files
            problem = not_readable_as(os.path.join(folder, name), want_dir=name in dirs)
            if problem is not None:
                raise CheckpointError(f"{problem} (in the checkpoint {path}, which resume reads whole)")


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json of a complete checkpoint, after checking every part is there (names the missing file)."""
    if path.is_dir():
        check_tree(path)
    meta_path = path / META
    if not meta_path.is_file():
        raise CheckpointError(
            f"{meta_path}: missing; {path} is not a training checkpoint (expected a step_* directory written by "
            f"trainer.save_every, or a checkpoints directory holding a `{LATEST}` file)"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{meta_path}: not valid JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: field 'format' is not {FORMAT!r} (not a training checkpoint)")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{meta_path}: field 'version' is {meta.get('version')!r}, this code reads {VERSION}")
    needed = [LOOP_STATE, f"{MODEL_DIR}/.metadata", f"{OPTIMIZER_DIR}/.metadata", RNG_DIR]
    if meta.get("reference"):
        needed.append(f"{REFERENCE_DIR}/.metadata")
    if meta.get("critic"):
        needed += [f"{CRITIC_DIR}/{MODEL_DIR}/.metadata", f"{CRITIC_DIR}/{OPTIMIZER_DIR}/.metadata"]
    for name in needed:
        if not (path / name).exists():
            raise CheckpointError(f"{path / name}: missing (the checkpoint is incomplete)")
    for name in needed:
        if name.endswith("/.metadata"):
            check_shard_sizes(path / name)
    read_loop_state(path)
    return meta


def read_loop_state(path: Path) -> dict[str, Any]:
    """loop_state.json of checkpoint `path` as a dict holding a `loader` dict; names the file when it is cut short
    or not one (checked before anything starts: the resume itself reads it after the ranks have loaded)."""
    file = path / LOOP_STATE
    try:
        state = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file}: not valid JSON ({err}); the checkpoint is damaged (cut short?)") from None
    if not isinstance(state, dict) or not isinstance(state.get("loader"), dict):
        raise CheckpointError(
            f"{file}: expected an object with a 'loader' object (the data position), found "
            f"{type(state).__name__} with keys {sorted(state) if isinstance(state, dict) else []}"
        )
    return state


def _dcp_storage(metadata_file: Path) -> list[tuple[str, int, int]]:
    """(file, offset, length) of every item a torch_dist `.metadata` places, read through the exact allow-list of
    torch's metadata classes (`resharding/dist_ckpt.py`: no code runs; a file naming anything else is refused, as
    the ranks would refuse it before Megatron's loader reads it)."""
    from mcore_rl.resharding.dist_ckpt import read_metadata
    from mcore_rl.resharding.hf_io import CheckpointError as ReadError

    try:
        metadata = read_metadata(metadata_file.parent)
    except ReadError as err:
        raise CheckpointError(str(err)) from None
    return [(info.relative_path, int(info.offset), int(info.length)) for info in metadata.storage_data.values()]


def check_shard_sizes(metadata_file: Path) -> None:
    """Every shard file a torch_dist `.metadata` names exists and is long enough for the bytes it places there: a
    truncated shard (an interrupted copy, a full disk) is refused before anything starts, naming the file."""
    storage = _dcp_storage(metadata_file)
    folder, ends = metadata_file.parent, {}
    for name, offset, length in storage:
        ends[name] = max(ends.get(name, 0), offset + length)
    for name, end in sorted(ends.items()):
        shard = folder / name
        if not shard.is_file():
            raise CheckpointError(f"{shard}: missing; {metadata_file} places {end} bytes in it (incomplete checkpoint)")
        size = shard.stat().st_size
        if size < end:
            raise CheckpointError(
                f"{shard}: {size} bytes, but {metadata_file} places data up to byte {end}: the file is truncated (an "
                f"interrupted copy or a full disk); copy the checkpoint again, or resume from another one"
            )


def model_identity(hf_config: dict[str, Any], dtype: str, divisible_by: int, padded_vocab: int) -> dict[str, Any]:
    """What must agree between a checkpoint and the run that resumes it."""
    return {
        "hf_config": hf_config,
        "dtype": dtype,
        "make_vocab_size_divisible_by": divisible_by,
        "padded_vocab_size": padded_vocab,
    }


def check_compatible(
    path: Path, meta: dict[str, Any], model: dict[str, Any], use_ref: bool, critic: bool = False
) -> None:
    """Refuse a checkpoint of another model, vocabulary, shape, dtype or padded vocabulary, naming the field; and one
    without the reference or critic this run needs."""
    where = path / META
    saved = meta.get("model", {})
    saved_hf, ours = saved.get("hf_config", {}), model["hf_config"]
    for key in sorted((set(saved_hf) | set(ours)) - COSMETIC_KEYS):
        if saved_hf.get(key) != ours.get(key):
            what = "another vocabulary" if key == "vocab_size" else "another model"
            raise CheckpointError(
                f"{where}: model.hf_config.{key} is {saved_hf.get(key)!r} in the checkpoint, {ours.get(key)!r} in this "
                f"run's model config ({what}); resume with the model the checkpoint was trained with"
            )
    if saved.get("dtype") != model["dtype"]:
        raise CheckpointError(
            f"{where}: model.dtype is {saved.get('dtype')!r} in the checkpoint, {model['dtype']!r} here"
        )
    if saved.get("padded_vocab_size") != model["padded_vocab_size"]:
        raise CheckpointError(
            f"{where}: padded_vocab_size is {saved.get('padded_vocab_size')} in the checkpoint (saved under "
            f"{meta.get('layout')}), this layout pads the vocabulary to {model['padded_vocab_size']} (Megatron pads "
            f"to a multiple of model.make_vocab_size_divisible_by x tp): choose model.make_vocab_size_divisible_by so "
            f"that both pad to the same size"
        )
    if use_ref and not meta.get("reference"):
        raise CheckpointError(f"{where}: the checkpoint holds no reference model, and actor.use_ref=true needs one")
    if critic and not meta.get("critic"):
        raise CheckpointError(
            f"{where}: the checkpoint holds no critic (saved by a run without critic.enable), and this run's "
            f"algorithm.adv_estimator=gae needs one; resume it with the algorithm it was trained with"
        )


# ------------------------------------------------------------------------------------------------- writing
def write_json(path: Path, data: Any) -> None:
    """Write and fsync (the directory is renamed into place only after its files are durable)."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_tree(src: Path, dst: Path) -> None:
    """Hard-link every file of `src` into `dst` (copy where the filesystem cannot link): no extra bytes."""
    for file in src.rglob("*"):
        target = dst / file.relative_to(src)
        if file.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(file, target)
        except OSError:
            shutil.copy2(file, target)


def publish(tmp: Path, root: Path, step: int, pause: Callable[[str], None] | None = None) -> Path:
    """Rename the complete `tmp` to root/step_<n>, then point `latest` at it (atomically, last). `pause(point)` is a
    test's hook into the two points between ("published", "latest"; manager.PAUSE_ENV)."""
    final = root / step_name(step)
    if final.exists():  # published by an earlier attempt that crashed before `latest` moved on: superseded
        stale = root / f"{TMP_PREFIX}stale-{final.name}-{os.getpid()}"
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(tmp, final)
    if pause is not None:
        pause("published")
    pointer = root / f"{TMP_PREFIX}{LATEST}-{os.getpid()}"
    # a killed save's leftover, or a link put there: removed, and the pointer created anew (never written through)
    pointer.unlink(missing_ok=True)
    with os.fdopen(os.open(pointer, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    if pause is not None:
        pause("latest")
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    return final


def prune(root: Path, keep_last: int | None, keep: Path) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (never `keep`) and leftover temporary directories."""
    removed = half_written(root)
    if keep_last is not None:
        published = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and step_of(p) is not None]
        published.sort(key=step_of)
        removed += [p for p in published[: max(0, len(published) - keep_last)] if p != keep]
    pointers = [p for p in root.glob(f"{TMP_PREFIX}{LATEST}-*") if p.is_file()]  # a kill while `latest` was written
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    for path in pointers:
        path.unlink(missing_ok=True)
    return removed + pointers
