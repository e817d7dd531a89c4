"""The embedded server's weight and memory routes: SGLang 0.5.23's weight-update API over our `WeightReceiver`.

```
/begin_weight_update   open a session (400 while one is open: SGLang's message)
/update_weights_from_tensor | _distributed | _disk   stage a bucket (400 outside a session; flush_cache as SGLang)
/end_weight_update     commit between two decode steps; weight_version moves only if a bucket named one
/abort_weight_update   ours: drop the open session, commit nothing (SGLang has no such route, see below)
/update_weight_version, /get_weights_by_name, /release_memory_occupation, /resume_memory_occupation
```
Control requests (`SERIALISED_ROUTES`: the weight updates, group init/destroy, pause, continue, release, resume)
are served one at a time per server, in arrival order, each blocking until done (`WeightRoutes.one_at_a_time`),
as SGLang's are: its tokenizer manager holds `model_update_lock`'s writer side (or, while paused, `is_pause_cond`)
around each `/update_weights_from_*` and begin/end call, every control request goes through a FIFO "queueing"
`FanOutCommunicator` (`managers/communicator.py`: an asyncio lock held from send to reply), and its one scheduler
thread blocks in `init_custom_process_group` until the group forms, or in a broadcast until the sender arrives. A
client that posts two buckets (or two groups' inits) to one engine and broadcasts (joins) them in another order
deadlocks there, and so it does here; a pause posted behind an init that waits for its group waits too.
SGLang loads each bucket into the live weights as it arrives (visible to requests between calls) and its
`/end_weight_update` only finalises; ours stages and commits at the end, so no token mixes two versions. A sender
that dies mid-push leaves SGLang's session open until someone calls `/end_weight_update` over the half-loaded
weights; ours offers `/abort_weight_update` to drop it (the controller calls whichever the engine has).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from aiohttp import web

from mcore_rl.rollout.protocol import BadRequest, check_update_group
from mcore_rl.rollout.weight_receiver import (
    WeightUpdateError,
    decode_payload,
    read_safetensors_dir,
    return_freed_memory,
)

if TYPE_CHECKING:
    from mcore_rl.rollout.server import EngineServer

#: SGLang's answer when an update asked for flush_cache while requests were running or queued
FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)


def outside_session(route: str) -> str:
    """SGLang's refusal of an update outside a session."""
    return f"{route} must run between begin_weight_update() and end_weight_update()"


def ok(message: str = "Success", **extra: Any) -> web.Response:
    """SGLang's `{"success": true, "message": ...}` answer."""
    return web.json_response({"success": True, "message": message, **extra})


def refused(message: str, status: int = 400) -> web.Response:
    """SGLang's `{"success": false, "message": ...}` answer (HTTP 400)."""
    return web.json_response({"success": False, "message": message}, status=status)


def field(body: dict, key: str, kind: type | tuple[type, ...], default: Any = ..., name: str = "") -> Any:
    """`body[key]` checked against `kind` (bool is not an int); BadRequest naming the key otherwise."""
    if key not in body or body[key] is None:
        if default is ...:
            raise BadRequest(f"missing field {key!r}{name}")
        return default
    if not isinstance(body[key], kind) or (kind in (int, (int, float), (str, int)) and isinstance(body[key], bool)):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadRequest(f"field {key!r} is a {type(body[key]).__name__}, expected {expected}")
    return body[key]


#: the control routes SGLang serves one at a time, in arrival order, each blocking until done (see the module
#: docstring); /abort_weight_update is ours and joins them
SERIALISED_ROUTES = (
    "/begin_weight_update",
    "/abort_weight_update",
    "/end_weight_update",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/pause_generation",
    "/continue_generation",
    # not /flush_cache: SGLang defers a flush that finds requests running inside its scheduler loop, which goes on
    # serving (a /continue_generation included), so a waiting flush must not hold the queue (docs/embedded_server.md)
    "/release_memory_occupation",
    "/resume_memory_occupation",
)


class WeightRoutes:
    """The weight-update and memory handlers of `EngineServer` (a mixin: `self` is the server)."""

    #: update requests that arrived and wait for an earlier one to finish (the lock is made on first use, in the loop)
    updates_waiting: int = 0
    _update_lock: asyncio.Lock | None = None

    def one_at_a_time(self: EngineServer, handler: Callable[[web.Request], Any]) -> Callable[[web.Request], Any]:
        """`handler` served after every control request that arrived before it has answered (asyncio.Lock is FIFO).

        Generation, `/health` and the other routes do not take the lock: ours stage into shadows while decoding
        goes on (a documented difference: SGLang holds new generations behind the writer lock)."""

        async def serialised(request: web.Request) -> web.StreamResponse:
            if self._update_lock is None:
                self._update_lock = asyncio.Lock()
            self.updates_waiting += 1
            try:
                await self._update_lock.acquire()
            finally:
                self.updates_waiting -= 1
            try:
                return await handler(request)
            finally:
                self._update_lock.release()

        return serialised

    async def begin_weight_update(self: EngineServer, request: web.Request) -> web.Response:
        await self._body(request)
        # paused (a pause, or released weights): no decode step runs until the session ends, so the buckets go
        # straight into the live weights, without a staging copy (rollout/weight_receiver.py)
        return ok(await asyncio.to_thread(self.receiver.begin, self.batcher.paused))

    async def abort_weight_update(self: EngineServer, request: web.Request) -> web.Response:
        await self._body(request)
        message = await asyncio.to_thread(self.receiver.abort)  # waits for the session's running copies
        # false: a bucket was written in place before the abort; the engine stays paused (the fence holds it)
        return ok(message, weights_intact=not self.receiver.incomplete)

    async def _stage(
        self: EngineServer, route: str, body: dict, named_fn: Callable[[], list[tuple[str, torch.Tensor]]]
    ) -> web.Response:
        version = field(body, "weight_version", (str, int), None)
        flush = field(body, "flush_cache", bool, True)  # SGLang's default
        abort_all = field(body, "abort_all_requests", bool, False)
        if not self.receiver.session_open:
            raise WeightUpdateError(outside_session(route))

        def stage() -> int:
            try:
                named = named_fn()
            except Exception as err:  # a payload that cannot be read spoils the session like a refused tensor
                self.receiver.fail(str(err))
                raise WeightUpdateError(f"bucket refused, old weights kept: {err}") from err
            return self.receiver.stage(named, version)

        count = await asyncio.to_thread(stage)
        if abort_all:
            await asyncio.wrap_future(self.batcher.abort(None, "aborted for a weight update"))
        if flush and not await self._idle():
            return refused(FLUSH_REFUSED)  # the bucket stays staged, as SGLang's stays loaded
        return ok(f"staged {count} tensors")

    async def update_weights_from_tensor(self: EngineServer, request: web.Request) -> web.Response:
        body = await self._body(request)
        payloads = field(body, "serialized_named_tensors", list)
        if not payloads or not isinstance(payloads[0], (str, bytes)):
            raise BadRequest("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
        load_format = field(body, "load_format", str, None)
        # One TP rank here: SGLang's rank r reads element r, so this server reads element 0.
        return await self._stage("update_weights_from_tensor", body, lambda: decode_payload(payloads[0], load_format))

    async def init_weights_update_group(self: EngineServer, request: web.Request) -> web.Response:
        from mcore_rl.parallel.update_group import new_update_group

        body = await self._body(request)
        address = field(body, "master_address", str)
        port = field(body, "master_port", int)
        rank = field(body, "rank_offset", int)
        world = field(body, "world_size", int)
        name = field(body, "group_name", str, "weight_update_group")
        backend = field(body, "backend", str, "nccl")
        # not in SGLang's request: how long a broadcast of this group may wait for its sender (a dead sender's
        # bucket fails after it, and the session with it)
        timeout_s = check_update_group(port, rank, world, field(body, "timeout_s", (int, float), 300.0))
        if backend == "nccl" and self.engine.device.type != "cuda":
            backend = "gloo"  # this engine holds CPU tensors; gloo is the CPU broadcast backend
        try:
            group = await asyncio.to_thread(new_update_group, backend, address, port, rank, world, name, timeout_s)
        except (ValueError, RuntimeError) as err:
            return refused(f"could not join update group {name!r} at {address}:{port}: {err}")
        self.receiver.groups[name] = group
        return ok(f"joined update group {name!r} as rank {rank} of {world} ({backend})")

    async def destroy_weights_update_group(self: EngineServer, request: web.Request) -> web.Response:
        name = field(await self._body(request), "group_name", str, "weight_update_group")
        if self.receiver.groups.pop(name, None) is None:
            return refused(f"no update group {name!r}")
        return ok(f"left update group {name!r}")

    async def update_weights_from_distributed(self: EngineServer, request: web.Request) -> web.Response:
        body = await self._body(request)
        names = field(body, "names", list)
        dtypes = field(body, "dtypes", list)
        shapes = field(body, "shapes", list)
        group = field(body, "group_name", str, "weight_update_group")
        load_format = field(body, "load_format", str, None)
        if not self.receiver.session_open:  # refuse before joining the broadcast: the sender will time out
            raise WeightUpdateError(outside_session("update_weights_from_distributed"))
        return await self._stage(
            "update_weights_from_distributed",
            body,
            lambda: self.receiver.receive_distributed(names, dtypes, shapes, group, load_format),
        )

    async def update_weights_from_disk(self: EngineServer, request: web.Request) -> web.Response:
        body = await self._body(request)
        path = field(body, "model_path", str)
        if self.receiver.session_open:
            return await self._stage("update_weights_from_disk", body, lambda: read_safetensors_dir(path))
        # Outside a session a disk update is its own session, committed at once (SGLang needs no session for it).
        await asyncio.to_thread(self.receiver.begin, self.batcher.paused)
        try:
            staged = await self._stage(
                "update_weights_from_disk", {**body, "flush_cache": False}, lambda: read_safetensors_dir(path)
            )
        except WeightUpdateError:
            self.receiver.discard()
            raise
        if staged.status != 200:
            self.receiver.discard()
            return staged
        committed = await self._commit()
        if field(body, "flush_cache", bool, True) and not await self._idle():
            return refused(FLUSH_REFUSED)
        return committed

    async def end_weight_update(self: EngineServer, request: web.Request) -> web.Response:
        await self._body(request)
        return await self._commit()

    async def _commit(self: EngineServer) -> web.Response:
        staged = await asyncio.to_thread(self.receiver.take_commit)  # waits for buckets still being copied

        def commit() -> None:
            staged.apply()
            if staged.version is not None:  # as SGLang: the version moves only when an update named one
                self.engine.weight_version = staged.version
            if self._held_for_weights and self.receiver.generation_blocked() is None:
                self._held_for_weights = self.batcher._paused = False  # the resume's unpause, now the weights are whole

        await asyncio.wrap_future(self.batcher.call(commit))
        return ok(f"committed {staged.count} tensors", weight_version=self._version())

    async def update_weight_version(self: EngineServer, request: web.Request) -> web.Response:
        body = await self._body(request)
        version = str(field(body, "new_version", (str, int)))
        if field(body, "abort_all_requests", bool, True):  # SGLang's default
            await asyncio.wrap_future(self.batcher.abort(None, "aborted for a weight version update"))
        await asyncio.wrap_future(self.batcher.call(lambda: setattr(self.engine, "weight_version", version)))
        return ok(f"Weight version updated to {version}", new_version=version)

    async def get_weights_by_name(self: EngineServer, request: web.Request) -> web.Response:
        body = await self._body(request)
        name = field(body, "name", str)
        size = field(body, "truncate_size", (int, str), 100)
        if isinstance(size, str):  # a GET passes it in the query string
            if not size.isdigit():
                raise BadRequest(f"truncate_size={size!r} is invalid: expected a non-negative integer")
            size = int(size)
        if size < 0:
            raise BadRequest(f"truncate_size={size!r} is invalid: expected a non-negative integer")
        tensor = self.engine.state_dict_hf().get(name)
        if tensor is None:
            raise BadRequest(f"unknown tensor {name!r}: expected an HF checkpoint name of this model")
        return web.json_response(tensor[:size].float().tolist())

    def _tags(self: EngineServer, body: dict) -> set[str]:
        tags = field(body, "tags", list, ["weights", "kv_cache"])
        unknown = [t for t in tags if t not in ("weights", "kv_cache", "cuda_graph")]
        if unknown:
            raise BadRequest(f"unknown memory tags {unknown}; expected weights, kv_cache, cuda_graph")
        return set(tags)

    async def release_memory_occupation(self: EngineServer, request: web.Request) -> web.Response:
        tags = self._tags(await self._body(request))
        if self.batcher.num_running + self.batcher.num_waiting:
            return refused("requests are in flight: pause generation (mode abort or retract) before releasing memory")

        def release() -> None:
            if "weights" in tags and not self._released:
                self.receiver.release()  # the staging and receive buffers kept for the next update go too
                for name, param in self.engine.model.named_parameters():
                    self._released[name] = param.shape
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                return_freed_memory()  # on CPU, or the freed weights stay in the heap's arenas
            if "kv_cache" in tags:
                self._kv_released = True
            if self._released or self._kv_released:
                self.batcher._paused = True  # nothing runs on released memory; requests wait for resume

        await asyncio.wrap_future(self.batcher.call(release))
        return ok(f"released {sorted(tags)}")

    async def resume_memory_occupation(self: EngineServer, request: web.Request) -> web.Response:
        tags = self._tags(await self._body(request))

        def resume() -> None:
            if "weights" in tags and self._released:
                # The values are gone (as with SGLang's memory saver): the next weight update refills them, and
                # generation waits for it (the receiver counts them incomplete)
                for name, param in self.engine.model.named_parameters():
                    param.data = torch.zeros(self._released[name], dtype=param.dtype, device=param.device)
                self.receiver.mark_incomplete(self._released)
                self._released.clear()
            if "kv_cache" in tags:
                self._kv_released = False
            if not self._released and not self._kv_released:
                self._held_for_weights = self.receiver.generation_blocked() is not None
                self.batcher._paused = self._held_for_weights

        await asyncio.wrap_future(self.batcher.call(resume))
        return ok(f"resumed {sorted(tags)}")
