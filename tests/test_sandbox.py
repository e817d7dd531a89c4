"""The code sandbox and the code reward: normal programs, hostile programs, the pool, the reward, the CLI, refusal.

Every hostile program runs under tight limits (2-3 s, 256 MiB, 8 extra processes) and the tests check that
nothing escapes: no file appears on the host, no process of the sandbox uid survives, the test process lives on.
The SandboxFusion backend is tested against a tiny aiohttp fake on loopback that answers the documented
/run_code response shape (the real service cannot run here); it never executes the code it is sent.
Tests that need the sandbox skip, with the reason, on a machine that cannot provide it.

Run: `.venv/bin/pytest tests/test_sandbox.py`
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import platform
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
from aiohttp import web

from mcore_rl.reward.code_reward import CodeReward, SandboxFusionRunner, code_compute_score, extract_code
from mcore_rl.reward.loader import BUILTIN_REWARDS, default_compute_score
from mcore_rl.reward.manager import RewardManager
from mcore_rl.reward.sandbox import (
    PROGRAM_ENV,
    Sandbox,
    SandboxConfig,
    SandboxJob,
    SandboxPool,
    SandboxUnavailable,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = dict(timeout_s=3.0, memory_mb=256, max_processes=8, max_output_bytes=1 << 20)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    box = Sandbox(SandboxConfig(**LIMITS))
    try:
        box.check()
    except SandboxUnavailable as exc:
        pytest.skip(f"this machine cannot isolate generated code (the sandbox refuses to run unconfined): {exc}")
    return box


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _another_process_owns(pid: int) -> bool:
    """True when `pid` descends from another test process running at the same time (pytest-xdist's other worker),
    not from this one: its parent chain meets ours first at a common ancestor (the xdist controller), not at this
    process. A process this one left behind leads here; an escaped one is an orphan (its chain ends at init)."""
    ours, p = [], os.getpid()
    while p > 1 and len(ours) < 64:
        ours.append(p)
        p = _parent(p)
    for _ in range(64):
        pid = _parent(pid)
        if pid <= 1 or pid == ours[0]:
            return False
        if pid in ours:
            return True
    return False


def sandbox_processes() -> set[str]:
    """Processes of the sandbox's host uid that a sandbox left, via ps: its launcher, or anything in a pid
    namespace other than ours (init, the program and whatever it started); not those of another test process."""
    uid = 65534 if os.geteuid() == 0 else os.getuid()
    own_ns = os.readlink("/proc/self/ns/pid").strip("pid:[]")
    out = subprocess.run(["ps", "-u", str(uid), "-o", "pid=,pidns=,stat=,args="], capture_output=True, text=True)
    lines = [line.strip() for line in out.stdout.splitlines()]
    return {
        line
        for line in lines
        if (line.split()[1] != own_ns or "sandbox_launcher" in line) and not _another_process_owns(int(line.split()[0]))
    }


@pytest.fixture()
def no_escape(sandbox):
    """Asserts after the test that no process of any sandbox is left behind (compared with before the test)."""
    before = sandbox_processes()
    yield
    assert sandbox_processes() - before == set()


def run(sandbox: Sandbox, source: str, stdin: str = "", timeout_s: float | None = None):
    return sandbox.run(textwrap.dedent(source), stdin, timeout_s)


# --- normal programs ---------------------------------------------------------------------------------------------


def test_stdout_stdin_and_exit_code(sandbox, no_escape) -> None:
    ok = run(sandbox, "import sys\nprint(sys.stdin.read()[::-1])", stdin="abc")
    assert (ok.status, ok.exit_code, ok.stdout, ok.reason) == ("ok", 0, "cba\n", "exited 0")
    failed = run(sandbox, "import sys\nprint('partial')\nsys.exit(3)")
    assert (failed.status, failed.exit_code, failed.stdout) == ("error", 3, "partial\n")
    assert failed.reason == "exited 3: no stderr"
    raised = run(sandbox, "raise ValueError('bad input')")
    assert raised.status == "error" and raised.reason == "exited 1: ValueError: bad input"
    assert "Traceback" in raised.stderr


def test_isolation_seen_from_inside(sandbox, no_escape) -> None:
    """What the program sees: sandbox uid, pid 2, no capabilities, only its own processes, its files, no fds."""
    out = run(
        sandbox,
        """
        import ctypes, errno, json, os, sys
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        fds = []
        for fd in range(3, 64):  # e.g. the launcher's status pipe: the program must not be able to forge events
            try:
                os.fstat(fd); fds.append(fd)
            except OSError:
                pass
        libc = ctypes.CDLL(None, use_errno=True)
        nested = libc.unshare(0x10000000)  # CLONE_NEWUSER
        print(json.dumps({
            "uid": os.getuid(), "pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(),
            "env": sorted(os.environ), "root": sorted(os.listdir("/")), "procs": sorted(
                p for p in os.listdir("/proc") if p.isdigit()),
            "cap_eff": status["CapEff"].strip(), "no_new_privs": status["NoNewPrivs"].strip(), "fds": fds,
            "nested_userns": [nested, errno.errorcode.get(ctypes.get_errno())],
            "repo_visible": os.path.exists(sys.stdin.read()),
        }))
        """,
        stdin=REPO,
    )
    assert out.status == "ok", out.reason
    seen = json.loads(out.stdout)
    assert (seen["uid"], seen["pid"], seen["ppid"], seen["cwd"]) == (65534, 2, 1, "/tmp")
    assert seen["env"] == sorted(PROGRAM_ENV)
    assert seen["procs"] == ["1", "2"]
    assert seen["cap_eff"] == "0000000000000000" and seen["no_new_privs"] == "1"
    assert seen["fds"] == []
    assert seen["nested_userns"][0] == -1
    assert not seen["repo_visible"]
    assert set(seen["root"]) <= {"bin", "dev", "lib", "lib32", "lib64", "libx32", "proc", "root", "sbin", "tmp", "usr"}


FORK_COUNT = """
import os, time
n = 0
try:
    while n < 100:
        if os.fork() == 0:
            time.sleep(5); os._exit(0)
        n += 1
except OSError as exc:
    print(n, exc.errno)
"""


def test_process_limit_is_exactly_max_processes(sandbox, no_escape) -> None:
    """Harmless check of the fork limit before the fork bomb: sleeping children, counted until EAGAIN."""
    out = run(sandbox, FORK_COUNT)
    assert out.status == "ok", out.reason
    assert out.stdout.split() == [str(LIMITS["max_processes"]), "11"]  # EAGAIN


# --- hostile programs --------------------------------------------------------------------------------------------


FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"


def test_fork_bomb_is_contained_and_killed(sandbox, no_escape) -> None:
    """The bomb hits its own process limit and spins until the wall clock kills it; a sandbox running beside it
    still gets its full process limit (each sandbox has its own user namespace, so its own count)."""
    start = time.monotonic()
    bomb = threading.Thread(target=lambda: results.append(run(sandbox, FORK_BOMB, timeout_s=2.0)))
    results: list = []
    bomb.start()
    time.sleep(0.5)
    beside = run(sandbox, FORK_COUNT)
    bomb.join()
    assert results[0].status == "timeout" and "2 s wall-clock limit" in results[0].reason
    assert time.monotonic() - start < 2.0 + 3.0
    assert beside.stdout.split() == [str(LIMITS["max_processes"]), "11"]


def test_infinite_loop_times_out(sandbox, no_escape) -> None:
    out = run(sandbox, "while True:\n    pass", timeout_s=1.0)
    assert (out.status, out.exit_code) == ("timeout", None)
    assert out.reason == "still running after the 1 s wall-clock limit; killed"


def test_cpu_time_limit(no_escape) -> None:
    box = Sandbox(SandboxConfig(**{**LIMITS, "cpu_s": 1, "timeout_s": 10.0}))
    out = box.run("while True:\n    pass")
    assert out.status == "timeout" and out.reason.startswith("CPU-time limit of 1 s exceeded")


def test_memory_hog(sandbox, no_escape) -> None:
    out = run(sandbox, "blocks = []\nwhile True:\n    blocks.append(bytearray(8 << 20))")
    assert out.status == "memory"
    assert out.reason == "memory limit of 256 MiB exceeded: MemoryError"


def test_network_is_unreachable_at_once(sandbox, no_escape) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        for address in [("127.0.0.1", port), ("8.8.8.8", 53), ("1.1.1.1", 443)]:
            start = time.monotonic()
            out = run(sandbox, f"import socket\nsocket.create_connection({address!r}, timeout=10)")
            assert out.status == "error", address
            assert out.reason == "exited 1: OSError: [Errno 101] Network is unreachable"
            assert time.monotonic() - start < 3.0  # refused at once: no route, not the 10 s connect timeout
    finally:
        listener.close()


def test_parent_environment_is_not_visible(sandbox, no_escape, monkeypatch) -> None:
    secret = f"secret-{uuid.uuid4()}"
    monkeypatch.setenv("MCORE_RL_SANDBOX_SECRET", secret)
    out = run(
        sandbox,
        """
        import os
        print(dict(os.environ))
        for path in ["/proc/self/environ", "/proc/1/environ", "/proc/2/environ"]:
            try:
                print(path, open(path, "rb").read())
            except OSError as exc:
                print(path, exc)
        """,
    )
    assert out.status == "ok"
    assert secret not in out.stdout + out.stderr and "MCORE_RL_SANDBOX_SECRET" not in out.stdout
    assert "/proc/1/environ [Errno 13] Permission denied" in out.stdout  # init (same uid) is not dumpable


def test_writes_outside_the_temp_dir_do_not_reach_the_host(sandbox, no_escape) -> None:
    name = f"sandbox_escape_{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", f"{REPO}/{name}", f"/etc/{name}", f"/usr/{name}", f"/{name}", f"/dev/shm/{name}"]
    out = run(
        sandbox,
        f"""
        for path in {targets!r}:
            try:
                open(path, "w").write("x")
                print(path, "written")
            except OSError as exc:
                print(path, type(exc).__name__, exc.errno)
        """,
    )
    assert out.status == "ok", out.reason
    lines = out.stdout.splitlines()
    assert lines[0] == f"/tmp/{name} written"  # its own private /tmp, gone with the sandbox
    assert all(" written" not in line for line in lines[1:]), lines
    for path in targets:
        assert not os.path.exists(path), path


def test_huge_output_is_capped(sandbox, no_escape) -> None:
    out = run(sandbox, "while True:\n    print('x' * 10000)")
    assert out.status == "output_limit"
    assert out.reason == f"stdout exceeded {LIMITS['max_output_bytes']} bytes; the sandbox was killed"
    assert len(out.stdout) == LIMITS["max_output_bytes"]


def test_killing_its_parent_kills_only_itself(sandbox, no_escape) -> None:
    out = run(
        sandbox,
        """
        import os, signal, time
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
            os.kill(os.getppid(), sig)  # pid 1 of its namespace, which has no handlers: ignored
        time.sleep(0.2)
        try:
            os.kill(-1, signal.SIGKILL)  # everything it may signal: nothing outside the sandbox
        except OSError:
            pass
        print("still alive", os.getppid(), flush=True)
        os.kill(0, signal.SIGKILL)  # its own process group: itself
        """,
    )
    assert out.stdout == "still alive 1\n"
    assert (out.status, out.exit_code, out.reason) == ("error", -9, "killed by signal SIGKILL")
    assert run(sandbox, "print('next run')").stdout == "next run\n"  # the caller lives on


def test_background_child_is_killed_when_the_program_exits(sandbox, no_escape) -> None:
    start = time.monotonic()
    out = run(
        sandbox,
        """
        import os, time
        if os.fork() == 0:
            os.setsid()  # leaves the process group; the pid namespace still holds it
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print("parent done")
        """,
    )
    assert (out.status, out.stdout) == ("ok", "parent done\n")
    assert time.monotonic() - start < 5.0  # not the grandchild's 60 s


# --- the pool ----------------------------------------------------------------------------------------------------


def test_pool_runs_programs_concurrently_up_to_max_workers(sandbox, no_escape) -> None:
    program = "import time\nstart = time.time()\ntime.sleep(0.6)\nprint(start, time.time())"
    with SandboxPool(sandbox, max_workers=2) as pool:
        results = pool.run_many([SandboxJob(program)] * 6 + [SandboxJob("print(input())", "order kept")])
    assert all(r.status == "ok" for r in results)
    assert results[-1].stdout == "order kept\n"
    spans = [tuple(map(float, r.stdout.split())) for r in results[:-1]]
    overlap = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert overlap == 2


# --- the code reward ---------------------------------------------------------------------------------------------

ADD = "Here you go:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
STDIO_CASES = json.dumps({"inputs": ["1 2\n", "5 5\n", "0 0\n", "2 2\n"], "outputs": ["3\n", "10  \n\n", "0", "5\n"]})


def test_code_reward_stdin_stdout_partial_credit(sandbox) -> None:
    reward = CodeReward(sandbox, max_workers=2)
    out = reward("codecontests", ADD, STDIO_CASES, None)
    assert (out["score"], out["passed"], out["total"]) == (0.75, 3, 4)
    assert out["reason"] == "3/4 cases passed; case 3 (stdin/stdout): wrong answer: got '4\\n', expected '5\\n'"
    strict = CodeReward(sandbox, all_or_nothing=True)
    assert strict("codecontests", ADD, STDIO_CASES, None)["score"] == 0.0
    assert strict("codecontests", ADD, {"inputs": ["1 2"], "outputs": ["3"]}, None)["score"] == 1.0


def test_code_reward_function_call_cases(sandbox) -> None:
    response = """```python
class Solution:
    def twoSum(self, nums: List[int], target: int) -> List[int]:
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return (seen[target - x], i)
            seen[x] = i
```"""
    spec = {
        "fn_name": "twoSum",
        # APPS/TACO: a list of arguments and a wrapped output; LiveCodeBench: one JSON value per line, JSON output.
        "inputs": [[[2, 7, 11, 15], 9], "[3, 2, 4]\n6", [[3, 3], 6], [[1, 2], 3]],
        "outputs": [[[0, 1]], "[1, 2]", [[0, 1]], [[1, 0]]],
    }
    out = CodeReward(sandbox)("apps", response, json.dumps(spec), None)
    assert (out["passed"], out["total"], out["score"]) == (3, 4, 0.75)
    assert "case 3 (call twoSum): wrong answer: returned [0, 1], expected [[1, 0]]" in out["reason"]
    missing = CodeReward(sandbox)("apps", "```python\ndef other(): pass\n```", json.dumps(spec), None)
    assert missing["score"] == 0.0 and "NameError: function twoSum is not defined" in missing["reason"]


def test_code_reward_asserts(sandbox) -> None:
    response = "```python\ndef square(x):\n    return x * x if x < 3 else 0\n```"
    out = CodeReward(sandbox)("mbpp", response, {"test_list": ["assert square(2) == 4", "assert square(3) == 9"]})
    assert (out["passed"], out["total"]) == (1, 2) and "AssertionError" in out["reason"]


def test_hostile_responses_score_zero_and_training_goes_on(sandbox, no_escape) -> None:
    """A batch of hostile programs through RewardManager: each scores 0 with its reason, the step completes."""
    hostile = {
        "fork bomb": FORK_BOMB,
        "infinite loop": "while True:\n    pass",
        "memory hog": "x = []\nwhile True:\n    x.append(bytearray(8 << 20))",
        "network": "import socket\nsocket.create_connection(('8.8.8.8', 53))",
        "huge output": "while True:\n    print('x' * 10000)",
        "kill parent": "import os\nos.kill(os.getppid(), 9)\nos.kill(0, 9)",
    }
    # 5 s, not less: under load, filling 256 MiB took 0.9 s of wall clock for 0.25 s of CPU here
    reward = CodeReward(sandbox, max_workers=2, timeout_s=5.0)
    manager = RewardManager(reward)
    rows = [f"```python\n{code}\n```" for code in hostile.values()] + [ADD]
    cases = json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})
    out = manager.score(rows, ["codecontests"] * len(rows), [cases] * len(rows))
    assert out.scores.tolist() == [0.0] * len(hostile) + [1.0]
    reasons = dict(zip(hostile, out.extras["reason"]))
    assert "timeout" in reasons["fork bomb"] and "timeout" in reasons["infinite loop"]
    assert "memory: memory limit of 256 MiB exceeded" in reasons["memory hog"]
    assert "Network is unreachable" in reasons["network"]
    assert "output_limit" in reasons["huge output"]
    assert "killed by signal SIGKILL" in reasons["kill parent"]
    reward.close()


def test_builtin_reward_for_verl_code_data_sources(sandbox) -> None:
    """verl's code data_source values score through the default sandbox (built and checked on first use)."""
    assert all(
        BUILTIN_REWARDS[source] is code_compute_score for source in ("codecontests", "apps", "codeforces", "taco")
    )
    out = default_compute_score("codeforces", ADD, json.dumps({"inputs": ["2 3"], "outputs": ["5"]}))
    assert (out["score"], out["reason"]) == (1.0, "1/1 cases passed")


def test_extract_code() -> None:
    assert extract_code("a\n```python\nx = 1\n```\nb\n```python\nx = 2\n```") == "x = 2\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("<think>```python\nbad\n```</think>```py\ngood\n```") == "good\n"
    assert extract_code("print(3)") == "print(3)"


# --- SandboxFusion backend ---------------------------------------------------------------------------------------


class FakeSandboxFusion:
    """Answers POST /run_code in SandboxFusion's documented shape, from canned rules; never runs the code.

    stdin "N" -> stdout 2*N; code containing TLE / CRASH / SANDBOX_ERROR -> that outcome; the first `busy`
    requests get 504 (a gateway timeout, which the client retries).
    """

    def __init__(self, busy: int = 0) -> None:
        self.requests: list[dict] = []
        self.busy = busy
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/run_code", self.run_code)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def run_code(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if self.busy > 0:
            self.busy -= 1
            return web.Response(status=504)
        run = {"status": "Finished", "execution_time": 0.01, "return_code": 0, "stdout": "", "stderr": ""}
        status, message = "Success", ""
        if "SANDBOX_ERROR" in body["code"]:
            status, message, run = "SandboxError", "no executor available", None
        elif "TLE" in body["code"]:
            status, run = "Failed", {**run, "status": "TimeLimitExceeded", "return_code": None}
        elif "CRASH" in body["code"]:
            status, run = "Failed", {**run, "return_code": 1, "stderr": "Traceback...\nZeroDivisionError: x"}
        else:
            run["stdout"] = f"{2 * int(body['stdin'])}\n"
        answer = {"status": status, "message": message, "compile_result": None, "run_result": run, "files": {}}
        return web.json_response(answer)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()


@pytest.fixture()
def fusion(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    server = FakeSandboxFusion(busy=1)
    yield server
    server.close()


def test_sandbox_fusion_runner_request_and_statuses(fusion) -> None:
    runner = SandboxFusionRunner(fusion.url, timeout_s=3, memory_mb=512, retry_delay_s=0.01)
    ok = runner.run("print(2 * int(input()))", "21", timeout_s=2)
    assert (ok.status, ok.stdout, ok.exit_code) == ("ok", "42\n", 0)
    assert len(fusion.requests) == 2  # one 504, retried
    assert fusion.requests[-1] == {
        "code": "print(2 * int(input()))",
        "language": "python",
        "stdin": "21",
        "compile_timeout": 2,
        "run_timeout": 2,
        "memory_limit_MB": 512,
        "files": {},
        "fetch_files": [],
    }
    assert runner.run("TLE").status == "timeout"
    crash = runner.run("CRASH")
    assert (crash.status, crash.reason) == ("error", "exited 1: ZeroDivisionError: x")
    refused = runner.run("SANDBOX_ERROR")
    assert (refused.status, refused.reason) == ("refused", "SandboxFusion SandboxError: no executor available")
    down = SandboxFusionRunner("http://127.0.0.1:9/run_code").run("print(1)")
    assert down.status == "refused" and "Connection refused" in down.reason


def test_code_reward_through_sandbox_fusion(fusion) -> None:
    reward = CodeReward(SandboxFusionRunner(fusion.url, retry_delay_s=0.01), max_workers=2)
    spec = {"inputs": ["1", "2", "3"], "outputs": ["2", "4", "7"]}
    out = reward("taco", "```python\nprint(2 * int(input()))\n```", spec)
    assert (out["passed"], out["total"]) == (2, 3)
    assert "case 2 (stdin/stdout): wrong answer: got '6\\n', expected '7'" in out["reason"]


# --- CLI ---------------------------------------------------------------------------------------------------------


def cli(*args: str, preexec=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mcore_rl.reward.sandbox", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60, preexec_fn=preexec)


def test_cli_prints_json_and_exits_0_when_the_sandbox_worked(sandbox, tmp_path) -> None:
    program, stdin = tmp_path / "p.py", tmp_path / "in.txt"
    program.write_text("import sys\nprint(sum(map(int, sys.stdin.read().split())))\nsys.exit(4)")
    stdin.write_text("1 2 3")
    done = cli(str(program), "--stdin", str(stdin), "--timeout", "5", "--memory-mb", "256")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert {k: out[k] for k in ("status", "exit_code", "stdout", "reason")} == {
        "status": "error",
        "exit_code": 4,
        "stdout": "6\n",
        "reason": "exited 4: no stderr",
    }
    program.write_text("while True:\n    pass")
    looped = cli(str(program), "--timeout", "1")
    assert looped.returncode == 0 and json.loads(looped.stdout)["status"] == "timeout"


def test_cli_missing_file_exits_2_with_a_message(tmp_path) -> None:
    done = cli(str(tmp_path / "nope.py"))
    assert done.returncode == 2
    assert f"file not found: {tmp_path / 'nope.py'}" in done.stderr


# --- refusal -----------------------------------------------------------------------------------------------------


def block_unshare() -> None:
    """preexec_fn: a seccomp filter failing unshare(2) with EPERM, as Docker's default profile does."""
    libc = ctypes.CDLL(None, use_errno=True)
    # struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}: load arch; not x86_64 -> allow; load nr;
    # unshare (272) -> ERRNO(EPERM); else allow.
    program = [(0x20, 0, 0, 4), (0x15, 0, 3, 0xC000003E), (0x20, 0, 0, 0), (0x15, 0, 1, 272)]
    program += [(0x06, 0, 0, 0x00050000 | 1), (0x06, 0, 0, 0x7FFF0000)]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(program))(*[Filter(*f) for f in program])
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(Prog(len(program), filters)), 0, 0) == 0  # PR_SET_SECCOMP, FILTER


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the seccomp filter is written for x86_64")
def test_refuses_when_namespaces_are_blocked(tmp_path) -> None:
    """With unshare blocked (a real seccomp filter, not a mock): check() raises naming what is missing; the CLI
    answers "refused" with exit 1 and the program never runs."""
    script = (
        "from mcore_rl.reward.sandbox import Sandbox, SandboxUnavailable\n"
        "try:\n    Sandbox().check()\nexcept SandboxUnavailable as exc:\n    print(exc)\n"
    )
    probe = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60, preexec_fn=block_unshare
    )
    assert probe.stdout.startswith("cannot sandbox generated code on this machine: probe run refused: ")
    assert "cannot create a user namespace: unshare failed: [Errno 1] Operation not permitted" in probe.stdout
    assert "user namespaces are not allowed here" in probe.stdout
    marker = tmp_path / "ran"
    program = tmp_path / "p.py"
    program.write_text(f"open({str(marker)!r}, 'w').close()")
    done = cli(str(program), preexec=block_unshare)
    assert done.returncode == 1 and json.loads(done.stdout)["status"] == "refused"
    assert not marker.exists()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match=r"SandboxConfig.timeout_s must be > 0, got 0"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match=r"SandboxPool.max_workers must be >= 1"):
        SandboxPool(Sandbox(), max_workers=0)
