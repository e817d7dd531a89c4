"""Nothing of a one-node run that this project binds listens beyond this machine:
torch.distributed's store on the actor ranks listened on every interface (`::`) without authentication, because
torch's env:// rendezvous binds the wildcard address whatever MASTER_ADDR says. parallel/groups.py now serves the store
on the rendezvous host only, and a one-node run's rendezvous host is loopback (so are the weight-update groups' stores,
which bind the same host). Ray's own core-worker server still listens on the wildcard address in every Ray process.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WILDCARD = {"::", "0.0.0.0"}


def _listening(pid: int) -> list[tuple[str, int]]:
    import psutil

    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == "LISTEN"]


def test_the_process_group_store_listens_on_loopback_only() -> None:
    """A world of one, started as the actor ranks start theirs (init_distributed): every listening socket of the
    process is on loopback."""
    code = """
import json, psutil
from mcore_rl.parallel.groups import free_port, init_distributed
init_distributed("cpu", 0, 1, "127.0.0.1", free_port())
print(json.dumps([c.laddr.ip for c in psutil.Process().net_connections(kind="tcp") if c.status == "LISTEN"]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    addresses = json.loads(out.stdout.strip().splitlines()[-1])
    assert addresses and all(a.startswith("127.") for a in addresses), addresses


def test_without_ray_ranks_meet_on_loopback() -> None:
    from mcore_rl.parallel.groups import rendezvous_host

    assert rendezvous_host() == "127.0.0.1"


@pytest.mark.long
@pytest.mark.slow
def test_a_local_runs_actor_ranks_listen_on_no_wildcard_address(tmp_path) -> None:
    import psutil

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.train", "trainer.steps=100", f"trainer.run_dir={run_dir}", "data.batch_size=2",
         "rollout.n=2", "actor.mini_batches=1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        deadline = time.time() + 300
        while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        ranks = [
            p for p in psutil.Process(proc.pid).children(recursive=True) if "MegatronActor" in " ".join(p.cmdline())
        ]
        assert ranks
        found = {p.pid: [a for a in _listening(p.pid) if a[0] in WILDCARD] for p in ranks}
        # Ray's own core-worker server listens on the wildcard address in every Ray process, the driver included
        # (one socket; not this project's to bind): a rank may have as many as the driver has, and no more. Rank 0's
        # torch.distributed store was one more.
        ray_own = len([a for a in _listening(proc.pid) if a[0] in WILDCARD])
        assert ray_own <= 1 and all(len(wild) <= ray_own for wild in found.values()), (ray_own, found)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
