"""The embedded rollout server: SGLang's HTTP API over the transformers engine, with continuous batching.

    python -m mcore_rl.rollout.server --model DIR | --hf-config FILE [--tokenizer DIR] [--host 127.0.0.1]
        [--port N] [--api-key K] [--dtype float32] [--max-running-requests N] [--max-queued-requests N]
        [--context-length N] [--max-request-bytes N]

Routes (SGLang 0.5.x names and JSON shapes): /generate (one request or a batch, `n` samples, logprobs, routed
experts, SSE streaming), /health, /health_generate, /model_info, /server_info (+ the deprecated get_ names),
/v1/loads, /abort_request, /pause_generation, /continue_generation, /flush_cache, and the weight routes of
`weight_routes.py` (/begin_weight_update ... /end_weight_update, /abort_weight_update, memory release/resume).

```
HTTP (aiohttp event loop) --read (<= --max-request-bytes)--> worker thread: JSON, tokenize, parse_generate
    --> Sequences --submit--> ContinuousBatcher thread --on_event--> response
weight routes --> WeightReceiver (check + stage) --end_weight_update--> commit between two decode steps
```
Bad requests get 400 with a message naming the key (and, for a limit, the flag that raises it); nothing a client
sends is parsed or tokenized on the event loop, so /health answers while a large request is refused. It binds
127.0.0.1 unless told otherwise, refuses a non-loopback bind without --api-key, and with a key every route but
/health and /health_generate (as SGLang's) needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import math
import os
import stat
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

from mcore_rl.parallel.net import is_loopback

#: a request body larger than this is refused before it is read whole (--max-request-bytes)
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
#: sequences waiting for a batch slot, all requests together (--max-queued-requests; SGLang's is unbounded)
DEFAULT_MAX_QUEUED_REQUESTS = 4096


def parse_cli(argv: list[str] | None = None) -> tuple[argparse.Namespace, str | dict]:
    """The CLI's arguments, each checked, and the model to serve: the --model directory or the --hf-config dict.
    A bad argument exits 2 naming it (as argparse's usage errors do). Standard library only: `python -m` runs this
    before the imports below (torch, aiohttp, transformers: seconds), so a refusal takes a fraction of a second."""
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
    parser.add_argument(
        "--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS, help="sequences waiting, in all"
    )
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    parser.add_argument("--weight-version", default="default")
    args = parser.parse_args(argv)
    for flag in ("max_running_requests", "max_queued_requests", "max_request_bytes"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} is invalid: expected an integer >= 1")
    if not is_loopback(args.host) and not args.api_key:
        parser.error(f"--host {args.host} is not a loopback address: binding it needs --api-key")
    try:
        if args.hf_config:
            if not stat.S_ISREG(os.stat(args.hf_config).st_mode):  # a FIFO would block, /dev/zero never end
                raise ValueError(f"--hf-config {args.hf_config!r} is not a regular file: expected an HF config.json")
            with open(args.hf_config) as f:
                try:
                    model: str | dict = json.load(f)
                except json.JSONDecodeError as err:
                    raise ValueError(f"--hf-config {args.hf_config}: not valid JSON ({err})") from None
            if not isinstance(model, dict):
                raise ValueError(f"--hf-config {args.hf_config}: expected a JSON object (an HF config.json)")
        else:
            config = os.path.join(args.model, "config.json")
            if not os.path.lexists(config):
                raise ValueError(f"--model {args.model!r}: no config.json there")
            if not os.path.isfile(config):
                raise ValueError(f"--model {args.model!r}: config.json there is not a regular file")
            model = args.model
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    return args, model


if __name__ == "__main__":  # `python -m mcore_rl.rollout.server`: refuse a bad argument before the heavy imports
    parse_cli()

import torch  # noqa: E402
from aiohttp import web  # noqa: E402

from mcore_rl.rollout.engine import HFRolloutEngine  # noqa: E402
from mcore_rl.rollout.protocol import BadRequest, parse_generate, response_object  # noqa: E402
from mcore_rl.rollout.scheduler import ContinuousBatcher, GenParams, Sequence  # noqa: E402
from mcore_rl.rollout.weight_receiver import WeightReceiver, WeightUpdateError  # noqa: E402
from mcore_rl.rollout.weight_routes import SERIALISED_ROUTES, WeightRoutes, field, refused  # noqa: E402

#: SGLang's HEALTH_CHECK_TIMEOUT (srt/entrypoints/http_server.py), read from the same variable
HEALTH_CHECK_TIMEOUT_S = float(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))

log = logging.getLogger(__name__)


class _QuietProtocolProbes(logging.Filter):
    """sglang-router probes every new worker for HTTP and gRPC at once; the gRPC probe's HTTP/2 preface makes
    aiohttp log a BadHttpMessage ("Pause on PRI/Upgrade") traceback that says nothing about our server."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PRI/Upgrade" not in str(record.exc_info[1] if record.exc_info else record.getMessage())


logging.getLogger("aiohttp.server").addFilter(_QuietProtocolProbes())
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _wrap(future: Future) -> Any:
    return await asyncio.wrap_future(future)


class EngineServer(WeightRoutes):
    """One engine, its batcher and weight receiver, and the aiohttp application serving them."""

    def __init__(
        self,
        engine: HFRolloutEngine,
        *,
        tokenizer: Any = None,
        model_path: str = "",
        max_running_requests: int = 256,
        max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
        context_length: int | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        api_key: str | None = None,
        eos_token_ids: list[int] | None = None,
        health_check_timeout_s: float = HEALTH_CHECK_TIMEOUT_S,
        keep_update_buffers: bool = True,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.api_key = api_key
        self.max_queued_requests = max_queued_requests
        self.max_request_bytes = max_request_bytes
        self.health_check_timeout_s = health_check_timeout_s
        # The most characters one token covers (the longest vocabulary entry): a text longer than the context
        # length times this cannot fit, and is refused without tokenizing it.
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        self.max_token_chars = max((len(t) for t in vocab), default=1)
        self._flushing = False
        eos = eos_token_ids if eos_token_ids is not None else _eos_ids(engine, tokenizer)
        self.batcher = ContinuousBatcher(
            engine,
            max_running=max_running_requests,
            context_length=context_length,
            eos_token_ids=eos,
            stop_checker=self._stop_checker if tokenizer is not None else None,
        )
        self.receiver = WeightReceiver(engine, keep_buffers=keep_update_buffers)
        self._released: dict[str, torch.Size] = {}  # parameter name -> shape, while weights are released
        self._kv_released = False
        #: memory was resumed but the weights are incomplete (values gone with the release): paused until an update
        #: commits them whole, then generation continues by itself, as it would have at the resume
        self._held_for_weights = False

    # ------------------------------------------------------------------ text
    def _encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise BadRequest(f"text must be a string, got {type(text).__name__}")
        most = self.batcher.context_length * self.max_token_chars
        if len(text) > most:  # certainly too long: refused before the tokenizer spends time and memory on it
            raise BadRequest(
                f"text has {len(text)} characters: more than the context length ({self.batcher.context_length} "
                f"tokens, --context-length) x the longest token ({self.max_token_chars} characters) can hold"
            )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _decode(self, ids: Any, skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _stop_checker(self, seq: Sequence) -> str | None:
        tail = self._decode(seq.output_ids[-8:], False)
        return next((s for s in seq.params.stop if s in tail), None)

    # ------------------------------------------------------------------ application
    def app(self) -> web.Application:
        """The aiohttp application with every route and the auth/JSON middleware."""
        app = web.Application(middlewares=[self._middleware], client_max_size=self.max_request_bytes)
        get_post = ("GET", "POST")
        routes: list[tuple[tuple[str, ...], str, Handler]] = [
            (("GET",), "/health", self.health_generate),
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
            (("POST",), "/abort_weight_update", self.abort_weight_update),
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
            if path in SERIALISED_ROUTES:
                handler = self.one_at_a_time(handler)
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
        # as SGLang's auth (srt/utils/auth.py): /health and /health_generate answer without a key (probes), and the
        # key is compared in constant time
        if self.api_key is not None and not request.path.startswith("/health"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return web.json_response({"error": {"message": "missing or wrong API key", "code": 401}}, status=401)
        try:
            return await handler(request)
        except BadRequest as err:
            return _error(str(err), 400)
        except WeightUpdateError as err:
            return web.json_response({"success": False, "message": str(err)}, status=400)
        except RecursionError:  # a value nested too deeply for a check or a message (the JSON parse catches its own)
            return _error("the request nests values too deeply", 400)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The JSON object of the request (its query for a bodyless GET), parsed off the event loop."""
        if not request.can_read_body:
            return dict(request.query)
        if request.content_length is not None and request.content_length > self.max_request_bytes:
            raise BadRequest(self._too_large(request.content_length))
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as err:  # no Content-Length, or a body longer than it said
            raise BadRequest(self._too_large(None)) from err
        return await asyncio.to_thread(_parse_json_object, raw)

    def _too_large(self, size: int | None) -> str:
        got = f"{size} bytes" if size is not None else "more"
        return f"the request body has {got}: at most {self.max_request_bytes} are accepted (--max-request-bytes)"

    @staticmethod
    def _field(body: dict, key: str, kind: type | tuple[type, ...], default: Any = ..., name: str = "") -> Any:
        return field(body, key, kind, default, name)

    async def _idle(self) -> bool:
        """SGLang's `is_fully_idle(ignore_waiting=paused)`, read between two scheduler steps: nothing running, and
        nothing waiting unless generation is paused (requests a retract put back in the queue do not count)."""
        return await _wrap(
            self.batcher.call(
                lambda: not self.batcher.num_running and (self.batcher.paused or not self.batcher.num_waiting)
            )
        )

    # ------------------------------------------------------------------ generation
    def _parse_generate(self, body: dict) -> tuple[list[Sequence], bool, bool]:
        return parse_generate(
            body,
            vocab_size=self.engine.vocab_size,
            context_length=self.batcher.context_length,
            encode=self._encode if self.tokenizer is not None else None,
            max_running_requests=self.batcher.max_running,
            max_queued_requests=self.max_queued_requests,
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        # tokenizing and checking run on a worker thread: the event loop keeps answering other requests
        seqs, as_list, stream = await asyncio.to_thread(self._parse_generate, body)
        if self.batcher.num_waiting + len(seqs) > self.max_queued_requests:
            return _error("The request queue is full. (--max-queued-requests)", 503)  # SGLang's message
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
                failed = next((s.finish for s in seqs if _error_status(s.finish)), None)
                if failed is not None:  # SGLang answers a request its scheduler aborted with a status by that status
                    return _error(failed["message"], _error_status(failed))
                version = self._version()
                out = [response_object(s, i, decode, text_logprobs, version) for i, s in enumerate(seqs)]
                return web.json_response(out if as_list else out[0])
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            done = [False] * len(seqs)
            try:
                await response.prepare(request)
                while not all(done):
                    changed = {await events.get()}
                    while not events.empty():
                        changed.add(events.get_nowait())
                    for i in sorted(changed):
                        if done[i]:
                            continue
                        # `finish` is set before the sequence's last event is queued: once a chunk shows it, that
                        # chunk holds the final tokens and the sequence is done
                        done[i] = seqs[i].finish is not None
                        chunk = json.dumps(response_object(seqs[i], i, decode, text_logprobs, self._version()))
                        await response.write(f"data: {chunk}\n\n".encode())
                await response.write(b"data: [DONE]\n\n")
            except ConnectionResetError:  # aiohttp's ClientConnectionResetError too: the client went away
                # one quiet line, not a traceback: a client closing its stream is no server error
                unfinished = sum(s.finish is None for s in seqs)
                log.info("client went away during a /generate stream; %d unfinished sequences aborted", unfinished)
            return response
        finally:  # the client went away (or the handler failed): stop spending decode steps on it
            for seq in seqs:
                if seq.finish is None:
                    self.batcher.abort(seq.rid, "client disconnected")

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang's /health and /health_generate (the same handler there, with SGLang's default
        SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION): 200 once the scheduler produces any output after the probe
        began, which a one-token request (input [0]) makes sure of when nothing else runs; 503 when nothing comes
        within the health-check timeout, as while generation is paused or memory is released: requests wait then,
        the probe's too."""
        start = self.batcher.progress
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        probe: Sequence | None = None
        deadline = loop.time() + self.health_check_timeout_s
        try:
            while loop.time() < deadline:
                if self.batcher.progress > start or (probe is not None and probe.finish is not None):
                    return web.Response(status=200 if probe is None or not _error_status(probe.finish) else 503)
                if probe is None and not self.batcher.paused:
                    # SGLang's probe waits while paused and is sent once the pause ends
                    probe = Sequence(
                        f"HEALTH_CHECK_{uuid.uuid4().hex}",
                        [0],
                        GenParams(max_new_tokens=1, temperature=0.0),
                        on_event=lambda s: s.finish is not None and loop.call_soon_threadsafe(done.set),
                    )
                    self.batcher.submit([probe])
                try:  # the scheduler has no event for "progress": poll, as SGLang's handler does (every 1 s)
                    await asyncio.wait_for(done.wait(), timeout=0.05)
                except asyncio.TimeoutError:
                    pass
            return web.Response(status=503)
        finally:
            if probe is not None and probe.finish is None:
                self.batcher.abort(probe.rid, "health check answered")

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
            "weights_incomplete": len(self.receiver.incomplete),
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
        abort_all = self._field(body, "abort_all", bool, False)
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
        self._held_for_weights = False  # paused by the client now: only /continue_generation lifts it
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        blocked = self.receiver.generation_blocked()
        if blocked is not None:  # stricter than SGLang, which would decode on half-written weights
            return refused(f"generation stays paused: {blocked}")
        await _wrap(self.batcher.resume())
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """SGLang's /flush_cache: 200 when the scheduler is idle (requests that a pause retracted to the queue do
        not count), else 400; with `?timeout=S` it waits up to S seconds for idle. There is no prefix cache here
        to drop (no KV outlives its request), so a flush is the idle check only."""
        raw = request.query.get("timeout", "0")
        try:
            timeout = float(raw)
        except ValueError:
            timeout = -1.0
        if not math.isfinite(timeout) or timeout < 0:
            raise BadRequest(f"timeout={raw!r} is invalid: expected a number of seconds >= 0")
        if self._flushing:
            return web.Response(status=400, text="Another flush_cache is already in progress.")
        self._flushing = True
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            idle = await self._idle()
            while not idle and timeout > 0 and loop.time() < deadline:
                await asyncio.sleep(0.05)
                idle = await self._idle()
        finally:
            self._flushing = False
        if idle:
            return web.Response(
                status=200,
                text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                "requests, the operation will not be performed.)\n",
            )
        return web.Response(
            status=400, text="Timed out waiting for idle state." if timeout > 0 else "Flush cache failed.\n"
        )


def _parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body -> its JSON object; BadRequest for anything else (bad UTF-8, bad JSON, nesting too deep, an
    integer longer than Python converts: named by its key)."""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as err:
        raise BadRequest(f"the request body is not valid UTF-8 JSON: {err}") from err
    except json.JSONDecodeError as err:
        raise BadRequest(f"malformed JSON body: {err}") from err
    except RecursionError as err:
        raise BadRequest("malformed JSON body: values nested too deeply") from err
    except ValueError as err:  # an integer longer than int() converts (a 500 once); parsed again to name its key
        raise BadRequest(_too_many_digits(raw) or f"malformed JSON body: {err}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _too_many_digits(raw: bytes) -> str | None:
    """Which key holds an integer longer than `sys.get_int_max_str_digits()` (`sampling_params.top_k`,
    `input_ids[3]`), worded as a refusal; None if none does. Only a refused body pays for this second parse: a hook
    on every integer would slow the parse of every request."""
    limit = sys.get_int_max_str_digits()
    too_long: list[int] = []

    def parse_int(text: str) -> Any:
        if limit and len(text.lstrip("-")) > limit:
            too_long.append(len(text.lstrip("-")))
            return _TOO_LONG
        return int(text)

    try:
        body = json.loads(raw, parse_int=parse_int)
    except ValueError:
        return None
    if not too_long:
        return None

    def find(value: Any, path: str) -> str | None:
        if value is _TOO_LONG:
            return path
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            found = find(item, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]")
            if found is not None:
                return found
        return None

    path = (find(body, "") or ".a value").lstrip(".")
    return f"{path} is an integer of {too_long[0]} digits: at most {limit} digits are accepted"


#: stands for a too-long integer while `_too_many_digits` looks for its key
_TOO_LONG = object()


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _error_status(finish: dict[str, Any] | None) -> int:
    """The HTTP status of an abort that carries one (SGLang's FINISH_ABORT.status_code, 400..599), else 0."""
    status = (finish or {}).get("status_code")
    return status if finish and finish.get("type") == "abort" and isinstance(status, int) and 400 <= status < 600 else 0


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
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    health_check_timeout_s: float = HEALTH_CHECK_TIMEOUT_S,
    latency_model_s_per_token: float | None = None,
    keep_update_buffers: bool = True,
) -> EngineServer:
    """An EngineServer for a checkpoint dir or an HF config dict (random weights; a sync fills them).
    `latency_model_s_per_token`: a model of a GPU engine's latency (rollout.latency_model_s_per_token; engine.py
    `HFRolloutEngine.forward`). `keep_update_buffers`: sync.keep_buffers (rollout/weight_receiver.py)."""
    engine = HFRolloutEngine(
        model, dtype=dtype, device=device, init_seed=init_seed, latency_model_s_per_token=latency_model_s_per_token
    )
    engine.weight_version = weight_version
    tok = None
    source = tokenizer or (model if isinstance(model, str) else None)
    if source is not None and any(
        os.path.exists(os.path.join(source, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    elif tokenizer is not None:
        raise ValueError(f"--tokenizer {tokenizer!r} holds no tokenizer.json or tokenizer_config.json")
    if context_length is not None and context_length < 2:
        raise ValueError(f"--context-length {context_length} is invalid: expected an integer >= 2")
    return EngineServer(
        engine,
        tokenizer=tok,
        model_path=model if isinstance(model, str) else "",
        max_running_requests=max_running_requests,
        max_queued_requests=max_queued_requests,
        context_length=context_length,
        max_request_bytes=max_request_bytes,
        api_key=api_key,
        health_check_timeout_s=health_check_timeout_s,
        keep_update_buffers=keep_update_buffers,
    )


def main(argv: list[str] | None = None) -> None:
    args, model = parse_cli(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        server = build_server(
            model,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            device=args.device,
            max_running_requests=args.max_running_requests,
            context_length=args.context_length,
            api_key=args.api_key,
            weight_version=args.weight_version,
            max_queued_requests=args.max_queued_requests,
            max_request_bytes=args.max_request_bytes,
        )
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"serving {args.model or args.hf_config} on http://{args.host}:{args.port}", flush=True)
    web.run_app(server.app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
