"""The multi-rank harness: ranks forked from the preloaded fork server still get what a spawned rank would.

A forked rank inherits the fork server's state, frozen when the server started (often during an earlier test). These
tests pin down what the harness hands each rank explicitly: the caller's environment and stdout/stderr at the time
of the call, and a failing rank's traceback.
"""

from __future__ import annotations

import os
import sys

import pytest

from mcore_rl.parallel.cpu_runtime import usable_gpu
from mcore_rl.parallel.harness import RankFailed, default_start_method, run_on_ranks

pytestmark = pytest.mark.slow  # gloo ranks


def _env_rank(rank: int, world: int, names: list[str]) -> dict:
    import torch
    from megatron.core import jit
    from megatron.core.fusions.fused_bias_geglu import geglu

    return {
        "env": {n: os.environ.get(n) for n in names},
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        # the server imported megatron.core after mcore_rl's hook: no torch.compile wrappers without CUDA
        "eager": jit.jit_fuser is jit.noop_decorator and type(geglu).__name__ == "function",
    }


def _print_rank(rank: int, world: int, tag: str) -> int:
    print(f"{tag} stdout from rank {rank}", flush=True)
    print(f"{tag} stderr from rank {rank}", file=sys.stderr, flush=True)
    return rank


def _failing_rank(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one is broken on purpose")
    return rank


def test_ranks_get_the_environment_of_the_call_not_of_the_server(monkeypatch):
    monkeypatch.setenv("HARNESS_GONE", "set before the first call")
    first = run_on_ranks(_env_rank, 2, (["HARNESS_GONE"],))  # starts the fork server if nothing has yet
    assert [r["env"]["HARNESS_GONE"] for r in first] == ["set before the first call"] * 2
    monkeypatch.setenv("HARNESS_NEW", "set after the server started")
    monkeypatch.delenv("HARNESS_GONE")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    later = run_on_ranks(_env_rank, 2, (["HARNESS_NEW", "HARNESS_GONE"],))
    assert [r["env"] for r in later] == [{"HARNESS_NEW": "set after the server started", "HARNESS_GONE": None}] * 2
    assert [r["threads"] for r in later] == [2, 2]  # the caller's OMP_NUM_THREADS, not the server's
    assert len({r["pid"] for r in first + later}) == 4 and os.getpid() not in {r["pid"] for r in later}
    assert all(r["eager"] for r in first + later)
    # forked from the server (its child, not ours) unless a GPU made the harness spawn them
    assert all((r["ppid"] != os.getpid()) == (not usable_gpu()) for r in first + later)


def test_rank_output_reaches_the_callers_current_stdout_and_stderr(capfd):
    with capfd.disabled():  # the server, if it starts here, gets stdio that is not this test's capture
        run_on_ranks(_env_rank, 1, ([],))
    run_on_ranks(_print_rank, 2, ("captured",))
    out, err = capfd.readouterr()
    assert "captured stdout from rank 0" in out and "captured stdout from rank 1" in out
    assert "captured stderr from rank 0" in err and "captured stderr from rank 1" in err


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed:(.|\n)*ValueError: rank one is broken on purpose"):
        run_on_ranks(_failing_rank, 2)


def _killed_rank(rank: int, world: int, pid_file: str) -> int:
    import signal
    import time

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)  # rank 0 would wait for a peer that never comes; the harness must stop it
    return rank


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_rank_killed_from_outside_is_named_and_its_peers_are_stopped(tmp_path):
    pid_file = tmp_path / "rank0.pid"
    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed:\nexited with code -9 before reporting"):
        run_on_ranks(_killed_rank, 2, (str(pid_file),))
    # (rank 0 writes its pid at once; the harness declares rank 1 dead only after two quiet polls, 1 s apart)
    assert not _running(int(pid_file.read_text()))


def test_spawn_remains_available_and_equal():
    forked = run_on_ranks(_env_rank, 2, (["PATH"],))
    spawned = run_on_ranks(_env_rank, 2, (["PATH"],), start_method="spawn")
    assert [r["env"] for r in spawned] == [r["env"] for r in forked]


@pytest.mark.gpu
def test_with_a_gpu_ranks_are_spawned_and_the_cpu_runtime_still_refuses(monkeypatch):
    """A process that asked CUDA for its devices cannot fork children that ask again: with a GPU the ranks are
    spawned, so the CPU runtime still sees the GPU and refuses to shadow it."""
    monkeypatch.delenv("MCORE_RL_ALLOW_CPU_WITH_GPU", raising=False)
    assert default_start_method() == "spawn"
    with pytest.raises(RankFailed, match="runtime=cpu refused: this machine has a usable GPU"):
        run_on_ranks(_env_rank, 1, ([],))
