"""WeightSync.connect against engines that queue control requests as SGLang 0.5.23 does: no order of arrival deadlocks.

SGLang serves `/init_weights_update_group` one request at a time per engine, in arrival order, each blocking until
its group forms (tests/_sglang_receiver.py: SGLang's own `FanOutCommunicator` and `init_custom_process_group`).
Engine 0 queues its init of each case's first group after another init (`--delay-init`; or after `DELAY_S` when none
comes, as with a connect that posts one group at a time), so it sees the groups in another order than the others.
Posting every group's init at once then deadlocks: on gloo for any 2 streams x 2 engines; on NCCL's TCP-store
handshake (all of an NCCL init that runs without a GPU: `--nccl-store-only`) when one rank leads two streams, since a
Ray actor joins one group at a time and an engine blocks on the port of the group it has not reached yet.

The controller side is the project's `WeightSync.connect`; the stream leaders are Ray actors running the project's
`SyncSender.addresses` / `join` (only the plan is a stand-in: which streams each rank leads). Each case runs once; a
deadlock shows as SyncError after `TIMEOUT_S`.

Run: `.venv/bin/pytest tests/test_connect_order.py`
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import ray
from _connect_cluster import Leader, lead, weight_sync
from _sglang_code import sglang_receiver_process

from mcore_rl.rollout.client import RolloutClient

pytestmark = pytest.mark.slow  # child processes, Ray actors, gloo groups

TIMEOUT_S = 30.0  # a rendezvous that cannot meet fails in this time (SGLang: 30 min; a gloo mesh meets in < 1 s)
DELAY_S = 1.0  # engine 0's init of a case's first group waits this long for another init to go first
ENGINES = 3
#: case -> (the rank leading each stream, engines)
CASES = {"2x2": ([0, 1], 2), "3x3": ([0, 1, 2], 3), "shared-leader": ([0, 0], 2)}
BACKENDS = ("gloo", "nccl")


def _streams(backend: str, case: str) -> list[str]:
    """The case's stream (group) names: unique per case, so engines that served one case serve the next."""
    return [f"{backend}-{case}-s{i}" for i in range(len(CASES[case][0]))]


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    delayed = [f"--delay-init={name}={DELAY_S}" for b in BACKENDS for c in CASES for name in _streams(b, c)[:1]]
    client = RolloutClient("http://127.0.0.1:9", engine="sglang")
    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(sglang_receiver_process(extra_args=["--nccl-store-only", *(delayed if i == 0 else [])]))
            for i in range(ENGINES)
        ]
        leaders = [Leader.remote(rank) for rank in range(3)]
        try:
            yield SimpleNamespace(urls=urls, leaders=leaders, client=client)
        finally:
            client.close()
            ray.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_connect_with_one_init_late_does_not_deadlock(cluster, backend: str, case: str) -> None:
    """Every stream's group forms with every engine although engine 0 sees its first group's init last."""
    leaders, engines = CASES[case]
    streams = _streams(backend, case)
    lead(cluster.leaders, dict(zip(streams, leaders)))
    sync = weight_sync(cluster.leaders[: max(leaders) + 1], cluster.client, backend, streams, TIMEOUT_S)
    sync.connect(cluster.urls[:engines])
    assert sync._connected == cluster.urls[:engines]
    joined = ray.get([h.groups.remote() for h in cluster.leaders])
    assert sorted(n for names in joined for n in names) == sorted(streams)
