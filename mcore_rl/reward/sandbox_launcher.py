"""The sandbox's first process: builds the isolation, then runs one program inside it.

`sandbox.py` starts it as `python -I -S sandbox_launcher.py STATUS_FD PARENT_PID` with an empty environment, in a
new session, with the job (JSON: program, stdin, limits, paths) on stdin. Standard library only, and nothing here
runs the program's code before the isolation is complete.

    launcher (host pid ns)  read job; open the read-only paths; root -> drop to the sandbox uid (65534)
      unshare user ns (sandbox uid 65534 mapped to the outer uid), then mount, network, IPC, UTS, pid ns
      -> init (pid 1 of the new pid ns)
           private mounts; new root = a tmpfs holding read-only binds of /usr, /lib*, the interpreter's prefix,
           a few /dev nodes, a fresh /proc and a size-capped tmpfs /tmp (the working directory); pivot_root and
           detach the old root (so no host path is reachable, unlike chroot); root remounted read-only
           -> program (pid 2): rlimits (CPU, address space, processes, file size, open files, no core),
              no_new_privs, a fresh anonymous session keyring, a seccomp filter (`seccomp_program`: no keyring,
              no memfd or SysV shared memory, no ptrace, no namespaces or mounts, ...), stdin from a memfd,
              empty environment but PATH/LANG/HOME, execve(interpreter ...)
         init reaps everything and reports the program's exit; when init exits, the kernel kills every process
         left in the pid namespace, so nothing the program started outlives it

Each sandbox has its own user namespace, so RLIMIT_NPROC counts only that sandbox's processes (the kernel keeps
process counts per user namespace and uid): parallel sandboxes cannot starve each other of processes.

Events go to STATUS_FD as JSON lines: {"event": "started"}, {"event": "exit", ...}, {"event": "refused",
"reason": ...}. A SIGTERM to the launcher kills init (and with it the namespace) and the launcher exits.
"""

import ctypes
import json
import os
import platform
import resource
import select
import signal
import sys

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
# The new mount API (Linux 5.2); these syscall numbers are the same on every architecture.
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429
AT_FDCWD, AT_RECURSIVE, OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC = -100, 0x8000, 1, 0o2000000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
# glibc has no pivot_root wrapper; the syscall number is per architecture.
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}

NAMESPACES = (  # after the user namespace, so that it owns them all
    (CLONE_NEWNS, "mount"),
    (CLONE_NEWNET, "network"),
    (CLONE_NEWIPC, "IPC"),
    (CLONE_NEWUTS, "UTS"),
    (CLONE_NEWCGROUP, "cgroup"),
    (CLONE_NEWPID, "pid"),
)
# The seccomp filter (Linux's BPF: struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}) and its return values.
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
EPERM, ENOSYS = 1, 38
KEYCTL_JOIN_SESSION_KEYRING = 1
# struct seccomp_data: nr at 0, arch at 4, args at 16 (the low 32 bits of args[0] on little-endian machines).
_NR, _ARCH, _ARG0_LO = 0, 4, 16
# Syscalls a program that computes and prints has no use for, refused with EPERM. Grouped by why:
_REFUSED = (
    # the kernel keyring is shared with the caller (its session keyring) and between sandboxes
    "keyctl", "add_key", "request_key",
    # memory that RLIMIT_AS does not count: memfds and SysV shared memory outlive their mappings, SysV message
    # queues hold up to msgmnb bytes each (the pages would escape memory_mb)
    "memfd_create", "memfd_secret", "shmget", "shmat", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl",
    # other processes' memory and descriptors
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    # namespaces and mounts: the sandbox's own must stay as built
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    # large kernel attack surface with no use here
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "fanotify_init",
    # the machine's state (refused without capabilities anyway; refused here before any permission check)
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "syslog", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "vhangup",
)  # fmt: skip
# Per architecture: the audit arch the filter insists on, and syscall numbers. clone3 answers ENOSYS (its flags sit
# behind a pointer the filter cannot read), so libc falls back to clone, whose namespace flags the filter refuses.
SECCOMP_ARCH = {
    "x86_64": (0xC000003E, {
        "keyctl": 250, "add_key": 248, "request_key": 249, "memfd_create": 319, "memfd_secret": 447,
        "shmget": 29, "shmat": 30, "shmctl": 31, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438, "unshare": 272,
        "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "fanotify_init": 300, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179,
        "syslog": 103, "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
        "vhangup": 153, "clone": 56, "clone3": 435,
    }),
    "aarch64": (0xC00000B7, {
        "keyctl": 219, "add_key": 217, "request_key": 218, "memfd_create": 279, "memfd_secret": 447,
        "shmget": 194, "shmat": 196, "shmctl": 195, "msgget": 186, "msgsnd": 189, "msgrcv": 188, "msgctl": 187,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438, "unshare": 97,
        "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "open_by_handle_at": 265, "name_to_handle_at": 264, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "fanotify_init": 262, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89, "quotactl": 60,
        "syslog": 116, "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171,
        "vhangup": 58, "clone": 220, "clone3": 435,
    }),
}  # fmt: skip
# clone's flags that make a namespace (also held off by max_user_namespaces=0 for user namespaces)
CLONE_NAMESPACE_FLAGS = 0x7E020000
SANDBOX_ID = 65534  # uid and gid inside the sandbox's user namespace ("nobody")
DEV_NODES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long  # fds and keyring ids are longs; -1 must stay -1
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


class Refused(Exception):
    """The isolation could not be built; the message says which step failed and why."""


def _call(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise Refused(f"{what} failed: [Errno {err}] {os.strerror(err)}")


def _b(path: str | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _call(libc.mount(_b(src), _b(dst), _b(fstype), flags, _b(data)), f"mount({src!r} -> {dst!r}, {fstype})")


def prctl(option: int, value: int) -> None:
    _call(libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def unshare(flag: int, name: str) -> None:
    if libc.unshare(flag) == 0:
        return
    err = ctypes.get_errno()
    hint = ""
    if flag == CLONE_NEWUSER:
        hint = (
            "; user namespaces are not allowed here (user.max_user_namespaces=0, "
            "kernel.unprivileged_userns_clone=0, or a seccomp profile such as Docker's default blocks unshare)"
        )
    raise Refused(f"cannot create a {name} namespace: unshare failed: [Errno {err}] {os.strerror(err)}{hint}")


def report(status_fd: int, **event: object) -> None:
    # One write per event, well under PIPE_BUF, so events from init and the program never interleave.
    os.write(status_fd, (json.dumps(event) + "\n").encode()[:4000])


def _locked_flags(path: str) -> int:
    """Mount flags that an unprivileged remount must keep (the kernel locks them on mounts from a parent ns)."""
    f = os.statvfs(path).f_flag
    flags = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC)):
        flags |= ms if f & st else 0
    if f & os.ST_NOATIME:
        flags |= MS_NOATIME
    elif f & os.ST_RELATIME:
        flags |= MS_RELATIME
    else:
        flags |= MS_STRICTATIME
    return flags | (MS_NODIRATIME if f & os.ST_NODIRATIME else 0)


def bind_readonly(src: str | int, dst: str) -> None:
    """Mount `src` (a path, or a detached tree from `open_paths`) on `dst`; everything under `dst` read-only."""
    if isinstance(src, int):
        _call(
            libc.syscall(SYS_MOVE_MOUNT, src, b"", AT_FDCWD, _b(dst), MOVE_MOUNT_F_EMPTY_PATH), f"move_mount({dst!r})"
        )
        os.close(src)
    else:
        mount(src, dst, None, MS_BIND | MS_REC)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].replace("\\040", " ") for line in f]
    for point in points:
        if point == dst or point.startswith(dst + "/"):
            flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | _locked_flags(point)
            mount(None, point, None, flags)


def open_paths(paths: list[str]) -> list[tuple[str, str, object]]:
    """Resolve the read-only paths while still privileged: ("link", path, target) or ("dir", path, tree or path).

    As root, each directory is cloned into a detached mount tree (open_tree), which init attaches with move_mount:
    the sandbox uid could not reach some of them by name (an interpreter under /root, mode 0700), and a bind needs
    a source in init's own mount namespace. Without root, init binds them by path.
    """
    entries: list[tuple[str, str, object]] = []
    for path in paths:
        if os.path.islink(path):
            entries.append(("link", path, os.readlink(path)))
        elif os.path.isdir(path):
            tree: object = path
            if os.geteuid() == 0:
                fd = libc.syscall(SYS_OPEN_TREE, AT_FDCWD, _b(path), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE)
                if fd < 0:
                    err = ctypes.get_errno()
                    raise Refused(f"open_tree({path!r}) failed: [Errno {err}] {os.strerror(err)}")
                tree = fd
            entries.append(("dir", path, tree))
    return entries


def build_root(job: dict, entries: list[tuple[str, str, object]]) -> None:
    """In init: new root on tmpfs with read-only binds, /dev nodes, /proc and a writable /tmp; pivot into it."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    root = "/tmp"  # any existing directory serves as the mount point of the new root (in this mount ns only)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for kind, path, ref in sorted(entries, key=lambda e: e[1]):
        dst = root + path
        if os.path.lexists(dst):  # already inside an earlier bind
            if isinstance(ref, int):
                os.close(ref)
            continue
        if kind == "link":
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(str(ref), dst)
        else:
            os.makedirs(dst)
            bind_readonly(ref, dst)  # type: ignore[arg-type]
    os.mkdir(root + "/dev")
    for name in DEV_NODES:
        open(f"{root}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1")):
        os.symlink(target, f"{root}/dev/{name}")
    os.symlink("/proc/self/fd/2", f"{root}/dev/stderr")
    os.mkdir(root + "/proc")
    try:
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except Refused:
        # The kernel refuses a new proc where the host's /proc is partly masked (some container runtimes). The
        # program then has no /proc, which Python does not need; the isolation is unchanged.
        pass
    os.mkdir(root + "/tmp")
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={job['tmpfs_bytes']},nr_inodes=4096")
    nr = SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise Refused(f"pivot_root: syscall number unknown for architecture {platform.machine()}")
    os.chdir(root)
    _call(libc.syscall(nr, b".", b"."), "pivot_root")
    _call(libc.umount2(b".", MNT_DETACH), "detaching the old root")
    os.chdir("/")
    mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    # No nested user namespaces: a program must not gain capabilities of its own, even in a namespace it made.
    if os.path.exists("/proc/sys/user/max_user_namespaces"):
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
    _call(libc.sethostname(b"sandbox", 7), "sethostname")  # the host's name stays private too


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The BPF program of the sandbox's seccomp filter for `machine` (platform.machine()); Refused if unknown.

    arch != this machine's    -> kill the process (another ABI's numbers mean other syscalls)
    x32 ABI (nr >= 2**30)     -> EPERM
    a syscall of _REFUSED     -> EPERM
    clone3                    -> ENOSYS (libc falls back to clone)
    clone with CLONE_NEW*     -> EPERM
    anything else             -> allowed
    """
    if machine not in SECCOMP_ARCH:
        raise Refused(f"no seccomp filter for architecture {machine} (known: {', '.join(SECCOMP_ARCH)})")
    audit_arch, numbers = SECCOMP_ARCH[machine]
    deny, nosys, allow = SECCOMP_RET_ERRNO | EPERM, SECCOMP_RET_ERRNO | ENOSYS, SECCOMP_RET_ALLOW
    prog = [(BPF_LD_W_ABS, 0, 0, _ARCH), (BPF_JEQ_K, 1, 0, audit_arch), (BPF_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS)]
    prog.append((BPF_LD_W_ABS, 0, 0, _NR))
    if machine == "x86_64":
        prog += [(BPF_JGE_K, 0, 1, 0x40000000), (BPF_RET_K, 0, 0, deny)]
    for name in _REFUSED:
        prog += [(BPF_JEQ_K, 0, 1, numbers[name]), (BPF_RET_K, 0, 0, deny)]
    prog += [(BPF_JEQ_K, 0, 1, numbers["clone3"]), (BPF_RET_K, 0, 0, nosys)]
    prog += [(BPF_JEQ_K, 0, 3, numbers["clone"]), (BPF_LD_W_ABS, 0, 0, _ARG0_LO)]
    prog += [(BPF_JSET_K, 0, 1, CLONE_NAMESPACE_FLAGS), (BPF_RET_K, 0, 0, deny), (BPF_RET_K, 0, 0, allow)]
    return prog


def install_seccomp(machine: str) -> None:
    """Load `seccomp_program(machine)` for this process and every process it starts (needs no_new_privs)."""

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    prog = seccomp_program(machine)
    filters = (SockFilter * len(prog))(*[SockFilter(*insn) for insn in prog])
    fprog = SockFprog(len(prog), filters)
    _call(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "installing the seccomp filter")


def join_fresh_session_keyring(machine: str) -> None:
    """Replace the session keyring inherited from the caller with a new anonymous one (defence in depth: the
    seccomp filter refuses every keyring syscall afterwards). A kernel or outer filter that refuses keyctl itself
    leaves nothing to reach, so EPERM and ENOSYS are fine."""
    nr = SECCOMP_ARCH[machine][1]["keyctl"] if machine in SECCOMP_ARCH else None
    if nr is None:
        raise Refused(f"no keyctl syscall number for architecture {machine}")
    if libc.syscall(nr, KEYCTL_JOIN_SESSION_KEYRING, None) < 0 and ctypes.get_errno() not in (EPERM, ENOSYS):
        err = ctypes.get_errno()
        raise Refused(f"cannot join a fresh session keyring: [Errno {err}] {os.strerror(err)}")


def exec_program(job: dict, status_fd: int, stdin_fd: int) -> None:
    """In the program's process (pid 2): limits, then execve. Never returns."""
    try:
        os.dup2(stdin_fd, 0)
        os.closerange(3, status_fd)
        os.closerange(status_fd + 1, 1 << 16)
        os.chdir("/tmp")
        os.umask(0o077)
        limits = job["limits"]
        for name, value in (
            ("RLIMIT_CPU", limits["cpu_s"]),
            ("RLIMIT_AS", limits["memory_bytes"]),
            ("RLIMIT_NPROC", limits["nproc"]),
            ("RLIMIT_FSIZE", limits["fsize_bytes"]),
            ("RLIMIT_NOFILE", limits["nofile"]),
            ("RLIMIT_CORE", 0),
            ("RLIMIT_MEMLOCK", 0),
            ("RLIMIT_MSGQUEUE", 0),
        ):
            # The CPU hard limit is one second above the soft one: SIGXCPU first, then SIGKILL.
            hard = value + 1 if name == "RLIMIT_CPU" else value
            resource.setrlimit(getattr(resource, name), (value, hard))
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        join_fresh_session_keyring(platform.machine())
        install_seccomp(platform.machine())  # last: nothing after it but the exec
        argv = [job["interpreter"], *job["interpreter_args"], "/tmp/main.py"]
        os.execve(job["interpreter"], argv, job["env"])
    except (OSError, Refused, ValueError) as exc:
        report(status_fd, event="refused", reason=f"cannot start the program: {exc}")
    os._exit(127)


def run_init(job: dict, status_fd: int, stdin_fd: int, entries: list, lifeline: int) -> None:
    """pid 1 of the sandbox: build the root, start the program, reap, report its exit."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the launcher killed -> init killed -> the namespace killed
    if select.select([lifeline], [], [], 0)[0]:
        os._exit(1)  # the launcher died before the line above took effect
    os.setsid()  # the program's process group no longer includes the launcher (kill(0, ...) cannot reach it)
    # pid 1 of a pid namespace gets only the signals it handles from processes inside: with no handlers left
    # (Python's SIGINT one, the launcher's SIGTERM one inherited through fork), the program cannot signal init.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    build_root(job, entries)
    with open("/tmp/main.py", "w") as f:
        f.write(job["program"])
    child = os.fork()
    if child == 0:
        exec_program(job, status_fd, stdin_fd)
    os.close(stdin_fd)
    report(status_fd, event="started")
    while True:  # reap orphans too; the program's status is the one that counts
        pid, status, usage = os.wait4(-1, 0)
        if pid == child:
            break
    cpu_s = round(usage.ru_utime + usage.ru_stime, 3)
    if os.WIFSIGNALED(status):
        report(status_fd, event="exit", exit_code=-os.WTERMSIG(status), signal=os.WTERMSIG(status), cpu_s=cpu_s)
    else:
        report(status_fd, event="exit", exit_code=os.WEXITSTATUS(status), signal=None, cpu_s=cpu_s)
    os._exit(0)


def launch(job: dict, status_fd: int, parent_pid: int) -> None:
    entries = open_paths(job["ro_paths"])
    stdin_fd = os.memfd_create("stdin")
    os.write(stdin_fd, job["stdin"].encode())
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    if os.geteuid() == 0:
        try:
            os.setgroups([])
            os.setresgid(job["gid"], job["gid"], job["gid"])
            os.setresuid(job["uid"], job["uid"], job["uid"])
        except OSError as exc:
            raise Refused(f"cannot switch from root to uid {job['uid']}: {exc}") from exc
    uid, gid = os.getuid(), os.getgid()
    # Dumpable, so that this process may write its own /proc/self/uid_map (a non-dumpable one's belongs to root);
    # only for the three writes below.
    prctl(PR_SET_DUMPABLE, 1)
    unshare(CLONE_NEWUSER, "user")
    try:
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{SANDBOX_ID} {uid} 1"),
            ("gid_map", f"{SANDBOX_ID} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as exc:
        raise Refused(f"cannot map uid {uid} into the sandbox's user namespace: {exc}") from exc
    prctl(PR_SET_DUMPABLE, 0)  # the program (same uid) must not ptrace init or read its /proc files
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # set after the credential change, which clears it
    if os.getppid() != parent_pid:
        os._exit(1)  # the caller died already
    for flag, name in NAMESPACES:
        unshare(flag, name)
    lifeline_r, lifeline_w = os.pipe()
    init_pid = 0

    def on_term(signum: int, frame: object) -> None:
        if init_pid:
            os.kill(init_pid, signal.SIGKILL)  # from the parent pid ns, so init cannot ignore it
        else:
            os._exit(1)

    signal.signal(signal.SIGTERM, on_term)
    init_pid = os.fork()
    if init_pid == 0:
        try:
            os.close(lifeline_w)
            run_init(job, status_fd, stdin_fd, entries, lifeline_r)
        except Refused as exc:
            report(status_fd, event="refused", reason=str(exc))
        except Exception as exc:
            report(status_fd, event="refused", reason=f"sandbox init failed: {type(exc).__name__}: {exc}")
        os._exit(1)
    # The launcher keeps nothing the program's output depends on: the caller sees EOF when the sandbox is gone.
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(status_fd)
    os.waitpid(init_pid, 0)


def main() -> None:
    status_fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    os.set_inheritable(status_fd, False)  # passed to us inheritable; the program must not be able to forge events
    try:
        job = json.loads(sys.stdin.buffer.read())
        launch(job, status_fd, parent_pid)
    except Refused as exc:
        report(status_fd, event="refused", reason=str(exc))
    except Exception as exc:
        report(status_fd, event="refused", reason=f"sandbox launcher failed: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
