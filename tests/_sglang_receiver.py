"""A rollout-engine rank whose weight-receiving code is SGLang 0.5.23's own, for tests and tools/bench_sync.py.

    python tests/_sglang_receiver.py [--tp-rank 0] [--defer-copy-s 0] [--peer URL ...] [--delay-init GROUP=S ...]
                                     [--nccl-store-only]                    # prints "READY http://H:P"

It answers the HTTP calls our sync transports make, and does on each what SGLang's engine does, with SGLang's
functions (tests/_sglang_code.py loads them from the pinned wheel; nothing here re-implements them):

  POST /init_weights_update_group   WeightUpdater.init_weights_update_group: init_custom_process_group(backend,
                                    init_method="tcp://address:port", world_size, rank=rank_offset + tp_rank,
                                    group_name), after a default process group as every SGLang rank has
  POST /update_weights_from_distributed   receive_weights_from_distributed: FlattenedTensorBucket.empty + one
                                    torch.distributed.broadcast(src=0, group) for a flattened bucket, else one
                                    broadcast per tensor
  POST /update_weights_from_tensor  tokenizer: normalize_serialized_named_tensor_payloads; TP worker:
                                    monkey_patch_torch_reductions, MultiprocessingSerializer.deserialize(
                                    payloads[tp_rank]); flattened buckets rebuilt with FlattenedTensorBucket
  POST /destroy_weights_update_group  torch.distributed.destroy_process_group(group)
  POST /begin_weight_update, /end_weight_update   accepted (the session itself is not what this checks)
  POST /dump_received {"path", "names"?}  test hook: the tensors received so far (the last copy of each name; all,
                                    or those of `names`) as a safetensors file, how many times each arrived, and
                                    `owners`: per tensor payload opened, the pids that allocated its shared-memory
                                    segments (torch names a `file_system` segment `/torch_<pid>_...`; CPU only)

Control requests queue as in SGLang: every route above but /dump_received goes through its own
`FanOutCommunicator` in "queueing" mode (SGLang's `managers/communicator.py`, loaded from the pinned wheel), whose
asyncio lock is held from send to reply, and they all reach one scheduler thread that serves them one at a time in
arrival order, each blocking until done (an init until its group forms, a broadcast until the sender sends). So two
inits of different groups in different orders on two engines deadlock here as on SGLang.
`--delay-init GROUP=S`: an init of GROUP reaches the queue only after another init has (or S seconds after it
arrived, when none comes): the arrival order a slow network can make, forced for a test. (A fixed delay of 0.1 s did
not force it on a loaded machine: the other init then came later still.)
`--nccl-store-only`: an `nccl` init runs only its TCP-store part, which is all of an NCCL init that runs without a
GPU: the `rendezvous(init_method, rank, world_size, timeout)` that `init_custom_process_group` starts with (its NCCL
communicator is made lazily, at the first broadcast).

An engine of several TP ranks is one process per rank: rank 0 (started with `--peer URL` for each other rank) hands
every `/update_weights_from_tensor` body to its peers as well, as SGLang's tokenizer manager hands a request to every
TP rank's scheduler, and answers once all ranks have; each rank opens only `serialized_named_tensors[tp_rank]`.

Where SGLang loads a received tensor into its model (`model.load_weights`), this keeps a copy of it instead, so a
test can check every byte. One process is one engine TP rank; the group is gloo, payloads may be CUDA IPC handles.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import queue
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sglang_code import load_sglang_communicator, load_sglang_receiver  # noqa: E402

sglang = load_sglang_receiver()
communicator = load_sglang_communicator()


class Receiver:
    """What one SGLang TP rank keeps: its update groups and (here) the tensors it would load."""

    def __init__(
        self, tp_rank: int, defer_copy_s: float = 0.0, peers: list[str] | None = None, nccl_store_only: bool = False
    ) -> None:
        self.tp_rank = tp_rank
        self.nccl_store_only = nccl_store_only
        self.peers = list(peers or [])
        self.owners: list[list[int]] = []
        self.defer_copy_s = defer_copy_s
        self.pending: list[threading.Thread] = []
        self.weight_version: str | None = None  # SGLang moves it when an update request names one
        self.groups: dict[str, Any] = {}
        self.received: dict[str, torch.Tensor] = {}
        self.arrivals: dict[str, int] = {}
        self.lock = threading.Lock()
        # SGLang asserts torch.distributed.is_initialized() before joining a group: its ranks have a default group
        # (a TCP store: a file store's file outlives a receiver that is killed, as the tests kill them)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    def init_weights_update_group(self, body: dict) -> dict:
        rank = body["rank_offset"] + self.tp_rank  # WeightUpdater.init_weights_update_group
        timeout = body.get("timeout_s")
        if self.nccl_store_only and body.get("backend", "nccl") == "nccl":
            # init_custom_process_group's first step, as it makes it (its NCCL communicator comes at the first
            # broadcast, which needs a GPU)
            store, _, _ = next(
                dist.distributed_c10d.rendezvous(
                    f"tcp://{body['master_address']}:{body['master_port']}", rank, body["world_size"],
                    timeout=datetime.timedelta(seconds=timeout or 1800),
                )
            )  # fmt: skip
            self.groups[body["group_name"]] = store
            return {"success": True, "message": "Succeeded to initialize custom process group."}
        self.groups[body["group_name"]] = sglang.init_custom_process_group(
            backend=body.get("backend", "nccl"),
            init_method=f"tcp://{body['master_address']}:{body['master_port']}",
            world_size=body["world_size"],
            rank=rank,
            group_name=body["group_name"],
            **({"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}),
        )
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_weights_update_group(self, body: dict) -> dict:
        group = self.groups.pop(body["group_name"])
        if isinstance(group, dist.ProcessGroup):  # a store-only NCCL init holds its store
            dist.destroy_process_group(group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_weights_from_distributed(self, body: dict) -> dict:
        names, dtypes, shapes, group = body["names"], body["dtypes"], body["shapes"], self.groups[body["group_name"]]
        if body.get("load_format") == "flattened_bucket":  # WeightUpdater._receive_bucketed_weights_from_distributed
            bucket = sglang.FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
            self._load(bucket.reconstruct_tensors())
        else:  # WeightUpdater.receive_weights_from_distributed
            weights, handles = [], []
            for name, dtype, shape in zip(names, dtypes, shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype), device="cpu")
                handles.append(dist.broadcast(weight, src=0, group=group, async_op=True))
                weights.append((name, weight))
            for handle in handles:
                handle.wait()
            self._load(weights)
        return {"success": True, "message": "Succeeded to update parameter online."}

    def update_weights_from_tensor(self, body: dict) -> dict:
        peers = [_forward(url + "/update_weights_from_tensor", body) for url in self.peers]
        for call in peers:
            call.start()
        try:
            answer = self._update_weights_from_tensor(body)
        finally:
            for call in peers:
                call.join()
        refused = [call.answer for call in peers if not call.answer.get("success")]
        return refused[0] if refused else answer

    def _update_weights_from_tensor(self, body: dict) -> dict:
        payloads = sglang.normalize_serialized_named_tensor_payloads(body["serialized_named_tensors"])
        self.owners.append(_segment_owners(payloads[self.tp_rank]))
        sglang.monkey_patch_torch_reductions()  # TpModelWorker.deserialize_own_rank
        named = sglang.MultiprocessingSerializer.deserialize(payloads[self.tp_rank])
        if body.get("load_format") == "flattened_bucket":  # WeightUpdater._update_weights_from_flattened_bucket
            metadata = [
                sglang.FlattenedTensorMetadata(
                    name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel
                )
                for m in named["metadata"]
            ]
            bucket = sglang.FlattenedTensorBucket(flattened_tensor=named["flattened_tensor"], metadata=metadata)
            named = bucket.reconstruct_tensors()
        if self.defer_copy_s:
            # SGLang answers after a CPU barrier while its copies out of CUDA IPC memory may still be queued: this
            # answers first and reads the tensors (kept referenced, as SGLang's queued copies keep them) later
            load = threading.Timer(self.defer_copy_s, self._load, args=(named,))
            load.start()
            self.pending.append(load)
        else:
            self._load(named)
        return {"success": True, "message": "Success"}

    def end_weight_update(self, body: dict) -> dict:
        return {"success": True, "weight_version": self.weight_version}

    def _load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        # in SGLang model.load_weights copies each tensor into its parameter before the request answers
        with self.lock:
            for name, tensor in named:
                held = self.received.get(name)
                if held is not None and held.shape == tensor.shape and held.dtype == tensor.dtype:
                    held.copy_(tensor)  # into the tensor it replaces, as into a parameter
                else:
                    self.received[name] = tensor.to("cpu", copy=True)
                self.arrivals[name] = self.arrivals.get(name, 0) + 1

    def dump_received(self, body: dict) -> dict:
        from safetensors.torch import save_file

        for load in self.pending:
            load.join()
        with self.lock:
            names = body.get("names") or list(self.received)
            save_file({name: self.received[name] for name in names if name in self.received}, body["path"])
            return {
                "success": True, "arrivals": dict(self.arrivals), "count": len(self.received), "owners": self.owners,
            }  # fmt: skip


def _segment_owners(payload: Any) -> list[int]:
    """The pids in the names of the shared-memory segments a payload refers to (torch's `file_system` strategy
    names each `/torch_<pid>_<random>_<n>` in the process that allocated it); [] for CUDA IPC handles."""
    import base64
    import pickletools
    import re

    raw = payload if isinstance(payload, bytes) else base64.b64decode(payload)
    args = (arg for _, arg, _ in pickletools.genops(raw) if isinstance(arg, (str, bytes)))
    found = (re.match(rb"/torch_(\d+)_", a if isinstance(a, bytes) else a.encode()) for a in args)
    return [int(m.group(1)) for m in found if m]


class _forward(threading.Thread):  # noqa: N801 (used as a call)
    """POST `body` to a peer TP rank's process on a thread; `answer` is its JSON (or the failure as SGLang's)."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.answer = url, body, {}

    def run(self) -> None:
        import urllib.request

        request = urllib.request.Request(
            self.url, data=json.dumps(self.body).encode(), headers={"Content-Type": "application/json"}
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=300) as response:
                self.answer = json.loads(response.read())
        except Exception as err:  # noqa: BLE001 (a refusal is answered, not raised)
            self.answer = {"success": False, "message": f"TP peer {self.url}: {type(err).__name__}: {err}"}


class Scheduler:
    """SGLang's control path in one process: a `FanOutCommunicator` ("queueing", fan-out 1: one TP rank) per route on
    an asyncio loop (the tokenizer manager's), whose send hands the request to one scheduler thread (SGLang's
    scheduler event loop) that serves requests one at a time in arrival order and answers through
    `handle_recv`. `delays`: group name -> seconds an init of it waits before it is queued."""

    def __init__(self, routes: dict[str, Any], delays: dict[str, float]) -> None:
        self.delays = delays
        self.inits_queued = threading.Condition()
        self.inits = 0  # inits queued so far
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.inbox: queue.Queue = queue.Queue()
        self.communicators = {route: self._communicator(fn) for route, fn in routes.items()}
        threading.Thread(target=self._serve, daemon=True).start()

    def _communicator(self, fn: Any) -> Any:
        async def make() -> Any:  # its asyncio.Lock belongs to this loop
            made: list = []
            made.append(communicator.FanOutCommunicator(lambda body: self._send(fn, body, made[0]), 1))
            return made[0]

        return asyncio.run_coroutine_threadsafe(make(), self.loop).result()

    def _send(self, fn: Any, body: dict, comm: Any) -> None:
        """The communicator's send: the request reaches the scheduler's queue (SGLang: its zmq socket)."""
        self.inbox.put((fn, body, comm))
        if "group_name" in body and "master_port" in body:  # an init: a delayed one may go in now
            with self.inits_queued:
                self.inits += 1
                self.inits_queued.notify_all()

    def _serve(self) -> None:
        while True:
            fn, body, comm = self.inbox.get()
            try:
                answer = fn(body)
            except Exception as err:  # noqa: BLE001 (SGLang answers a failed control request with success false)
                answer = {"success": False, "message": f"{type(err).__name__}: {err}"}
            self.loop.call_soon_threadsafe(comm.handle_recv, answer)

    def call(self, route: str, body: dict) -> dict:
        """Queue `body` for `route` and wait for its answer (an HTTP handler thread calls this)."""
        if route == "/init_weights_update_group":
            delay = self.delays.get(body.get("group_name", ""))
            if delay is not None:
                with self.inits_queued:
                    seen = self.inits
                    self.inits_queued.wait_for(lambda: self.inits > seen, timeout=delay)
        (answer,) = asyncio.run_coroutine_threadsafe(self.communicators[route](body), self.loop).result()
        return answer


def _handler(receiver: Receiver, delays: dict[str, float]) -> type[BaseHTTPRequestHandler]:
    scheduler = Scheduler(
        {
            "/init_weights_update_group": receiver.init_weights_update_group,
            "/destroy_weights_update_group": receiver.destroy_weights_update_group,
            "/update_weights_from_distributed": receiver.update_weights_from_distributed,
            "/update_weights_from_tensor": receiver.update_weights_from_tensor,
            "/begin_weight_update": lambda body: {"success": True},
            "/end_weight_update": receiver.end_weight_update,
        },
        delays,
    )
    routes = {route: (lambda body, route=route: scheduler.call(route, body)) for route in scheduler.communicators}
    routes["/dump_received"] = receiver.dump_received

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            route = routes.get(self.path)
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                answer = route(body) if route else {"success": False, "message": "no route"}
                status = 404 if route is None else 200 if answer.get("success") else 400
                if route and body.get("weight_version") is not None and answer.get("success"):
                    receiver.weight_version = str(body["weight_version"])
            except Exception as err:  # noqa: BLE001 (SGLang answers a failed update with success false)
                answer, status = {"success": False, "message": f"{type(err).__name__}: {err}"}, 400
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--defer-copy-s", type=float, default=0.0, help="answer tensor updates first, copy this later")
    parser.add_argument("--peer", action="append", default=[], help="another TP rank's URL (rank 0 of an engine)")
    parser.add_argument(
        "--delay-init", action="append", default=[], metavar="GROUP=SECONDS",
        help="an /init_weights_update_group of GROUP is queued this late",
    )  # fmt: skip
    parser.add_argument("--nccl-store-only", action="store_true", help="an nccl init runs only its TCP-store part")
    args = parser.parse_args()
    delays = {name: float(s) for name, s in (spec.rsplit("=", 1) for spec in args.delay_init)}
    receiver = Receiver(args.tp_rank, args.defer_copy_s, args.peer, args.nccl_store_only)
    server = ThreadingHTTPServer((args.host, 0), _handler(receiver, delays))
    print(f"READY http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
