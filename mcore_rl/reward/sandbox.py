"""Run untrusted generated code in a sandbox: one isolated process tree per program, many in parallel.

    Sandbox.run(program, stdin)
      -> sandbox_launcher.py in a new session (empty environment; the job on its stdin)
         user + mount + network + IPC + UTS + pid namespaces; new read-only root; rlimits; sandbox uid
      -> read stdout/stderr incrementally (capped) and the launcher's status events, until the deadline
      -> SandboxResult(status ok | error | timeout | memory | output_limit | refused, exit_code, stdout, stderr, reason)

What the program gets (each property tested by tests/test_sandbox.py; `Sandbox.check()` re-checks the uid, pid,
network, read-only root and environment from inside a probe program before a run relies on them):
- no network: its own network namespace, with only a loopback that is down (every connect fails at once);
- no host files: a new root holding read-only binds of /usr, /lib*, /bin and the interpreter's prefix, a fresh
  /proc of its own pid namespace, a few /dev nodes, and a size-capped tmpfs /tmp as its working directory; the old
  root is detached (pivot_root), so nothing else of the host is reachable, and nothing it writes outlives it;
- uid 65534 in its own user namespace (mapped to host uid 65534 when the caller is root), no capabilities,
  no_new_privs, no nested user namespaces;
- rlimits: CPU time, address space, processes (counted per sandbox: each has its own user namespace), file size,
  open files, no core dumps; an environment of PATH, LANG, HOME and TMPDIR only;
- a wall-clock timeout: the launcher kills the sandbox's pid-1 init, and the kernel then kills every process in
  the pid namespace (a process that left the process group with setsid included); the caller then kills the
  launcher's process group;
- stdout and stderr each capped at `max_output_bytes` (the sandbox is killed when one goes over).

- no kernel keyring: a fresh anonymous session keyring, and a seccomp filter that refuses every keyring syscall
  (and memfds, SysV shared memory and message queues, ptrace, namespaces and mounts, bpf, io_uring, ...: the list
  and its reasons are in sandbox_launcher.py).

Memory is bounded per process (RLIMIT_AS), so one sandbox can use up to (max_processes + 1) * memory_mb, plus
tmpfs_mb of files in /tmp, plus pipe buffers (at most max_open_files of them). Memory that no address space counts
(memfds, SysV shared memory and message queues) is refused by the filter. A cgroup would bound the total, but this
module does not create cgroups.

A machine that cannot provide the isolation (no user namespaces, e.g. under Docker's default seccomp profile)
gets `SandboxUnavailable` from `Sandbox.check()` naming the step that failed, and `run` answers status "refused":
code is never run unconfined.

CLI, running one program the way the code reward does (prints one JSON object; exit 0 when the sandbox worked,
1 when it refused, 2 on bad arguments):

    python -m mcore_rl.reward.sandbox FILE [--stdin FILE] [--timeout S] [--memory-mb M]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import NamedTuple, Protocol

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
DEFAULT_RO_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "refused")
PROGRAM_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "TMPDIR": "/tmp"}
# Processes of the sandbox's own uid that are not the program's: the launcher and init (plus one spare for the
# kernel's count, which includes the forking process). Measured: with RLIMIT_NPROC = n the program can fork n - 3.
_LAUNCHER_PROCESSES = 3
MAX_MEMORY_MB = 1 << 20  #: 1 TiB per process: more is no bound at all (RLIMIT_AS as good as off)
MAX_TIMEOUT_S = 86400.0  #: one day: a longer wall clock is no bound (and its CPU limit would overflow)
_DRAIN_S = 2.0  # after a kill: how long to wait for the namespace to die and the pipes to close


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be created here; the message names what is missing."""


@dataclass
class SandboxConfig:
    """Limits and paths of one sandboxed run."""

    timeout_s: float = 10.0
    """Wall-clock limit of the program, from its start (sandbox set-up not included)."""
    cpu_s: int | None = None
    """CPU-time limit (RLIMIT_CPU) per process; None: ceil(timeout_s) + 1, so the wall clock usually fires first."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS) of each process, in MiB."""
    max_processes: int = 4
    """Processes and threads the program may create besides itself (RLIMIT_NPROC, counted per sandbox)."""
    max_output_bytes: int = 8 << 20
    """Cap on each of stdout and stderr; a program that writes more is killed (status "output_limit")."""
    max_file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE), in MiB."""
    tmpfs_mb: int = 64
    """Size of the writable /tmp (the working directory), in MiB; it lives in memory and dies with the sandbox."""
    max_open_files: int = 64
    """RLIMIT_NOFILE of the program."""
    interpreter: str = field(default_factory=lambda: os.path.realpath(sys.executable))
    """Python that runs the program (its prefix is bound read-only into the sandbox)."""
    interpreter_args: tuple[str, ...] = ("-I", "-S")
    """Flags before the program's path: isolated mode, no site-packages."""
    extra_ro_paths: tuple[str, ...] = ()
    """Host directories to bind read-only besides /usr, /lib*, /bin and the interpreter's prefix."""
    sandbox_uid: int = 65534
    """Host uid (and gid) the sandbox runs as when the caller is root; otherwise the caller's own uid."""
    setup_timeout_s: float = 10.0
    """Limit on building the sandbox before the program starts; past it the run is "refused"."""

    def __post_init__(self) -> None:
        positive = ("timeout_s", "memory_mb", "max_output_bytes", "max_file_mb", "tmpfs_mb", "setup_timeout_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("timeout_s", "setup_timeout_s"):
            if not getattr(self, name) <= MAX_TIMEOUT_S:  # also catches inf
                raise ValueError(f"SandboxConfig.{name} must be finite, at most {MAX_TIMEOUT_S:g} s, "
                                 f"got {getattr(self, name)!r}")  # fmt: skip
        if self.memory_mb > MAX_MEMORY_MB:
            raise ValueError(f"SandboxConfig.memory_mb must be at most {MAX_MEMORY_MB}, got {self.memory_mb!r}")
        if self.cpu_s is not None and self.cpu_s < 1:
            raise ValueError(f"SandboxConfig.cpu_s must be >= 1 or None, got {self.cpu_s!r}")
        if self.max_processes < 0:
            raise ValueError(f"SandboxConfig.max_processes must be >= 0, got {self.max_processes!r}")
        if self.max_open_files < 8:
            raise ValueError(f"SandboxConfig.max_open_files must be >= 8, got {self.max_open_files!r}")
        if not os.path.isabs(self.interpreter):
            raise ValueError(f"SandboxConfig.interpreter must be an absolute path, got {self.interpreter!r}")

    def cpu_limit_s(self, timeout_s: float) -> int:
        """RLIMIT_CPU for a run with this wall-clock limit."""
        return self.cpu_s if self.cpu_s is not None else math.ceil(timeout_s) + 1

    def ro_paths(self) -> list[str]:
        """The host paths bound read-only: defaults, the interpreter's prefix, then `extra_ro_paths`."""
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(self.interpreter)))
        return [*DEFAULT_RO_PATHS, prefix, *self.extra_ro_paths]


@dataclass
class SandboxResult:
    """What one run did. `reason` says in a sentence why the status is what it is."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    reason: str
    wall_s: float = 0.0
    cpu_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class SandboxJob(NamedTuple):
    """One program to run: source, its stdin, and an optional timeout overriding the runner's."""

    program: str
    stdin: str = ""
    timeout_s: float | None = None


class CodeRunner(Protocol):
    """Runs one program in isolation; `Sandbox` (local) and `SandboxFusionRunner` (remote) implement it."""

    def run(self, program: str, stdin: str = "", timeout_s: float | None = None) -> SandboxResult: ...


_PROBE = """import json, os, socket
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1).close(); network = "reachable"
except OSError as exc:
    network = str(exc)
try:
    open("/probe", "w").close(); root = "writable"
except OSError:
    root = "read-only"
try:
    seccomp = dict(line.split(":", 1) for line in open("/proc/self/status"))["Seccomp"].strip()
except OSError:
    seccomp = "2"  # no /proc in this sandbox (a partly masked host /proc): the filter's refusals still hold
print(json.dumps({"uid": os.getuid(), "pid": os.getpid(), "network": network, "root": root,
                  "parent_env": sorted(os.environ), "seccomp": seccomp}))
"""


class Sandbox:
    """Runs Python programs one at a time in fresh sandboxes (thread-safe: use `SandboxPool` for many at once)."""

    _probed: dict[tuple, str | None] = {}  # probe key -> None when usable, else what is missing
    _probe_lock = threading.Lock()

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()

    def check(self) -> None:
        """Prove once per process (and configuration) that the isolation works; raise `SandboxUnavailable` if not.

        Runs a probe program and checks from inside: the sandbox uid, pid 1's child, no network, a read-only
        root, an environment of PROGRAM_ENV only, the seccomp filter on. The message names the failing step or property.
        """
        key = (self.config.interpreter, self.config.interpreter_args, tuple(self.config.ro_paths()))
        with self._probe_lock:
            if key not in self._probed:
                self._probed[key] = self._probe()
            problem = self._probed[key]
        if problem is not None:
            raise SandboxUnavailable(f"cannot sandbox generated code on this machine: {problem}")

    def _probe(self) -> str | None:
        if not sys.platform.startswith("linux"):
            return f"it needs Linux namespaces, and this platform is {sys.platform}"
        if not os.access(self.config.interpreter, os.X_OK):
            return f"interpreter {self.config.interpreter} is not an executable file"
        result = self.run(_PROBE, timeout_s=max(10.0, self.config.timeout_s))
        if result.status != "ok":
            return f"probe run {result.status}: {result.reason}"
        try:
            seen = json.loads(result.stdout)
        except json.JSONDecodeError:
            return f"probe printed {result.stdout[:200]!r}, not JSON"
        expected = {"uid": 65534, "pid": 2, "root": "read-only", "parent_env": sorted(PROGRAM_ENV), "seccomp": "2"}
        wrong = [f"{k}={seen.get(k)!r} (expected {v!r})" for k, v in expected.items() if seen.get(k) != v]
        if "unreachable" not in seen.get("network", ""):
            wrong.append(f"network: connecting to 127.0.0.1 gave {seen.get('network')!r}, not 'unreachable'")
        return "probe saw " + "; ".join(wrong) if wrong else None

    def _job(self, program: str, stdin: str, timeout_s: float) -> dict:
        c = self.config
        return {
            "program": program,
            "stdin": stdin,
            "interpreter": c.interpreter,
            "interpreter_args": list(c.interpreter_args),
            "ro_paths": c.ro_paths(),
            "uid": c.sandbox_uid,
            "gid": c.sandbox_uid,
            "env": PROGRAM_ENV,
            "tmpfs_bytes": c.tmpfs_mb << 20,
            "limits": {
                "cpu_s": c.cpu_limit_s(timeout_s),
                "memory_bytes": c.memory_mb << 20,
                "nproc": c.max_processes + _LAUNCHER_PROCESSES,
                "fsize_bytes": c.max_file_mb << 20,
                "nofile": c.max_open_files,
            },
        }

    def run(self, program: str, stdin: str = "", timeout_s: float | None = None) -> SandboxResult:
        """Run `program` (Python source) with `stdin`; never raises for anything the program does."""
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        job = self._job(program, stdin, timeout_s)
        start = time.monotonic()
        status_r, status_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", LAUNCHER, str(status_w), str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                env={},  # nothing of the trainer's environment reaches the launcher, let alone the program
                cwd="/",
                start_new_session=True,  # its own process group, killed as a whole at the end
            )
        except OSError as exc:
            os.close(status_r)
            return SandboxResult("refused", None, "", "", f"cannot start the sandbox launcher: {exc}")
        finally:
            os.close(status_w)
        try:
            run = _Supervisor(proc, status_r, json.dumps(job).encode(), self.config, timeout_s).supervise()
        finally:
            os.close(status_r)
        run.wall_s = round(time.monotonic() - start, 3)
        return run


class _Supervisor:
    """Feeds the job to one launcher, collects its output and events, enforces the deadline and output cap."""

    def __init__(
        self, proc: subprocess.Popen, status_r: int, job: bytes, config: SandboxConfig, timeout_s: float
    ) -> None:
        self.proc, self.status_r, self.job, self.config, self.timeout_s = proc, status_r, job, config, timeout_s
        self.out = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
        self.killed_for: str | None = None  # "timeout" | "setup" | "stdout" | "stderr"

    def supervise(self) -> SandboxResult:
        proc, sel = self.proc, selectors.DefaultSelector()
        names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", self.status_r: "status"}
        for fd in names:
            sel.register(fd, selectors.EVENT_READ)
        stdin_fd = proc.stdin.fileno()
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
        sent = 0
        deadline = time.monotonic() + self.config.setup_timeout_s
        started = False
        try:
            while sel.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if self.killed_for is not None:
                        break  # killed and drained as long as we wait: give up on the rest of the output
                    self._kill("timeout" if started else "setup")
                    deadline = time.monotonic() + _DRAIN_S
                    continue
                for key, _ in sel.select(remaining):
                    fd = key.fd
                    if fd == stdin_fd:
                        try:
                            sent += os.write(fd, self.job[sent : sent + 65536])
                        except BrokenPipeError:
                            sent = len(self.job)  # the launcher died; its status (or silence) says why
                        if sent >= len(self.job):
                            sel.unregister(fd)
                            proc.stdin.close()
                        continue
                    data = os.read(fd, 65536)
                    if not data:
                        sel.unregister(fd)
                        continue
                    name = names[fd]
                    buf = self.out[name]
                    cap = self.config.max_output_bytes if name != "status" else 1 << 20
                    buf += data[: max(0, cap + 1 - len(buf))]  # keep reading past the cap, so the pipe never blocks
                    if name == "status" and not started and b'"started"' in buf:
                        started = True
                        if self.killed_for is None:
                            deadline = time.monotonic() + self.timeout_s
                    if len(buf) > cap and self.killed_for is None:
                        self._kill(name)
                        deadline = time.monotonic() + _DRAIN_S
        finally:
            sel.close()
            self._reap()
        return self._result()

    def _kill(self, why: str) -> None:
        """Ask the launcher to kill the sandbox's init (which takes the whole pid namespace down)."""
        self.killed_for = why
        try:
            os.kill(self.proc.pid, signal.SIGTERM)  # not proc.send_signal: that may reap, freeing the pid for reuse
        except ProcessLookupError:
            pass

    def _reap(self) -> None:
        """Wait for the launcher to exit without reaping it, kill what is left of its process group, then reap.

        Killing the group before reaping matters: once reaped, the launcher's pid (= the group id) may be reused.
        """
        deadline = time.monotonic() + _DRAIN_S
        while time.monotonic() < deadline:
            try:
                if os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    break
            except ChildProcessError:  # reaped behind our back (a caller that set SIGCHLD to SIG_IGN)
                break
            time.sleep(0.005)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()

    def _result(self) -> SandboxResult:
        cap = self.config.max_output_bytes
        stdout = bytes(self.out["stdout"][:cap]).decode(errors="replace")
        stderr = bytes(self.out["stderr"][:cap]).decode(errors="replace")
        events = []
        for line in bytes(self.out["status"]).decode(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        refused = next((e for e in events if e.get("event") == "refused"), None)
        exited = next((e for e in events if e.get("event") == "exit"), None)
        code = exited["exit_code"] if exited else None
        cpu_s = exited.get("cpu_s") if exited else None

        def result(status: str, reason: str) -> SandboxResult:
            return SandboxResult(status, code, stdout, stderr, reason, cpu_s=cpu_s)

        if self.killed_for in ("stdout", "stderr"):
            return result("output_limit", f"{self.killed_for} exceeded {cap} bytes; the sandbox was killed")
        if self.killed_for == "timeout":
            return result("timeout", f"still running after the {self.timeout_s:g} s wall-clock limit; killed")
        if self.killed_for == "setup":
            return result("refused", f"the sandbox was not ready within {self.config.setup_timeout_s:g} s")
        if refused is not None:
            return result("refused", refused.get("reason", "sandbox set-up failed"))
        if exited is None:
            tail = stderr.strip()[-500:] or "no output"
            return result("refused", f"the sandbox launcher exited ({self.proc.returncode}) without a report: {tail}")
        return result(*_classify(exited, stderr, self.config, self.timeout_s))


def last_line(text: str) -> str:
    """The last non-blank line of `text` (a traceback's exception line), at most 300 characters."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


def _classify(exited: dict, stderr: str, config: SandboxConfig, timeout_s: float) -> tuple[str, str]:
    """(status, reason) of a program that ran to its end."""
    code, sig, cpu_s = exited["exit_code"], exited.get("signal"), exited.get("cpu_s") or 0.0
    cpu_limit = config.cpu_limit_s(timeout_s)
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= cpu_limit):
        return "timeout", f"CPU-time limit of {cpu_limit} s exceeded ({signal.Signals(sig).name})"
    if code == 0:
        return "ok", "exited 0"
    last = last_line(stderr)
    if "MemoryError" in last or "Cannot allocate memory" in last:
        return "memory", f"memory limit of {config.memory_mb} MiB exceeded: {last}"
    if sig:
        return "error", f"killed by signal {signal.Signals(sig).name}" + (f" after: {last}" if last else "")
    hint = ""
    if "Resource temporarily unavailable" in last:
        hint = f" (the limit of {config.max_processes} extra processes/threads was reached)"
    return "error", f"exited {code}: {last or 'no stderr'}{hint}"


class SandboxPool:
    """Runs many programs concurrently, at most `max_workers` at a time (each is its own sandbox)."""

    def __init__(self, runner: CodeRunner, max_workers: int = 4) -> None:
        if max_workers < 1:
            raise ValueError(f"SandboxPool.max_workers must be >= 1, got {max_workers}")
        self.runner = runner
        self.max_workers = max_workers
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sandbox")

    def run_many(self, jobs: Sequence[SandboxJob]) -> list[SandboxResult]:
        """Results in the order of `jobs`."""
        futures = [self._executor.submit(self.runner.run, *job) for job in jobs]
        return [future.result() for future in futures]

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _timeout_arg(text: str) -> float:
    """argparse type of --timeout: a finite number of seconds in (0, MAX_TIMEOUT_S]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"expected a finite number of seconds > 0 and at most {MAX_TIMEOUT_S:g}, got {text}"
        )
    return value


def _memory_arg(text: str) -> int:
    """argparse type of --memory-mb: an integer number of MiB in [1, MAX_MEMORY_MB]."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_MEMORY_MB:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_MEMORY_MB} MiB, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mcore_rl.reward.sandbox",
        description="Run one Python program in the sandbox the code reward uses; print the result as JSON.",
    )
    parser.add_argument("file", metavar="FILE", help="the Python program to run")
    parser.add_argument("--stdin", metavar="FILE", help="file whose contents become the program's stdin")
    parser.add_argument(
        "--timeout", type=_timeout_arg, default=SandboxConfig.timeout_s, metavar="S", help="wall clock, s"
    )
    parser.add_argument(
        "--memory-mb", type=_memory_arg, default=SandboxConfig.memory_mb, metavar="M", help="per process"
    )
    args = parser.parse_args(argv)
    for path in (args.file, args.stdin):
        if path is not None and not os.path.isfile(path):
            parser.error(f"file not found: {path}")
    try:
        config = SandboxConfig(timeout_s=args.timeout, memory_mb=args.memory_mb)
    except ValueError as exc:
        parser.error(str(exc))
    with open(args.file, encoding="utf-8", errors="replace") as f:
        program = f.read()
    stdin = ""
    if args.stdin is not None:
        with open(args.stdin, encoding="utf-8", errors="replace") as f:
            stdin = f.read()
    result = Sandbox(config).run(program, stdin)
    print(json.dumps(result.to_dict()))
    return 1 if result.status == "refused" else 0


if __name__ == "__main__":
    sys.exit(main())
