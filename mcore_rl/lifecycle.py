"""How `python -m mcore_rl.train` starts and ends: exit codes, the FAILED marker, Ctrl-C, the watchdog.

    exit 0    the run finished; <run_dir>/summary.json written
    exit 2    any user error (unknown or `+`-added config key, bad value, missing file, bad checkpoint or dataset,
              a reward function that fails): one `config error: ...` / `error: ...` message, never a traceback
              a full disk (`error: No space left on device writing <file>`), with nothing half-written; a run dir
              that became read-only or unwritable (`error: Read-only file system writing <file>; ...`)
    exit 130  interrupted (Ctrl-C): one line saying where it stopped
    exit 143  terminated (SIGTERM: scancel, a Slurm time limit, `kill`): one line saying where it stopped; the
              engines and ranks are stopped by the run's own clean-up, as after Ctrl-C
    exit 1    a bug or an infrastructure failure: the traceback, for a report; a process the run needs that died (an
              actor rank, the router: `error: actor rank 1 (pid N) died: ...`, errors.ProcessDied, no traceback);
              also training that diverged
              (a non-finite loss or grad norm, metrics/logger.py: `error: ... step N ...`, no traceback), and a
              SystemExit from inside the run (a library's or a reward's sys.exit is not a finished run)

Every ending but success leaves <run_dir>/FAILED holding the message (written to a temporary file, then renamed; on a
full disk an empty FAILED, never a leftover temporary file), so a run dir never looks like a finished run when it is
not; a new run in the same dir removes a stale one. Before Ray starts, SIGTERM's marker is written in the signal
handler itself; ray.init then installs its own handler (sys.exit(15)), and the marker follows the run's clean-up, which
took seconds in the tests (a scheduler's SIGKILL follows SIGTERM after its grace period: Slurm's KillWait, 30 s).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import sys
import threading
import time
import traceback
import typing
from collections.abc import Callable
from typing import Any

from mcore_rl.config import ConfigError, RLConfig
from mcore_rl.controller.ray_oom import oom_message, ray_oom_kills
from mcore_rl.errors import SIGINT_SEEN, ProcessDied, Terminated, TrainingDiverged

FAILED = "FAILED"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)  # a run dir remounted read-only, or its permissions taken away
#: seconds the run's clean-up may take after SIGTERM before the driver exits 143 regardless (the watchdog then ends
#: what it started); under Slurm's default KillWait (30 s), after which SIGKILL comes
TERM_CLEANUP_S = 15.0
_EXITING = threading.Lock()
_STARTED = 0.0  # time.time() when run_guarded started: Ray OOM kills before it are another run's
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

    global _INTERNAL_EXIT, _STARTED
    _STARTED = time.time()
    run_dir = cfg.trainer.run_dir
    _clear_failed(run_dir)
    from mcore_rl import watchdog

    guard = watchdog.start(run_dir=os.path.abspath(run_dir))  # noqa: F841 - held open for the life of the driver; its end is the watchdog's signal
    _install_signal_handlers(cfg)
    try:
        summary = run(cfg)
        _atomic_write(os.path.join(run_dir, "summary.json"), json.dumps(summary))
        # again: the watchdog of an earlier driver of this run dir, killed just before this run started, may have
        # marked it after the first clearing (watchdog.mark_unfinished)
        _clear_failed(run_dir)
    except KeyboardInterrupt:
        where = _where_stopped(cfg)
        _mark_failed(run_dir, f"interrupted (Ctrl-C) {where}")
        print(f"\ninterrupted {where}; run dir {run_dir}", file=sys.stderr)
        sys.exit(130)
    except Terminated:  # the marker is already written (_install_signal_handlers)
        _exit_terminated(cfg, marked=True)
    except ProcessDied as err:  # a rank or the router was killed: which one is the news, not Ray's traceback
        _mark_failed(run_dir, f"error: {err}")
        print(f"error: {err}", file=sys.stderr)
        _INTERNAL_EXIT = True
        sys.exit(1)
    except TrainingDiverged as err:
        _mark_failed(run_dir, f"error: {err}")
        print(f"error: {err}", file=sys.stderr)
        _INTERNAL_EXIT = True
        sys.exit(1)
    except Exception as err:  # noqa: BLE001 - every ending is reported and marked
        user = _user_error(err, ray)
        # Ray still up: the run's own clean-up has not shut it down
        kills = [] if user else ray_oom_kills(since=_STARTED)
        message = f"error: {_user_message(err)}" if user else traceback.format_exc()
        if kills:  # the cause is in raylet.out alone: say it, not the traceback of what it broke
            message = f"error: {oom_message(kills)} (what it broke: {type(err).__name__}: {_first_line(err)})"
        _mark_failed(run_dir, message)
        print(message, file=sys.stderr)
        if not user:
            _INTERNAL_EXIT = True
        sys.exit(2 if user else 1)
    except BaseException as err:  # SystemExit (of a library, a reward) or GeneratorExit from inside: not a finished run
        if isinstance(err, SystemExit) and err.code == signal.SIGTERM:
            # ray.init (2.x, worker.py) replaces our SIGTERM handler with one that calls sys.exit(15)
            _exit_terminated(cfg, marked=False)
        message = f"error: the run stopped before finishing\n{traceback.format_exc()}"
        _mark_failed(run_dir, message)
        print(message, file=sys.stderr)
        _INTERNAL_EXIT = True
        sys.exit(1)


def _exit_terminated(cfg: RLConfig, marked: bool, cut_short: bool = False) -> None:
    _EXITING.acquire()  # once: the clean-up's end and TERM_CLEANUP_S's timer may both get here; the second waits
    where = _where_stopped(cfg)
    if not marked:
        _mark_failed(cfg.trainer.run_dir, f"terminated (SIGTERM) {where}")
    note = f" (the clean-up was cut short after {TERM_CLEANUP_S:.0f} s)" if cut_short else ""
    print(f"\nterminated (SIGTERM) {where}; run dir {cfg.trainer.run_dir}{note}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Not sys.exit: after a SIGTERM, Ray's atexit shutdown aborts the driver (SIGABRT, ray 2.60). The run's own
    # clean-up has stopped its engines and ranks by now, and the watchdog ends whatever the driver started.
    os._exit(128 + signal.SIGTERM)


def _install_signal_handlers(cfg: RLConfig) -> None:
    from mcore_rl import watchdog

    """SIGTERM: write the FAILED marker at once (a scheduler follows with SIGKILL after its grace period, which may
    cut the clean-up short), then raise Terminated in the main thread; a second SIGTERM during the clean-up ends the
    process (the default action). SIGINT: note it (errors.sigint_received), then Python's KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread (a test calling run_guarded from a thread)

    def on_term(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _mark_failed(cfg.trainer.run_dir, f"terminated (SIGTERM) {_where_stopped(cfg)}")
        # The clean-up goes through Ray, which hangs (60 s, then exit 1 from Ray's GCS client) when the SIGTERM went
        # to the whole process group and Ray's own processes died of it too: bound it; the watchdog ends the rest.
        timer = threading.Timer(TERM_CLEANUP_S, _exit_terminated, (cfg, True, True))
        timer.daemon = True
        timer.start()
        raise Terminated()

    def on_int(signum: int, frame: Any) -> None:
        SIGINT_SEEN.set()
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGTERM, on_term)
    watchdog.keep_sigterm_handler(on_term)  # ray.init replaces it; controller/placement.py puts it back
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # leave an ignored SIGINT ignored
        signal.signal(signal.SIGINT, on_int)


def _user_error(err: BaseException, ray: Any) -> bool:
    """Bad input: config, files, checkpoints, datasets, reward functions (raised here or inside a Ray worker)."""
    if isinstance(err, ray.exceptions.RayTaskError):
        err = err.cause if err.cause is not None else err
    if isinstance(err, OSError) and err.errno in (*_DISK_FULL, *_UNWRITABLE):
        return True
    return isinstance(err, (ConfigError, ValueError, FileNotFoundError, PermissionError, NotADirectoryError))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


def _cause(err: BaseException) -> str:
    cause = getattr(err, "cause", None)
    return str(cause) if cause is not None else str(err)


def _user_message(err: BaseException) -> str:
    """The one line for a user error; a full disk names the file and what to do."""
    cause = getattr(err, "cause", None) or err
    if isinstance(cause, OSError) and cause.errno in _DISK_FULL:
        where = f" writing {cause.filename}" if cause.filename else ""
        return f"{cause.strerror}{where}; free space there, or point trainer.run_dir at a disk with room"
    if isinstance(cause, OSError) and cause.errno in _UNWRITABLE and cause.filename:
        return (
            f"{cause.strerror} writing {cause.filename}; make it writable, or point trainer.run_dir at a writable "
            f"directory"
        )
    return _cause(err)


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
    """`text` to `path` whole or not at all: a failed write (a full disk) removes its temporary file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as err:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if err.filename is None:  # a write or close error names no file: name the one meant
            raise OSError(err.errno, err.strerror, path) from None
        raise


def _mark_failed(run_dir: str, message: str) -> None:
    if not os.path.isdir(run_dir):
        return
    path = os.path.join(run_dir, FAILED)
    try:
        _atomic_write(path, message.rstrip() + "\n")
    except OSError:
        try:  # a full disk still has room for an empty file (an inode, no data block): the run dir is marked
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        except OSError:
            pass  # an unwritable run dir is itself the error being reported


def _clear_failed(run_dir: str) -> None:
    try:
        os.remove(os.path.join(run_dir, FAILED))
    except OSError:
        pass
