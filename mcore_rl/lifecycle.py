"""How `python -m mcore_rl.train` starts and ends: exit codes, the FAILED marker, Ctrl-C, the watchdog.

    exit 0    the run finished; <run_dir>/summary.json written
    exit 2    any user error (unknown or `+`-added config key, bad value, missing file, bad checkpoint or dataset,
              a reward function that fails): one `config error: ...` / `error: ...` message, never a traceback
    exit 130  interrupted (Ctrl-C): one line saying where it stopped
    exit 1    a bug or an infrastructure failure: the traceback, for a report

Every ending but success leaves <run_dir>/FAILED holding the message (written to a temporary file, then renamed), so a
run dir never looks like a finished run when it is not; a new run in the same dir removes a stale one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
import typing
from collections.abc import Callable
from typing import Any

from mcore_rl.config import ConfigError, RLConfig

FAILED = "FAILED"
_INTERNAL_EXIT = False  # set when exit 1 is ours (a bug), so Hydra's own exit 1 (bad override) can become 2


def unknown_override(arg: str) -> str | None:
    """Why a command-line override names no field of the schema (None when it does or is not a config key)."""
    if arg.startswith("-") or "=" not in arg:
        return None
    key = arg.split("=", 1)[0].lstrip("~")
    plus = key.startswith("+") and not key.startswith("++")
    key = key.lstrip("+")
    if key.startswith(("hydra.", "hydra/")) or key == "hydra":
        return None
    node: Any = RLConfig
    path = []
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else None
        if fields is None:
            return None  # below a free-form dict field (model.hf_config): any key is allowed
        if part not in fields:
            where = ".".join(path) or "the config"
            hint = " ('+' adds keys; this schema has a fixed set)" if plus else ""
            return f"unknown key {key!r}{hint}: {where} has no field {part!r}; expected one of {sorted(fields)}"
        path.append(part)
        hints = typing.get_type_hints(node)
        node = hints[part]
        node = next((a for a in typing.get_args(node) if dataclasses.is_dataclass(a)), node)
    return None


def cli(main: Callable[[], None], argv: list[str] | None = None) -> None:
    """Run Hydra's `main` after refusing unknown keys by name; Hydra's own composition errors exit 2, not 1."""
    global _INTERNAL_EXIT
    for arg in sys.argv[1:] if argv is None else argv:
        reason = unknown_override(arg)
        if reason:
            print(f"config error: {reason}", file=sys.stderr)
            sys.exit(2)
    try:
        main()
    except SystemExit as done:
        if done.code == 1 and not _INTERNAL_EXIT:  # Hydra printed an override/composition error: user input
            sys.exit(2)
        raise


def run_guarded(cfg: RLConfig, run: Callable[[RLConfig], dict[str, float]]) -> None:
    """Run the job with the exit codes of the module docstring; writes summary.json or FAILED."""
    import ray

    global _INTERNAL_EXIT
    run_dir = cfg.trainer.run_dir
    _clear_failed(run_dir)
    from mcore_rl import watchdog

    guard = watchdog.start()  # noqa: F841 - held open for the life of the driver; its end is the watchdog's signal
    try:
        summary = run(cfg)
    except KeyboardInterrupt:
        where = _where_stopped(cfg)
        _mark_failed(run_dir, f"interrupted (Ctrl-C) {where}")
        print(f"\ninterrupted {where}; run dir {run_dir}", file=sys.stderr)
        sys.exit(130)
    except Exception as err:  # noqa: BLE001 - every ending is reported and marked
        user = _user_error(err, ray)
        message = f"error: {_cause(err)}" if user else traceback.format_exc()
        _mark_failed(run_dir, message)
        print(message, file=sys.stderr)
        if not user:
            _INTERNAL_EXIT = True
        sys.exit(2 if user else 1)
    _atomic_write(os.path.join(run_dir, "summary.json"), json.dumps(summary))


def _user_error(err: BaseException, ray: Any) -> bool:
    """Bad input: config, files, checkpoints, datasets, reward functions (raised here or inside a Ray worker)."""
    if isinstance(err, ray.exceptions.RayTaskError):
        err = err.cause if err.cause is not None else err
    return isinstance(err, (ConfigError, ValueError, FileNotFoundError, PermissionError, NotADirectoryError))


def _cause(err: BaseException) -> str:
    cause = getattr(err, "cause", None)
    return str(cause) if cause is not None else str(err)


def _where_stopped(cfg: RLConfig) -> str:
    path = os.path.join(cfg.trainer.run_dir, "metrics.jsonl")
    step = 0
    try:
        with open(path) as f:
            lines = [line for line in f if line.strip()]
        if lines:
            step = int(json.loads(lines[-1]).get("step", len(lines)))
    except (OSError, ValueError):
        pass
    return f"after step {step} of {cfg.trainer.steps}" + (f" (metrics in {path})" if step else " (no step finished)")


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _mark_failed(run_dir: str, message: str) -> None:
    try:
        if os.path.isdir(run_dir):
            _atomic_write(os.path.join(run_dir, FAILED), message.rstrip() + "\n")
    except OSError:
        pass  # an unwritable run dir is itself the error being reported


def _clear_failed(run_dir: str) -> None:
    try:
        os.remove(os.path.join(run_dir, FAILED))
    except OSError:
        pass
