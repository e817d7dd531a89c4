"""One HTTP client for every rollout engine: our embedded server and real SGLang, directly or through sglang-router.

```
controller --generate_samples--> client --POST /generate (per prompt, or batched: request_grouping)--> router
           <--Samples (tokens, logprobs, finish, weight versions, routed experts)--
controller --post(url, "/begin_weight_update") ...--> each engine directly (the router proxies no control calls)
```
Requests run concurrently on the client's own event loop thread (aiohttp), bounded by `max_in_flight`. A failed
/generate (connection refused or reset, timeout, 5xx or 429) is retried with exponential backoff (at most
`max_backoff_s`) after calling `on_failure` (the engine pool uses it to find a dead engine and take it out of the
router), up to `max_retries` times; a 4xx answer is the request's fault and raises `RolloutRequestError` at once.
A sample the engine aborted (`finish_reason.type == "abort"`, e.g. a pause in abort mode) is continued: prompt + its
tokens so far go out again with the remaining token budget, and the pieces are joined (a partial rollout; its
weight-version spans say which tokens came from which version).

What differs between engine families sits in one small seam, `EngineDialect` (`DIALECTS`, named by the engine kind of
`rollout.engine`): how the n samples of a seeded request are asked for, and how a request goes out (vLLM's own
generate route). Everything else (routes, retries, continuation, the control calls) is SGLang's API and shared.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import aiohttp
import numpy as np

from mcore_rl.rollout.engines import KINDS
from mcore_rl.rollout.sampling import Sample
from mcore_rl.rollout.vllm_dialect import VLLMDialect

log = logging.getLogger(__name__)
T = TypeVar("T")

#: the environment variable that sets a run's API key (otherwise a fresh `secrets.token_hex(16)` per run)
API_KEY_ENV = "MCORE_RL_API_KEY"


def api_key_problem(key: str) -> str | None:
    """Why `key` cannot be a run's API key (None if it can): 16 to 256 visible ASCII characters, so that it is hard to
    guess and travels unchanged in an HTTP header, an environment variable and a command line."""
    if not 16 <= len(key) <= 256:
        return f"{len(key)} characters; expected 16 to 256"
    if not all(33 <= ord(ch) <= 126 for ch in key):
        return "a space, control or non-ASCII character; expected visible ASCII only"
    return None


def run_api_key() -> str:
    """The run's API key: MCORE_RL_API_KEY where set (pre-flight checked its form), else a fresh random one."""
    import os
    import secrets

    return os.environ.get(API_KEY_ENV) or secrets.token_hex(16)


class RolloutRequestError(RuntimeError):
    """An engine or the router refused a request (4xx), or it kept failing after every retry."""


def parse_version(version: Any) -> int | str:
    """SGLang weight versions are strings; the controller's are integers."""
    if isinstance(version, str) and version.lstrip("-").isdigit():
        return int(version)
    return version


class EngineDialect:
    """Our embedded server: SGLang's API plus what real SGLang lacks that the client may rely on here (seeds)."""

    name = "hf"
    #: /server_info answers at once (vLLM's collects its host's environment: seconds), so the colocated placement
    #: asks it whether the engine released its weights
    server_info_is_cheap = True
    #: one request with `n` > 1 and `sampling_seed` s gives its samples seeds s, s+1, ... (the embedded server's
    #: rule); where false, a seeded request for n samples goes out as n requests with n=1, one seed each
    seeds_each_of_n = True

    async def generate(self, client: RolloutClient, url: str, body: dict[str, Any]) -> tuple[int, Any]:
        """POST one /generate: (status, payload). A dialect for another API translates here (vllm_dialect.py)."""
        return await client.arequest("POST", url, "/generate", body)

    async def control(
        self, client: RolloutClient, url: str, route: str, body: Any, timeout_s: float | None
    ) -> tuple[int, Any]:
        """POST one control call (SGLang's route and body): (status, payload)."""
        return await client.arequest("POST", url, route, body, timeout_s)


class SGLangDialect(EngineDialect):
    """Real SGLang 0.5.23. It uses `sampling_seed` only with deterministic inference on, and then gives all n samples
    of a request the same seed: identical samples (so one seed is never sent for n samples). A finished request's
    answer carries `weight_versions`, the [version, start, end) spans of its tokens: the scheduler records, at each
    version change, how many tokens every live request had (managers/scheduler.py:5636-5655, running, retracted and
    waiting requests alike), and the spans are cut from those events (utils/weight_versions.py:62-107); so a request
    paused in place or retracted across a push is labelled per token. A piece continued after an abort carries its
    own spans, offset by the client."""

    name = "sglang"
    seeds_each_of_n = False


DIALECTS: dict[str, Any] = {"hf": EngineDialect(), "sglang": SGLangDialect(), "vllm": VLLMDialect()}
"""Dialect name (an engine kind's `dialect`) -> the dialect."""


def sample_from_response(
    prompt: list[int], obj: dict[str, Any], num_layers: int | None = None, dialect: EngineDialect = DIALECTS["hf"]
) -> Sample:
    """One /generate answer -> Sample. Tokens come from `output_token_logprobs` (as slime reads them) when present,
    else from `output_ids`; `routed_experts` (base64 int32) is reshaped to [tokens, layers, top_k] (with
    `num_layers`) or [tokens, layers * top_k]. The weight-version spans are the answer's own
    (`meta_info.weight_versions`: our server, SGLang and vLLM's dialect tag tokens when a commit lands mid-request)
    or one span of its `weight_version` over all its tokens."""
    meta = obj.get("meta_info") or {}
    entries = meta.get("output_token_logprobs")
    if entries is not None:
        tokens = [int(e[1]) for e in entries]
        logprobs = [float(e[0]) for e in entries]
    else:
        tokens, logprobs = list(obj.get("output_ids") or []), []
    finish = (meta.get("finish_reason") or {}).get("type", "abort")
    version = parse_version(meta.get("weight_version"))
    listed = meta.get("weight_versions")  # every engine's answer may carry them (our server, SGLang, vLLM's dialect)
    if listed:
        # SGLang keeps an empty span [0, 0) for a request that ended before its first token: it labels no token
        spans = [(parse_version(s["version"]), s["start"], s["end"]) for s in listed if s["end"] > s["start"]]
    else:
        spans = [(version, 0, len(tokens))] if tokens and version is not None else []
    routed = None
    if meta.get("routed_experts") is not None:
        flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        positions = len(prompt) + len(tokens) - 1 - int(meta.get("routed_experts_start_len", 0))
        # [positions, layers, top_k] when the caller knows the layer count, else [positions, layers * top_k]
        shape = (positions, num_layers, -1) if num_layers else (positions, -1)
        routed = flat.reshape(*shape) if positions > 0 else flat.reshape(0, *shape[1:-1], 0)
    return Sample(
        prompt_ids=list(prompt),
        response_ids=tokens,
        response_logprobs=logprobs,
        finish_reason=finish,
        weight_version=version,
        weight_versions=spans,
        routed_experts=routed,
    )


def _join(first: Sample, rest: Sample) -> Sample:
    """A sample continued after an abort: `rest` was generated from first.prompt + first.response."""
    offset = len(first.response_ids)
    spans = list(first.weight_versions) + [(v, s + offset, e + offset) for v, s, e in rest.weight_versions]
    return Sample(
        prompt_ids=first.prompt_ids,
        response_ids=first.response_ids + rest.response_ids,
        response_logprobs=first.response_logprobs + rest.response_logprobs,
        finish_reason=rest.finish_reason,
        weight_version=rest.weight_version,
        weight_versions=spans,
        routed_experts=rest.routed_experts,
    )


class RolloutClient:
    """See the module docstring. Thread-safe; its sync methods may be called from any thread but its loop's."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        max_in_flight: int = 512,
        on_failure: Callable[[], Awaitable[None] | None] | None = None,
        engine: str = "hf",
    ) -> None:
        """`engine`: the engine kind behind `url` (rollout.engine), whose dialect the client speaks. The k-th retry
        waits backoff_s * 2^(k-1), at most `max_backoff_s` (plus up to 10% jitter): a replacement engine is usually up
        within seconds, and an uncapped doubling made a run with many retries wait minutes after it was."""
        kind = KINDS.get(engine)
        if kind is None:
            raise ValueError(f"engine {engine!r} is invalid: expected one of {sorted(KINDS)}")
        self.dialect = DIALECTS[kind.dialect]
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_in_flight = max_in_flight
        self.on_failure = on_failure
        self.stats = {"retries": 0, "continued_after_abort": 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession | None = None
        self._limit: asyncio.Semaphore | None = None

    # ------------------------------------------------------------------ plumbing
    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the client's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.max_in_flight)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers(), trust_env=False)
            self._limit = asyncio.Semaphore(self.max_in_flight)
        return self._session

    async def arequest(
        self, method: str, url: str, route: str, body: Any = None, timeout_s: float | None = None
    ) -> tuple[int, Any]:
        """One HTTP call, no retry: (status, JSON body or text)."""
        session = await self._get_session()
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        async with session.request(method, url.rstrip("/") + route, json=body, timeout=timeout) as response:
            text = await response.text()
            try:
                payload = await response.json(content_type=None) if text.strip() else None
            except ValueError:
                payload = text
            return response.status, payload

    async def apost(self, url: str, route: str, body: Any = None, timeout_s: float | None = None) -> Any:
        """POST a control call to one engine; RolloutRequestError naming the route unless it answers 2xx."""
        status, payload = await self.dialect.control(self, url, route, body if body is not None else {}, timeout_s)
        if status >= 300 or (isinstance(payload, dict) and payload.get("success") is False):
            message = payload.get("message", payload) if isinstance(payload, dict) else payload
            raise RolloutRequestError(f"{url}{route} answered {status}: {message}")
        return payload

    def post(self, url: str, route: str, body: Any = None, timeout_s: float | None = None) -> Any:
        """Sync `apost`."""
        return self.run(self.apost(url, route, body, timeout_s))

    def get(self, url: str, route: str, timeout_s: float = 10.0) -> tuple[int, Any]:
        """GET one route of one engine: (status, body)."""
        return self.run(self.arequest("GET", url, route, None, timeout_s))

    async def ahealthy(self, url: str, timeout_s: float = 5.0) -> bool:
        """Whether `url` answers /health with 200 within `timeout_s`."""
        try:
            return (await self.arequest("GET", url, "/health", None, timeout_s))[0] == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    # ------------------------------------------------------------------ generation
    def retry_delay_s(self, attempt: int) -> float:
        """The wait before retry number `attempt` (1-based), before jitter."""
        return min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)

    async def agenerate(self, body: dict[str, Any], url: str | None = None) -> Any:
        """POST /generate with retries (see the module docstring); the decoded answer."""
        await self._get_session()
        assert self._limit is not None
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.stats["retries"] += 1
                if self.on_failure is not None:
                    maybe = self.on_failure()
                    if asyncio.iscoroutine(maybe):
                        await maybe
                await asyncio.sleep(self.retry_delay_s(attempt) * (1 + random.random() * 0.1))
            try:
                async with self._limit:
                    status, payload = await self.dialect.generate(self, url or self.url, body)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
                last = f"{type(err).__name__}: {err}"
                continue
            if status == 200:
                return payload
            message = payload.get("error", payload) if isinstance(payload, dict) else payload
            if 400 <= status < 500 and status != 429:
                raise RolloutRequestError(f"/generate refused ({status}): {message}")
            last = f"HTTP {status}: {message}"
        raise RolloutRequestError(f"/generate failed after {self.max_retries} retries; last error: {last}")

    async def agenerate_one(
        self,
        prompt: list[int],
        n: int,
        sampling_params: dict[str, Any],
        *,
        seed: int | None = None,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        num_layers: int | None = None,
        url: str | None = None,
    ) -> list[Sample]:
        """The n samples of one prompt, as one request (so one engine prefills the prompt once)."""
        extra = {"return_routed_experts": True} if return_routed_experts else {}
        params, body, answers = await self._answers(prompt, 1, n, sampling_params, seed, return_logprob, url, extra)
        samples = [sample_from_response(prompt, a, num_layers, self.dialect) for a in answers]
        return await self._continue_aborted(prompt, samples, params, body, seed, num_layers, url)

    async def agenerate_group(
        self,
        prompts: list[list[int]],
        n: int,
        sampling_params: dict[str, Any],
        seed: int | None = None,
        return_logprob: bool = True,
    ) -> list[Sample]:
        """The n samples of each of `prompts` as ONE batched request (a list of `input_ids`, one `sampling_params` for
        all, as sglang-router takes it), prompt-major; sample j of prompt i is seeded `seed + i * n + j` (the
        server's rule for a shared sampling_params). One engine takes the whole group."""
        params, body, answers = await self._answers(prompts, len(prompts), n, sampling_params, seed, return_logprob)
        groups = []
        for i, prompt in enumerate(prompts):
            samples = [sample_from_response(prompt, a, None, self.dialect) for a in answers[i * n : (i + 1) * n]]
            own = None if seed is None else seed + i * n
            single = dict(body, input_ids=prompt, sampling_params=dict(params, sampling_seed=own))
            groups.append(self._continue_aborted(prompt, samples, params, single, own, None, None))
        return [s for group in await asyncio.gather(*groups) for s in group]

    async def _answers(
        self,
        input_ids: list[int] | list[list[int]],
        num_prompts: int,
        n: int,
        sampling_params: dict[str, Any],
        seed: int | None,
        return_logprob: bool,
        url: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
        """POST one /generate of `num_prompts` prompts x n samples: (its sampling_params, its body, the answers),
        refused unless it answered every sample."""
        params = dict(sampling_params, n=n)
        if seed is not None:
            params["sampling_seed"] = seed
        body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": return_logprob, **(extra or {})}
        if seed is not None and not self.dialect.seeds_each_of_n and n * num_prompts > 1:
            # one request per sample, each with its own seed (see SGLangDialect); prompt-major like a batched answer
            prompts = input_ids if num_prompts > 1 or (input_ids and isinstance(input_ids[0], list)) else [input_ids]
            singles = [
                dict(body, input_ids=prompt, sampling_params=dict(params, n=1, sampling_seed=seed + i * n + j))
                for i, prompt in enumerate(prompts)
                for j in range(n)
            ]
            answered = await asyncio.gather(*(self.agenerate(one, url) for one in singles))
            answers = [a[0] if isinstance(a, list) else a for a in answered]
        else:
            answer = await self.agenerate(body, url)
            answers = answer if isinstance(answer, list) else [answer]
        if len(answers) != n * num_prompts:
            raise RolloutRequestError(
                f"/generate of {num_prompts} prompt(s) with n={n} answered {len(answers)} samples"
            )
        return params, body, answers

    async def _continue_aborted(
        self,
        prompt: list[int],
        samples: list[Sample],
        params: dict[str, Any],
        body: dict[str, Any],
        seed: int | None,
        num_layers: int | None,
        url: str | None,
    ) -> list[Sample]:
        """Samples the engine aborted (a pause in abort mode) go out again from prompt + their tokens with the rest
        of the budget, and the pieces are joined (partial rollouts)."""
        budget = int(params.get("max_new_tokens", 128))
        for j, sample in enumerate(samples):
            while sample.finish_reason == "abort" and len(sample.response_ids) < budget:
                self.stats["continued_after_abort"] += 1
                rest = dict(params, n=1, max_new_tokens=budget - len(sample.response_ids))
                if seed is not None:
                    rest["sampling_seed"] = seed + j + 7919 * len(sample.response_ids)
                more = await self.agenerate(
                    dict(body, input_ids=prompt + sample.response_ids, sampling_params=rest), url
                )
                more = more[0] if isinstance(more, list) else more
                sample = _join(
                    sample, sample_from_response(prompt + sample.response_ids, more, num_layers, self.dialect)
                )
            samples[j] = sample
        return samples

    async def agenerate_samples(
        self,
        prompts: list[list[int]],
        n: int,
        sampling_params: dict[str, Any],
        seed: int | None = None,
        groups: int = 0,
        **kwargs: Any,
    ) -> list[Sample]:
        """`n` samples for each prompt, prompt-major; sample j of prompt i is seeded `seed + i * n + j`.

        `groups` = 0: one request per prompt (the router balances and routes each prompt on its own); `groups` = k:
        the prompts in k contiguous batched requests (`agenerate_group`), so an engine admits a whole share at once
        instead of one prefill per arriving request. The samples are the same either way (same seeds)."""
        seeds = [None if seed is None else seed + i * n for i in range(len(prompts))]
        if groups:
            size = -(-len(prompts) // min(groups, len(prompts)))
            starts = range(0, len(prompts), size)
            parts = await asyncio.gather(
                *(self.agenerate_group(prompts[a : a + size], n, sampling_params, seeds[a], **kwargs) for a in starts)
            )
        else:
            parts = await asyncio.gather(
                *(self.agenerate_one(p, n, sampling_params, seed=s, **kwargs) for p, s in zip(prompts, seeds))
            )
        return [s for part in parts for s in part]

    def generate_samples(
        self,
        prompts: list[list[int]],
        n: int,
        sampling_params: dict[str, Any],
        seed: int | None = None,
        groups: int = 0,
        **kwargs: Any,
    ) -> list[Sample]:
        """Sync `agenerate_samples`."""
        return self.run(self.agenerate_samples(prompts, n, sampling_params, seed, groups, **kwargs))

    def close(self) -> None:
        """Close the HTTP session and stop the loop thread."""

        async def _close() -> None:
            if self._session is not None:
                await self._session.close()

        if self._thread.is_alive():
            self.run(_close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
