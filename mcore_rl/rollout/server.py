"""The embedded rollout server: SGLang's HTTP API over the transformers engine, with continuous batching.

    python -m mcore_rl.rollout.server --model DIR | --hf-config FILE [--tokenizer DIR] [--host 127.0.0.1]
        [--port N] [--api-key K] [--dtype float32] [--max-running-requests N] [--context-length N]

Routes (SGLang 0.5.x names and JSON shapes): /generate (one request or a batch, `n` samples, logprobs, routed
experts, SSE streaming), /health, /health_generate, /model_info, /server_info (+ the deprecated get_ names),
/v1/loads, /abort_request, /pause_generation, /continue_generation, /flush_cache, /begin_weight_update,
/update_weights_from_tensor, /init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group, /update_weights_from_disk, /end_weight_update, /update_weight_version,
/get_weight_version, /get_weights_by_name, /release_memory_occupation, /resume_memory_occupation.

```
HTTP (aiohttp event loop) --parse_generate--> Sequences --submit--> ContinuousBatcher thread --on_event--> response
weight routes --> WeightReceiver (check + stage) --end_weight_update--> commit between two decode steps
```
Bad requests get 400 with a message naming the key or tensor. It binds 127.0.0.1 unless told otherwise, refuses a
non-loopback bind without --api-key, and with a key every route but /health needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

import torch
from aiohttp import web

from mcore_rl.rollout.engine import HFRolloutEngine
from mcore_rl.rollout.protocol import BadRequest, parse_generate, response_object
from mcore_rl.rollout.scheduler import ContinuousBatcher, GenParams, Sequence
from mcore_rl.rollout.sglang_launcher import is_loopback
from mcore_rl.rollout.weight_receiver import WeightReceiver, WeightUpdateError, decode_payload, read_safetensors_dir

log = logging.getLogger(__name__)


class _QuietProtocolProbes(logging.Filter):
    """sglang-router probes every new worker for HTTP and gRPC at once; the gRPC probe's HTTP/2 preface makes
    aiohttp log a BadHttpMessage ("Pause on PRI/Upgrade") traceback that says nothing about our server."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PRI/Upgrade" not in str(record.exc_info[1] if record.exc_info else record.getMessage())


logging.getLogger("aiohttp.server").addFilter(_QuietProtocolProbes())
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _ok(message: str = "Success", **extra: Any) -> web.Response:
    return web.json_response({"success": True, "message": message, **extra})


def _refused(message: str, status: int = 400) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=status)


async def _wrap(future: Future) -> Any:
    return await asyncio.wrap_future(future)


class EngineServer:
    """One engine, its batcher and weight receiver, and the aiohttp application serving them."""

    def __init__(
        self,
        engine: HFRolloutEngine,
        *,
        tokenizer: Any = None,
        model_path: str = "",
        max_running_requests: int = 256,
        context_length: int | None = None,
        api_key: str | None = None,
        eos_token_ids: list[int] | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.api_key = api_key
        eos = eos_token_ids if eos_token_ids is not None else _eos_ids(engine, tokenizer)
        self.batcher = ContinuousBatcher(
            engine,
            max_running=max_running_requests,
            context_length=context_length,
            eos_token_ids=eos,
            stop_checker=self._stop_checker if tokenizer is not None else None,
        )
        self.receiver = WeightReceiver(engine)
        self._released: dict[str, torch.Size] = {}  # parameter name -> shape, while weights are released
        self._kv_released = False

    # ------------------------------------------------------------------ text
    def _encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise BadRequest(f"text must be a string, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _decode(self, ids: Any, skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _stop_checker(self, seq: Sequence) -> str | None:
        tail = self._decode(seq.output_ids[-8:], False)
        return next((s for s in seq.params.stop if s in tail), None)

    # ------------------------------------------------------------------ application
    def app(self) -> web.Application:
        """The aiohttp application with every route and the auth/JSON middleware."""
        app = web.Application(middlewares=[self._middleware], client_max_size=1 << 30)
        get_post = ("GET", "POST")
        routes: list[tuple[tuple[str, ...], str, Handler]] = [
            (("GET",), "/health", self.health),
            (("GET",), "/health_generate", self.health_generate),
            (("GET",), "/model_info", self.model_info),
            (("GET",), "/get_model_info", self.model_info),
            (("GET",), "/server_info", self.server_info),
            (("GET",), "/get_server_info", self.server_info),
            (("GET",), "/v1/loads", self.loads),
            (("GET",), "/get_weight_version", self.get_weight_version),
            (("POST", "PUT"), "/generate", self.generate),
            (("POST",), "/abort_request", self.abort_request),
            (("POST",), "/pause_generation", self.pause_generation),
            (("POST",), "/continue_generation", self.continue_generation),
            (get_post, "/flush_cache", self.flush_cache),
            (("POST",), "/begin_weight_update", self.begin_weight_update),
            (("POST",), "/end_weight_update", self.end_weight_update),
            (("POST",), "/update_weights_from_tensor", self.update_weights_from_tensor),
            (("POST",), "/init_weights_update_group", self.init_weights_update_group),
            (("POST",), "/destroy_weights_update_group", self.destroy_weights_update_group),
            (("POST",), "/update_weights_from_distributed", self.update_weights_from_distributed),
            (("POST",), "/update_weights_from_disk", self.update_weights_from_disk),
            (("POST",), "/update_weight_version", self.update_weight_version),
            (get_post, "/get_weights_by_name", self.get_weights_by_name),
            (get_post, "/release_memory_occupation", self.release_memory_occupation),
            (get_post, "/resume_memory_occupation", self.resume_memory_occupation),
        ]
        for methods, path, handler in routes:
            for method in methods:
                app.router.add_route(method, path, handler)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.batcher.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        self.batcher.stop()

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.api_key is not None and request.path != "/health":
            if request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
                return web.json_response({"error": {"message": "missing or wrong API key", "code": 401}}, status=401)
        try:
            return await handler(request)
        except BadRequest as err:
            return web.json_response({"error": {"message": str(err), "code": 400}}, status=400)
        except WeightUpdateError as err:
            return _refused(str(err))

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return dict(request.query)
        raw = await request.read()
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as err:
            raise BadRequest(f"malformed JSON body: {err}") from err
        if not isinstance(body, dict):
            raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
        return body

    @staticmethod
    def _field(body: dict, key: str, kind: type | tuple[type, ...], default: Any = ..., name: str = "") -> Any:
        if key not in body or body[key] is None:
            if default is ...:
                raise BadRequest(f"missing field {key!r}{name}")
            return default
        if not isinstance(body[key], kind) or (kind is int and isinstance(body[key], bool)):
            expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise BadRequest(f"field {key!r} is a {type(body[key]).__name__}, expected {expected}")
        return body[key]

    # ------------------------------------------------------------------ generation
    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        seqs, as_list, stream = parse_generate(
            body,
            vocab_size=self.engine.vocab_size,
            context_length=self.batcher.context_length,
            encode=self._encode if self.tokenizer is not None else None,
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[int] = asyncio.Queue()
        index = {id(seq): i for i, seq in enumerate(seqs)}
        for seq in seqs:
            if stream:
                seq.on_event = lambda s: loop.call_soon_threadsafe(events.put_nowait, index[id(s)])
            else:
                seq.on_event = lambda s: s.finish is not None and loop.call_soon_threadsafe(events.put_nowait, 0)
        decode = self._decode if self.tokenizer is not None else None
        text_logprobs = bool(body.get("return_text_in_logprobs"))
        self.batcher.submit(seqs)
        try:
            if not stream:
                while any(s.finish is None for s in seqs):
                    await events.get()
                version = self._version()
                out = [response_object(s, i, decode, text_logprobs, version) for i, s in enumerate(seqs)]
                return web.json_response(out if as_list else out[0])
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            done = [False] * len(seqs)
            while not all(done):
                changed = {await events.get()}
                while not events.empty():
                    changed.add(events.get_nowait())
                for i in sorted(changed):
                    if done[i]:
                        continue
                    # `finish` is set before the sequence's last event is queued: once a chunk shows it, that chunk
                    # holds the final tokens and the sequence is done
                    done[i] = seqs[i].finish is not None
                    chunk = json.dumps(response_object(seqs[i], i, decode, text_logprobs, self._version()))
                    await response.write(f"data: {chunk}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:  # the client went away (or the handler failed): stop spending decode steps on it
            for seq in seqs:
                if seq.finish is None:
                    self.batcher.abort(seq.rid, "client disconnected")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.batcher.paused or self.batcher.num_running:
            return web.Response(status=200)  # busy or paused: alive, nothing to prove with an extra request
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        seq = Sequence(
            "health_generate",
            [0],
            GenParams(max_new_tokens=1, temperature=0.0),
            on_event=lambda s: s.finish is not None and loop.call_soon_threadsafe(done.set),
        )
        self.batcher.submit([seq])
        try:
            await asyncio.wait_for(done.wait(), timeout=20)
        except asyncio.TimeoutError:
            self.batcher.abort(seq.rid)
            return web.Response(status=503)
        return web.Response(status=200 if seq.finish.get("type") != "abort" else 503)

    def _version(self) -> str:
        return str(self.engine.weight_version)

    async def model_info(self, request: web.Request) -> web.Response:
        config = self.engine.config
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.model_path or config.model_type,
                "tokenizer_path": getattr(self.tokenizer, "name_or_path", None),
                "is_generation": True,
                "weight_version": self._version(),
                "model_type": config.model_type,
                "architectures": getattr(config, "architectures", None),
                "vocab_size": self.engine.vocab_size,
                "num_hidden_layers": config.num_hidden_layers,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.model_path or self.engine.config.model_type,
                "tp_size": 1, "pp_size": 1, "ep_size": 1, "dp_size": 1, "moe_dp_size": 1, "num_gpus": 0,
                "max_running_requests": self.batcher.max_running,
                "context_length": self.batcher.context_length,
                "skip_tokenizer_init": self.tokenizer is None,
                "weight_version": self._version(),
                "disaggregation_mode": "null",
                "version": "mcore_rl-embedded",
                "internal_states": [self._state()],
            }
        )  # fmt: skip

    def _state(self) -> dict[str, Any]:
        return {
            "num_running_reqs": self.batcher.num_running,
            "num_waiting_reqs": self.batcher.num_waiting,
            "paused": self.batcher.paused,
            "weights_released": bool(self._released),
            "weight_update_session_open": self.receiver.session_open,
            "staged_tensors": self.receiver.staged_count,
            **self.batcher.stats,
        }

    async def loads(self, request: web.Request) -> web.Response:
        state = self._state()
        load = {k: state[k] for k in ("num_running_reqs", "num_waiting_reqs")}
        return web.json_response({"loads": [{"dp_rank": 0, **load}]})

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self._version()})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        abort_all = bool(body.get("abort_all", False))
        rid = self._field(body, "rid", str, "")
        if not abort_all and not rid:
            raise BadRequest("give rid (a request id) or abort_all=true")
        await _wrap(self.batcher.abort(None if abort_all else rid))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = self._field(await self._body(request), "mode", str, "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode={mode!r} is invalid: expected abort, retract or in_place")
        await _wrap(self.batcher.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await _wrap(self.batcher.resume())
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        # No prefix cache outlives a request here; like SGLang, refuse while requests are in flight.
        busy = self.batcher.num_running + self.batcher.num_waiting
        if busy:
            return web.Response(status=400, text=f"Cache not flushed: {busy} requests are running or waiting.\n")
        return web.Response(status=200, text="Cache flushed.\n")

    # ------------------------------------------------------------------ weights
    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await self._body(request)
        return _ok(await asyncio.to_thread(self.receiver.begin))  # waits for a dropped session's copies

    async def _stage(self, body: dict, named_fn: Callable[[], list[tuple[str, torch.Tensor]]]) -> web.Response:
        version = self._field(body, "weight_version", (str, int), None)
        if not self.receiver.session_open:
            raise WeightUpdateError("no weight update session: call /begin_weight_update first")

        def stage() -> int:
            try:
                named = named_fn()
            except Exception as err:  # a payload that cannot be read spoils the session like a refused tensor
                self.receiver.fail(str(err))
                raise WeightUpdateError(f"bucket refused, old weights kept: {err}") from err
            return self.receiver.stage(named, version)

        count = await asyncio.to_thread(stage)
        if body.get("abort_all_requests"):
            await _wrap(self.batcher.abort(None, "aborted for a weight update"))
        return _ok(f"staged {count} tensors")

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        payloads = self._field(body, "serialized_named_tensors", list)
        if not payloads or not isinstance(payloads[0], (str, bytes)):
            raise BadRequest("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
        load_format = self._field(body, "load_format", str, None)
        # One TP rank here: SGLang's rank r reads element r, so this server reads element 0.
        return await self._stage(body, lambda: decode_payload(payloads[0], load_format))

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        from mcore_rl.parallel.update_group import new_update_group

        body = await self._body(request)
        address = self._field(body, "master_address", str)
        port = self._field(body, "master_port", int)
        rank = self._field(body, "rank_offset", int)
        world = self._field(body, "world_size", int)
        name = self._field(body, "group_name", str, "weight_update_group")
        backend = self._field(body, "backend", str, "nccl")
        # not in SGLang's request: how long a broadcast of this group may wait for its sender (a dead sender's
        # bucket fails after it, and the session with it)
        timeout_s = float(self._field(body, "timeout_s", (int, float), 300.0))
        if backend == "nccl" and self.engine.device.type != "cuda":
            backend = "gloo"  # this engine holds CPU tensors; gloo is the CPU broadcast backend
        try:
            group = await asyncio.to_thread(new_update_group, backend, address, port, rank, world, name, timeout_s)
        except (ValueError, RuntimeError) as err:
            return _refused(f"could not join update group {name!r} at {address}:{port}: {err}")
        self.receiver.groups[name] = group
        return _ok(f"joined update group {name!r} as rank {rank} of {world} ({backend})")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        name = self._field(await self._body(request), "group_name", str, "weight_update_group")
        if self.receiver.groups.pop(name, None) is None:
            return _refused(f"no update group {name!r}")
        return _ok(f"left update group {name!r}")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        names = self._field(body, "names", list)
        dtypes = self._field(body, "dtypes", list)
        shapes = self._field(body, "shapes", list)
        group = self._field(body, "group_name", str, "weight_update_group")
        load_format = self._field(body, "load_format", str, None)
        if not self.receiver.session_open:  # refuse before joining the broadcast: the sender will time out
            raise WeightUpdateError("no weight update session: call /begin_weight_update first")
        return await self._stage(
            body, lambda: self.receiver.receive_distributed(names, dtypes, shapes, group, load_format)
        )

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        path = self._field(body, "model_path", str)
        if self.receiver.session_open:
            return await self._stage(body, lambda: read_safetensors_dir(path))
        self.receiver.begin()  # outside a session a disk update is its own session, committed at once
        try:
            await self._stage(body, lambda: read_safetensors_dir(path))
        except WeightUpdateError:
            self.receiver.discard()
            raise
        return await self._commit()

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await self._body(request)
        return await self._commit()

    async def _commit(self) -> web.Response:
        staged = await asyncio.to_thread(self.receiver.take_commit)  # waits for buckets still being copied

        def commit() -> None:
            staged.apply()
            if staged.version is not None:
                self.engine.weight_version = staged.version

        await _wrap(self.batcher.call(commit))
        return _ok(f"committed {staged.count} tensors", weight_version=self._version())

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        version = str(self._field(body, "new_version", (str, int)))
        if body.get("abort_all_requests", True):
            await _wrap(self.batcher.abort(None, "aborted for a weight version update"))
        await _wrap(self.batcher.call(lambda: setattr(self.engine, "weight_version", version)))
        return _ok(f"Weight version updated to {version}", new_version=version)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        name = self._field(body, "name", str)
        size = int(self._field(body, "truncate_size", (int, str), 100))
        tensor = self.engine.state_dict_hf().get(name)
        if tensor is None:
            raise BadRequest(f"unknown tensor {name!r}: expected an HF checkpoint name of this model")
        return web.json_response(tensor[:size].float().tolist())

    def _tags(self, body: dict) -> set[str]:
        tags = self._field(body, "tags", list, ["weights", "kv_cache"])
        unknown = set(tags) - {"weights", "kv_cache", "cuda_graph"}
        if unknown:
            raise BadRequest(f"unknown memory tags {sorted(unknown)}; expected weights, kv_cache, cuda_graph")
        return set(tags)

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = self._tags(await self._body(request))
        if self.batcher.num_running + self.batcher.num_waiting:
            return _refused("requests are in flight: pause generation (mode abort or retract) before releasing memory")

        def release() -> None:
            if "weights" in tags and not self._released:
                self.receiver.release()  # the staging and receive buffers kept for the next update go too
                for name, param in self.engine.model.named_parameters():
                    self._released[name] = param.shape
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            if "kv_cache" in tags:
                self._kv_released = True
            if self._released or self._kv_released:
                self.batcher._paused = True  # nothing runs on released memory; requests wait for resume

        await _wrap(self.batcher.call(release))
        return _ok(f"released {sorted(tags)}")

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = self._tags(await self._body(request))

        def resume() -> None:
            if "weights" in tags and self._released:
                # The values are gone (as with SGLang's memory saver): the next weight update refills them.
                for name, param in self.engine.model.named_parameters():
                    param.data = torch.zeros(self._released[name], dtype=param.dtype, device=param.device)
                self._released.clear()
            if "kv_cache" in tags:
                self._kv_released = False
            if not self._released and not self._kv_released:
                self.batcher._paused = False

        await _wrap(self.batcher.call(resume))
        return _ok(f"resumed {sorted(tags)}")


def _eos_ids(engine: HFRolloutEngine, tokenizer: Any) -> list[int]:
    ids = engine.config.eos_token_id
    out = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        out.add(tokenizer.eos_token_id)
    return sorted(out)


class ServerThread:
    """Serve an `EngineServer` on a background thread (how the Ray engine actor runs it)."""

    def __init__(self, server: EngineServer, host: str = "127.0.0.1", port: int = 0) -> None:
        if not is_loopback(host) and server.api_key is None:
            raise ValueError(f"binding {host!r} (not loopback) needs an API key (--api-key)")
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(server.app(), access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, host, port)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcore-rl-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        async def _shutdown() -> None:
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


def build_server(
    model: str | dict[str, Any],
    *,
    tokenizer: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    max_running_requests: int = 256,
    context_length: int | None = None,
    api_key: str | None = None,
    weight_version: str = "default",
    init_seed: int = 0,
) -> EngineServer:
    """An EngineServer for a checkpoint dir or an HF config dict (random weights; a sync fills them)."""
    engine = HFRolloutEngine(model, dtype=dtype, device=device, init_seed=init_seed)
    engine.weight_version = weight_version
    tok = None
    source = tokenizer or (model if isinstance(model, str) else None)
    if source is not None and any(
        os.path.exists(os.path.join(source, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(source)
    elif tokenizer is not None:
        raise ValueError(f"--tokenizer {tokenizer!r} holds no tokenizer.json or tokenizer_config.json")
    if context_length is not None and context_length < 2:
        raise ValueError(f"--context-length {context_length} is invalid: expected an integer >= 2")
    return EngineServer(
        engine,
        tokenizer=tok,
        model_path=model if isinstance(model, str) else "",
        max_running_requests=max_running_requests,
        context_length=context_length,
        api_key=api_key,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m mcore_rl.rollout.server")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="HF checkpoint dir (config.json + safetensors [+ tokenizer])")
    source.add_argument("--hf-config", help="an HF config.json: random weights, filled by weight updates")
    parser.add_argument("--tokenizer", help="tokenizer dir (default: the model dir, if it holds one)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--weight-version", default="default")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.max_running_requests < 1:
        parser.error(f"--max-running-requests {args.max_running_requests} is invalid: expected an integer >= 1")
    if not is_loopback(args.host) and not args.api_key:
        parser.error(f"--host {args.host} is not a loopback address: binding it needs --api-key")
    try:
        if args.hf_config:
            with open(args.hf_config) as f:
                try:
                    model: str | dict = json.load(f)
                except json.JSONDecodeError as err:
                    raise ValueError(f"--hf-config {args.hf_config}: not valid JSON ({err})") from None
            if not isinstance(model, dict):
                raise ValueError(f"--hf-config {args.hf_config}: expected a JSON object (an HF config.json)")
        else:
            if not os.path.isfile(os.path.join(args.model, "config.json")):
                raise ValueError(f"--model {args.model!r}: no config.json there")
            model = args.model
        server = build_server(
            model,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            device=args.device,
            max_running_requests=args.max_running_requests,
            context_length=args.context_length,
            api_key=args.api_key,
            weight_version=args.weight_version,
        )
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"serving {args.model or args.hf_config} on http://{args.host}:{args.port}", flush=True)
    web.run_app(server.app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
