"""Two stream leaders broadcasting buckets to two engines that serve update requests one at a time, as SGLang 0.5.23
does (its scheduler takes one request; /update_weights_from_distributed blocks in the broadcast): leaders posting on
their own deadlock; in the global order (resharding/sync/order.py) every engine receives the same sequence.

The engine double joins the real update groups (parallel/update_group.py, gloo) and receives each bucket's bytes in
the broadcast. When two requests are queued it serves the one of "its" stream first (engine e prefers stream e): an
arrival order SGLang can see, and the one that deadlocks. Each leader and each engine is a thread of this process.

Run: `.venv/bin/pytest tests/test_sync_order.py`
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch
import torch.distributed as dist
from aiohttp import web

from mcore_rl.parallel.groups import free_port
from mcore_rl.parallel.update_group import broadcast, new_update_group
from mcore_rl.resharding.sync.order import InGlobalOrder
from mcore_rl.resharding.sync.plan import Bucket, Entry, Stream
from mcore_rl.resharding.sync.transports import DistributedTransport
from mcore_rl.rollout.engines.receivers import SGLangReceiver

pytestmark = pytest.mark.slow  # gloo groups of three ranks (threads)

TIMEOUT_S = 4.0  # a broadcast (and a turn) gives up after this: how the deadlock shows
STREAMS = [Stream(s, s, None, 0, (0,), f"pp{s}") for s in range(2)]
BUCKETS = {
    (s, k): Bucket(s, k, 16, (Entry(f"w{s}.{k}", (4,), "float32", 0, 16, 0, 0, "replicate", 0),))
    for s in range(2)
    for k in range(2)
}
ORDER = [(0, 0), (1, 0), (0, 1), (1, 1)]


class SerialEngine:
    """An engine that serves update requests one at a time (see the module docstring)."""

    def __init__(self, index: int, hold_s: float = 0.3) -> None:
        self.index, self.hold_s = index, hold_s
        self.groups: dict[str, object] = {}
        self.received: list[tuple[str, str]] = []  # (group, tensor name), in the order served
        self.queue: asyncio.Queue | None = None

    async def update(self, request: web.Request) -> web.Response:
        assert self.queue is not None
        done = asyncio.get_running_loop().create_future()
        await self.queue.put((await request.json(), done))
        ok, message = await done
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def serve(self) -> None:
        self.queue = asyncio.Queue()
        waiting: list = []
        while True:
            if not waiting:
                waiting.append(await self.queue.get())
            try:  # a second request arriving meanwhile: serve "our" stream's first
                waiting.append(await asyncio.wait_for(self.queue.get(), self.hold_s))
            except asyncio.TimeoutError:
                pass
            waiting.sort(key=lambda item: item[0]["group_name"] != f"pp{self.index}")
            body, done = waiting.pop(0)
            done.set_result(await asyncio.to_thread(self._receive, body))

    def _receive(self, body: dict) -> tuple[bool, str]:
        nbytes = sum(
            math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
            for shape, dtype in zip(body["shapes"], body["dtypes"])
        )
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        group = self.groups[body["group_name"]]
        try:
            broadcast(group, buffer)
            # NCCL broadcasts along a ring (leader -> engine rank 1 -> engine rank 2): a receiver's bytes come through
            # the receivers before it, so one engine's broadcast ends only with the others in it. Gloo sends from
            # the root to each rank directly; the relay of a token through the engine ranks stands in for the ring.
            token = torch.zeros(1)
            if group.rank < group.world_size - 1:
                group.group.send([token], group.rank + 1, 0).wait()
            if group.rank > 1:
                group.group.recv([token], group.rank - 1, 0).wait()
        except Exception as err:  # noqa: BLE001 (the broadcast timed out: told to the leader)
            return False, f"broadcast failed: {err}"
        self.received.extend((body["group_name"], name) for name in body["names"])
        return True, "ok"


@pytest.fixture
def cluster():
    """Two engines (HTTP servers on one loop thread) joined to the update groups of two stream leaders."""
    engines = [SerialEngine(0), SerialEngine(1)]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runners, urls, tasks = [], [], []

    async def start(engine: SerialEngine) -> str:
        app = web.Application()
        app.router.add_post("/update_weights_from_distributed", engine.update)
        runner = web.AppRunner(app, shutdown_timeout=1.0)  # a deadlocked handler is not waited out (60 s)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        tasks.append(loop.create_task(engine.serve()))
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    for engine in engines:
        urls.append(asyncio.run_coroutine_threadsafe(start(engine), loop).result())
    leaders: dict[str, object] = {}
    joins = []
    for stream in STREAMS:
        port = free_port("127.0.0.1")
        for rank in range(3):

            def join(rank: int = rank, name: str = stream.name, port: int = port) -> None:
                group = new_update_group("gloo", "127.0.0.1", port, rank, 3, name, TIMEOUT_S)
                if rank == 0:
                    leaders[name] = group
                else:
                    engines[rank - 1].groups[name] = group

            joins.append(threading.Thread(target=join))
    for t in joins:
        t.start()
    for t in joins:
        t.join(timeout=60)
    yield engines, urls, leaders
    for task in tasks:
        loop.call_soon_threadsafe(task.cancel)
    for runner in runners:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def _lead(
    stream: Stream, leaders: dict, urls: list[str], store: object | None, errors: list, prefix: str = "sync1"
) -> None:
    """One stream leader: its two buckets through the distributed transport (in the global order with `store`)."""
    sink = DistributedTransport({stream.name: leaders[stream.name]}, urls, api_key=None, weight_version="1",
                                receiver=SGLangReceiver(), timeout_s=2 * TIMEOUT_S)  # fmt: skip
    if store is not None:
        sink = InGlobalOrder(sink, ORDER, {stream.index}, store, prefix, timeout_s=TIMEOUT_S)
    try:
        for k in range(2):
            sink.send(stream, BUCKETS[(stream.index, k)], torch.zeros(16, dtype=torch.uint8))
        sink.wait()
    except Exception as err:  # noqa: BLE001 (the test reads it)
        errors.append(err)
    finally:
        sink.close()


def _push(cluster, store: object | None) -> list[Exception]:
    _, urls, leaders = cluster
    errors: list[Exception] = []
    threads = [threading.Thread(target=_lead, args=(s, leaders, urls, store, errors)) for s in STREAMS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return errors


def test_leaders_on_their_own_deadlock_engines_that_serve_one_request_at_a_time(cluster) -> None:
    """The defect the global order removes, shown on the double: each engine waits in the other stream's group."""
    errors = _push(cluster, store=None)
    assert errors, "the double must deadlock leaders that post on their own (else the next test proves nothing)"
    assert any(k in str(e) for e in errors for k in ("Timed out", "broadcast failed", "did not answer")), errors


def test_global_order_every_engine_receives_the_same_sequence(cluster) -> None:
    engines, _, _ = cluster
    errors = _push(cluster, store=dist.HashStore())
    assert errors == []
    expected = [(f"pp{s}", f"w{s}.{k}") for s, k in ORDER]
    assert [e.received for e in engines] == [expected, expected]


class _Closed:
    """A transport (base.Transport) that is only ever closed."""

    memory, every_rank = "cpu", False

    def close(self) -> None:
        pass


def test_a_failed_bucket_fails_the_later_ones_at_once(cluster) -> None:
    """A leader that stops before its turn marks its positions failed: the other leader does not wait them out."""
    _, urls, leaders = cluster
    store = dist.HashStore()
    dead = InGlobalOrder(_Closed(), ORDER, {0}, store, "sync2", timeout_s=60)
    dead.close()  # stream 0's leader stops before its first bucket (its gather failed, say)
    errors: list[Exception] = []
    _lead(STREAMS[1], leaders, urls, store, errors, prefix="sync2")
    messages = [str(e) for e in errors]
    assert len(messages) == 1 and "an earlier bucket failed" in messages[0], messages


def test_a_refused_bucket_does_not_wedge_its_sender() -> None:
    """An engine without a weight-update session refuses the bucket at once and never joins the broadcast (SGLang
    and our server alike): the leader gives the broadcast up on the refusal instead of waiting out the group's
    timeout (60 s here), and says so."""
    name, port = "pp0", free_port("127.0.0.1")
    joined: dict[str, object] = {}
    engine_side = threading.Thread(
        target=lambda: joined.update(engine=new_update_group("gloo", "127.0.0.1", port, 1, 2, name, 60))
    )
    engine_side.start()
    leader = new_update_group("gloo", "127.0.0.1", port, 0, 2, name, 60)
    engine_side.join(timeout=60)

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"success": False, "message": "no weight-update session is open"}, status=400)

    app = web.Application()
    app.router.add_post("/update_weights_from_distributed", refuse)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    serving = threading.Thread(target=loop.run_forever, daemon=True)
    serving.start()
    errors: list[Exception] = []
    sender = threading.Thread(target=_lead_one, args=(leader, name, url, errors), daemon=True)
    try:
        sender.start()
        sender.join(timeout=30)  # a hang detector, far below the group's 60 s: the sender must come back on its own
        assert not sender.is_alive(), "the sender waited in a broadcast no engine joined"
        (error,) = errors
        assert "no weight-update session is open" in str(error) and "abandoned" in str(error)
    finally:
        # the engine rank takes its part now, so the abandoned broadcast ends without waiting for its timeout
        broadcast(joined["engine"], torch.empty(16, dtype=torch.uint8))  # type: ignore[arg-type]
        sender.join(timeout=60)
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        serving.join(timeout=10)


def _lead_one(group: object, name: str, url: str, errors: list) -> None:
    sink = DistributedTransport(
        {name: group}, [url], api_key=None, weight_version="1", receiver=SGLangReceiver(), timeout_s=60
    )
    try:
        sink.send(STREAMS[0], BUCKETS[(0, 0)], torch.zeros(16, dtype=torch.uint8))
        sink.wait()
    except Exception as err:  # noqa: BLE001 (the test reads it)
        errors.append(err)
    finally:
        sink.close()
