"""The sandbox against the kernel's shared objects: the caller's keyring, memory held outside the address space
(memfd, SysV shared memory), the seccomp filter, and the CLI's bounds on its limits.

Each test runs a real sandboxed program (no mocks). Tests that need the sandbox skip, with the reason, on a machine
that cannot provide it; the keyring test skips where the test process itself cannot use keyctl.

Run: `.venv/bin/pytest tests/test_sandbox_kernel.py`
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
import textwrap
import uuid

import pytest

from mcore_rl.reward.sandbox import MAX_MEMORY_MB, Sandbox, SandboxConfig, SandboxUnavailable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYS_ADD_KEY = {"x86_64": 248, "aarch64": 217}.get(platform.machine())
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(platform.machine())
KEY_SPEC_SESSION_KEYRING = -3
KEYCTL_READ = 11


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    box = Sandbox(SandboxConfig(timeout_s=20.0, memory_mb=64, max_processes=8))
    try:
        box.check()
    except SandboxUnavailable as exc:
        pytest.skip(f"this machine cannot isolate generated code (the sandbox refuses to run unconfined): {exc}")
    return box


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _read_key(key_id: int) -> bytes:
    libc, buf = _libc(), ctypes.create_string_buffer(256)
    n = libc.syscall(SYS_KEYCTL, KEYCTL_READ, ctypes.c_long(key_id), buf, ctypes.c_long(256))
    assert n >= 0, os.strerror(ctypes.get_errno())
    return buf.raw[:n]


def test_callers_keyring_can_be_neither_read_nor_changed(sandbox) -> None:
    """A secret in the caller's session keyring: the program cannot read it, replace it, or add a key of its own."""
    if SYS_KEYCTL is None:
        pytest.skip(f"keyctl syscall numbers unknown for {platform.machine()}")
    libc = _libc()
    secret = f"secret-{uuid.uuid4().hex}".encode()
    key_id = libc.syscall(
        SYS_ADD_KEY, b"user", b"h6-test", secret, ctypes.c_size_t(len(secret)), ctypes.c_long(KEY_SPEC_SESSION_KEYRING)
    )
    if key_id < 0:
        pytest.skip(f"this process cannot use its session keyring: {os.strerror(ctypes.get_errno())}")
    try:
        program = f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        buf = ctypes.create_string_buffer(256)
        n = libc.syscall({SYS_KEYCTL}, {KEYCTL_READ}, ctypes.c_long({key_id}), buf, ctypes.c_long(256))
        print("read", n, ctypes.get_errno(), buf.raw[:max(n, 0)])
        new = b"overwritten"
        n = libc.syscall({SYS_KEYCTL}, 2, ctypes.c_long({key_id}), new, ctypes.c_size_t(len(new)))
        print("update", n, ctypes.get_errno())
        n = libc.syscall({SYS_ADD_KEY}, b"user", b"mine", b"x", ctypes.c_size_t(1), ctypes.c_long(-3))
        print("add", n, ctypes.get_errno())
        """
        result = sandbox.run(textwrap.dedent(program))
        assert result.status == "ok", result
        assert secret.decode() not in result.stdout
        lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
        for what in ("read", "update", "add"):
            assert lines[what].split()[0] == "-1", f"{what} succeeded inside the sandbox: {result.stdout}"
        assert _read_key(key_id) == secret
    finally:
        libc.syscall(SYS_KEYCTL, 21, ctypes.c_long(key_id))  # KEYCTL_INVALIDATE


def test_seccomp_filter_is_on_and_ordinary_programs_still_work(sandbox) -> None:
    """The program runs under a seccomp filter (mode 2) and still gets threads, subprocesses and its /tmp."""
    program = """
    import subprocess, sys, threading
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    t = threading.Thread(target=print, args=("thread",)); t.start(); t.join()
    out = subprocess.run([sys.executable, "-I", "-S", "-c", "print('child')"], capture_output=True, text=True)
    open("/tmp/x", "w").write("file")
    print(status["Seccomp"].strip(), out.stdout.strip(), open("/tmp/x").read())
    """
    result = sandbox.run(textwrap.dedent(program))
    assert result.status == "ok", result
    assert result.stdout.splitlines() == ["thread", "2 child file"]


def test_memfd_cannot_hold_memory_beyond_the_bound(sandbox) -> None:
    """memory_mb=64: pages of a memfd are not counted by RLIMIT_AS (and RLIMIT_FSIZE bounds each memfd, not their
    sum), so 20 memfds of 8 MiB would hold 160 MiB: memfd_create is refused outright."""
    program = """
    import os
    fds, chunk = [], b"x" * (1 << 20)
    for _ in range(20):
        fds.append(os.memfd_create("hog"))
        for _ in range(8):
            os.write(fds[-1], chunk)
    print("held", sum(os.fstat(fd).st_size for fd in fds) >> 20, "MiB")
    """
    result = sandbox.run(textwrap.dedent(program))
    assert "held" not in result.stdout, result
    assert result.status == "error" and "PermissionError" in result.reason, result


def test_sysv_shared_memory_cannot_hold_memory_beyond_the_bound(sandbox) -> None:
    """A detached SysV segment keeps its pages outside every address space: shmget is refused."""
    program = """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    shmid = libc.shmget(0, 160 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    print("shmget", shmid, ctypes.get_errno())
    """
    result = sandbox.run(textwrap.dedent(program))
    assert result.status == "ok", result
    assert result.stdout.split()[:2] == ["shmget", "-1"], result.stdout


def _cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mcore_rl.reward.sandbox", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--timeout", "inf", "--timeout: expected a finite number of seconds > 0 and at most 86400, got inf"),
        ("--timeout", "nan", "--timeout: expected a finite number of seconds > 0 and at most 86400, got nan"),
        ("--memory-mb", "99999999999", f"--memory-mb: expected 1 to {MAX_MEMORY_MB} MiB, got 99999999999"),
    ],
)
def test_cli_refuses_unbounded_limits(tmp_path, flag: str, value: str, message: str) -> None:
    """Exit 2 with one line naming the flag, no traceback, and the program never runs."""
    marker = tmp_path / "ran"
    program = tmp_path / "p.py"
    program.write_text(f"open({str(marker)!r}, 'w').close()")
    done = _cli(str(program), flag, value)
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr
    assert message in done.stderr.strip().splitlines()[-1]
    assert not marker.exists()


def test_config_bounds_memory() -> None:
    with pytest.raises(ValueError, match=rf"SandboxConfig.memory_mb must be at most {MAX_MEMORY_MB}"):
        SandboxConfig(memory_mb=MAX_MEMORY_MB + 1)
    with pytest.raises(ValueError, match=r"SandboxConfig.timeout_s must be finite, at most 86400 s, got inf"):
        SandboxConfig(timeout_s=float("inf"))
