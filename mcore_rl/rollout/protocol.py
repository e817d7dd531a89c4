"""SGLang's `/generate` JSON for the embedded server: request checking -> sequences, sequences -> response objects.

The field names and shapes are SGLang 0.5.x's (`sglang/api/v1/api_types.py`: GenerateRequest, SamplingParams,
GenerateResponse, GenerateMetaInfo); tests decode what we produce with those very structs. Every problem is a
`BadRequest` naming the key and what was expected, answered with HTTP 400.

```
{"input_ids": [[...], ...] | [...], "text": ..., "sampling_params": {...} | [{...}], "return_logprob": ...,
 "logprob_start_len": ..., "return_routed_experts": ..., "rid": ..., "stream": ...}
   -> one Sequence per prompt x sampling_params.n (prompt-major) -> {"text", "output_ids", "meta_info", "index"}
```
"""

from __future__ import annotations

import base64
import math
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from mcore_rl.rollout.sampling import GREEDY_BELOW  # SGLang's _SAMPLING_EPS (srt/sampling/sampling_params.py)
from mcore_rl.rollout.scheduler import GenParams, Sequence


class BadRequest(ValueError):
    """A request the server answers with HTTP 400; the message names the key and what was expected."""


#: SGLang's MAX_STOP_COUNT: stop strings per request.
MAX_STOP_COUNT = 32
#: SGLang's range of sampling_seed (a signed 64-bit integer).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: the largest top_k: SGLang holds top_k in an int32 tensor (sampling_batch_info.py), and so do we
TOP_K_MAX = 2**31 - 1
#: the longest an update group's rendezvous and broadcasts may wait (timeout_s on /init_weights_update_group)
GROUP_TIMEOUT_MAX_S = 24 * 3600.0


#: SamplingParams keys we implement.
SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "min_new_tokens", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "no_stop_trim", "n", "sampling_seed", "spaces_between_special_tokens",
}  # fmt: skip
#: SamplingParams keys SGLang has that we accept only at their default value (no constrained decoding, penalties).
SAMPLING_DEFAULT_ONLY: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "stop_regex": None, "stream_interval": None, "logit_bias": {},
    "custom_params": None, "beam_width": None, "watermark": None, "choice": [],
}  # fmt: skip
#: Top-level /generate keys we implement.
REQUEST_KEYS = {
    "rid", "text", "input_ids", "stream", "sampling_params", "return_logprob", "logprob_start_len",
    "return_text_in_logprobs", "return_routed_experts", "routed_experts_start_len", "top_logprobs_num",
}  # fmt: skip
#: Top-level keys SGLang has that we accept only when absent, null, false or empty (multimodal, LoRA, disaggregation).
REQUEST_DEFAULT_ONLY = {
    "token_ids_logprob", "return_hidden_states", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "disagg_prefill_dp_rank", "image_data", "mm_hashes",
    "video_data", "audio_data", "extra_key", "priority", "cache_salt", "require_reasoning", "lora_path",
    "session_params", "kv_hints", "routing_key", "max_thinking_tokens", "session_id", "custom_logit_processor",
    "custom_labels", "images_config", "return_prompt_token_ids", "return_sampling_mask", "modalities",
    # sglang-router 0.3.x re-serialises every /generate it forwards with these fields (at their defaults)
    "background", "no_logs", "return_bytes", "return_entropy",
}  # fmt: skip
#: Keys with no effect here, whatever their value: the model name (one model per server), metrics logging.
REQUEST_IGNORED = {"model", "log_metrics"}


def _per_prompt(value: Any, count: int, key: str, is_item: Callable[[Any], bool]) -> list[Any]:
    """A value given once for all prompts, or as a list with one item per prompt."""
    if isinstance(value, list) and not is_item(value):
        if len(value) != count:
            raise BadRequest(
                f"{key} has {len(value)} entries for {count} prompts; expected one per prompt or one value"
            )
        return value
    return [value] * count


def _int(params: dict, key: str, default: int, low: int | None = None, expected: str = "") -> int:
    """An integer sampling parameter (>= low when given); `expected` words the error when the bound alone does not."""
    value = params.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        expected = expected or ("an integer" if low is None else f"an integer >= {low}")
        raise BadRequest(f"sampling_params.{key}={value!r} is invalid: expected {expected}")
    return value


def _unicode(text: str, key: str) -> None:
    """BadRequest naming `key` when `text` holds a lone surrogate (JSON's "\\ud800" decodes to one): it is not
    Unicode text, and the tokenizer (and any UTF-8 encoder) fails on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadRequest(
            f"{key} holds a lone surrogate ({text[err.start]!r} at character {err.start}): expected valid Unicode text"
        ) from None


def _float(params: dict, key: str, default: float, ok: Callable[[float], bool], expected: str) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    # JSON's Infinity/NaN (Python's json reads them) and integers too large for a float are refused too
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadRequest(f"sampling_params.{key}={value!r} is invalid: expected {expected}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or not ok(number):
        raise BadRequest(f"sampling_params.{key}={value!r} is invalid: expected {expected}")
    return number


def _bool(body: dict, key: str, default: bool, prefix: str = "") -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{prefix}{key}={value!r} is invalid: expected true or false")
    return value


def parse_sampling_params(params: Any, vocab_size: int) -> tuple[GenParams, int, dict[str, bool]]:
    """SGLang sampling_params -> (GenParams, n, text options); BadRequest for unknown keys or bad values."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(params).__name__}")
    for key, value in params.items():
        if key in SAMPLING_KEYS:
            continue
        if key in SAMPLING_DEFAULT_ONLY:
            if value not in (None, SAMPLING_DEFAULT_ONLY[key]):
                raise BadRequest(
                    f"sampling_params.{key}={value!r} is not supported by the embedded server "
                    f"(only the default {SAMPLING_DEFAULT_ONLY[key]!r})"
                )
            continue
        raise BadRequest(f"unknown sampling_params key {key!r}; expected one of {sorted(SAMPLING_KEYS)}")
    stop = params.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"sampling_params.stop={params.get('stop')!r} is invalid: expected a string or strings")
    for i, string in enumerate(stop):
        _unicode(string, f"sampling_params.stop[{i}]")
    if len(stop) > MAX_STOP_COUNT:
        raise BadRequest(f"sampling_params.stop has {len(stop)} strings: at most {MAX_STOP_COUNT} are allowed")
    stop_ids = params.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in stop_ids
    ):
        raise BadRequest(
            f"sampling_params.stop_token_ids={params.get('stop_token_ids')!r} is invalid: expected a list of token "
            f"ids in [0, {vocab_size})"
        )
    top_k = _int(params, "top_k", -1, expected="-1 (off) or an integer >= 1")
    if top_k == 0 or top_k < -1:
        raise BadRequest(f"sampling_params.top_k={top_k} is invalid: expected -1 (off) or an integer >= 1")
    if top_k > TOP_K_MAX:  # it used to reach the batch and fail the step of every request in it
        raise BadRequest(f"sampling_params.top_k={top_k} is invalid: expected at most {TOP_K_MAX} (2**31 - 1)")
    seed = params.get("sampling_seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not SEED_MIN <= seed <= SEED_MAX):
        raise BadRequest(
            f"sampling_params.sampling_seed={seed!r} is invalid: expected an integer in [-2**63, 2**63 - 1]"
        )
    for key in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"):
        _bool(params, key, False, "sampling_params.")
    temperature = _float(params, "temperature", 1.0, lambda v: v >= 0, "a finite number >= 0 (0 = greedy)")
    if temperature < GREEDY_BELOW:  # as SGLang: below 1e-6 is greedy (1/temperature would overflow the logits)
        temperature = 0.0
    gen = GenParams(
        max_new_tokens=_int(params, "max_new_tokens", 128, low=0),  # 0: prompt logprobs only (scoring)
        temperature=temperature,
        top_p=_float(params, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=top_k,
        min_p=_float(params, "min_p", 0.0, lambda v: 0 <= v <= 1, "in [0, 1]"),
        min_new_tokens=_int(params, "min_new_tokens", 0, low=0),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=params.get("ignore_eos", False),
        seed=seed,
    )
    text = {k: params.get(k, d) for k, d in (("skip_special_tokens", True), ("no_stop_trim", False))}
    return gen, _int(params, "n", 1, low=1), text


def parse_generate(
    body: Any,
    *,
    vocab_size: int,
    context_length: int,
    encode: Callable[[str], list[int]] | None,
    max_running_requests: int | None = None,
    max_queued_requests: int | None = None,
) -> tuple[list[Sequence], bool, bool]:
    """A /generate body -> (sequences in output order, whether the answer is a list, stream).

    Bounds (each refusal names the server flag that raises it): `n` <= `max_running_requests` (the samples of one
    prompt run together), prompt + `max_new_tokens` <= `context_length` (SGLang's own check), so one prompt costs at
    most `max_running_requests x context_length` tokens; a request's sequences (prompts x n) <=
    `max_queued_requests`."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if key in REQUEST_KEYS or key in REQUEST_IGNORED:
            continue
        if key in REQUEST_DEFAULT_ONLY:
            if value not in (None, False, [], {}, "", 0):
                raise BadRequest(f"{key} is not supported by the embedded server (leave it unset)")
            continue
        raise BadRequest(f"unknown request key {key!r}; expected one of {sorted(REQUEST_KEYS)}")
    if (body.get("input_ids") is None) == (body.get("text") is None):
        raise BadRequest("give exactly one of input_ids (token ids) and text")
    stream = _bool(body, "stream", False)
    routed = _bool(body, "return_routed_experts", False)
    _bool(body, "return_text_in_logprobs", False)
    if body.get("top_logprobs_num") not in (None, 0):
        raise BadRequest("top_logprobs_num is not supported by the embedded server (leave it unset or 0)")
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, list) or not prompt or not all(_is_int(t) for t in prompt):
                raise BadRequest(f"input_ids[{i}] must be a non-empty list of integer token ids")
    else:
        if encode is None:
            raise BadRequest("text prompts need a tokenizer; this server was started without one (send input_ids)")
        texts = body["text"]
        batched = isinstance(texts, list)
        if batched and not texts:
            raise BadRequest("text is an empty list: expected a string or a non-empty list of strings")
        for i, text in enumerate(texts if batched else [texts]):
            if not isinstance(text, str):
                raise BadRequest(f"text[{i}] is a {type(text).__name__}, expected a string")
            if not text:  # an empty prompt used to reach the batch and fail its prefill, for every request in it
                raise BadRequest(f"text[{i}] is empty: expected a non-empty prompt")
            _unicode(text, f"text[{i}]")
        prompts = [encode(t) for t in (texts if batched else [texts])]
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise BadRequest(f"text[{i}] tokenizes to no tokens: expected a non-empty prompt")
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"input_ids[{i}] has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        if len(prompt) >= context_length:
            raise BadRequest(
                f"input_ids[{i}] has {len(prompt)} tokens; the context length is {context_length} "
                "(the prompt must leave room for at least one new token)"
            )
    count = len(prompts)
    all_params = _per_prompt(body.get("sampling_params"), count, "sampling_params", lambda v: False)
    shared_params = not isinstance(body.get("sampling_params"), list)
    want_logprob = _per_prompt(body.get("return_logprob") or False, count, "return_logprob", lambda v: False)
    start_len = _per_prompt(body.get("logprob_start_len", -1), count, "logprob_start_len", lambda v: False)
    rids = _per_prompt(body.get("rid"), count, "rid", lambda v: False)
    for i, rid in enumerate(rids):  # /abort_request matches rids as strings
        if rid is not None and not isinstance(rid, str):
            raise BadRequest(f"rid={body.get('rid')!r} is invalid: expected a string (or one string per prompt)")
        if not isinstance(want_logprob[i], bool):
            raise BadRequest(f"return_logprob={body.get('return_logprob')!r} is invalid: expected true or false")
    routed_start = body.get("routed_experts_start_len", 0)
    seqs: list[Sequence] = []
    for i, prompt in enumerate(prompts):
        gen, n, text_opts = parse_sampling_params(all_params[i], vocab_size)
        if max_running_requests is not None and n > max_running_requests:
            raise BadRequest(
                f"sampling_params.n={n} is more than the {max_running_requests} sequences this server runs at once "
                "(raise it with --max-running-requests)"
            )
        if isinstance(all_params[i], dict) and all_params[i].get("max_new_tokens") is not None:
            total = len(prompt) + gen.max_new_tokens
            if total > context_length:  # SGLang's check (tokenizer_manager._validate_one_request)
                raise BadRequest(
                    f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
                    f"You requested a total of {total} tokens: {len(prompt)} tokens from the input messages and "
                    f"{gen.max_new_tokens} tokens for the completion (sampling_params.max_new_tokens; the server's "
                    "--context-length)"
                )
        if max_queued_requests is not None and len(seqs) + n > max_queued_requests:
            raise BadRequest(
                f"this request holds more than {max_queued_requests} sequences (prompts x sampling_params.n), the "
                "most this server queues (raise it with --max-queued-requests)"
            )
        if not isinstance(start_len[i], int) or start_len[i] < -1 or start_len[i] >= len(prompt):
            raise BadRequest(f"logprob_start_len={start_len[i]!r}: expected -1 (none) or an index into the prompt")
        if not isinstance(routed_start, int) or not 0 <= routed_start <= len(prompt):
            raise BadRequest(f"routed_experts_start_len={routed_start!r}: expected an integer in [0, {len(prompt)}]")
        rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
        # Every sample of a request samples with its own seed: sampling_seed + j for the j-th sample of a prompt, and
        # with one sampling_params shared by a batch of prompts, + the sample's index in the answer (prompt i's
        # samples start at i * n), so no two samples of the batch share a random stream.
        first = len(seqs) if shared_params else 0
        for j in range(n):
            seed = None if gen.seed is None else gen.seed + first + j
            seq = Sequence(
                rid if n == 1 else f"{rid}_{j}",
                list(prompt),
                GenParams(**{**gen.__dict__, "seed": seed}),
                return_logprob=bool(want_logprob[i]),
                logprob_start_len=start_len[i],
                return_routed_experts=routed,
                routed_experts_start_len=routed_start,
            )
            seq.text_options = text_opts  # type: ignore[attr-defined]
            seqs.append(seq)
    return seqs, batched or len(seqs) > 1, stream


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_update_group(port: int, rank: int, world_size: int, timeout_s: float) -> float:
    """/init_weights_update_group's numbers, checked before any rendezvous: BadRequest naming the field (a port
    outside TCP's range, or a timeout a timedelta cannot hold, used to fail inside torch as a 500). Returns the
    timeout in seconds as a float."""
    if not 1 <= port <= 65535:
        raise BadRequest(f"master_port={port} is invalid: expected a TCP port in [1, 65535]")
    if not 1 <= world_size <= 2**31 - 1:
        raise BadRequest(f"world_size={world_size} is invalid: expected an integer in [1, 2**31 - 1]")
    if not 0 <= rank < world_size:
        raise BadRequest(f"rank_offset={rank} is invalid: expected an integer in [0, world_size={world_size})")
    if not (0 < timeout_s <= GROUP_TIMEOUT_MAX_S):  # NaN fails this too; an int is compared without float()
        raise BadRequest(
            f"timeout_s={timeout_s!r} is invalid: expected a number of seconds in (0, {GROUP_TIMEOUT_MAX_S:.0f}]"
        )
    return float(timeout_s)


def response_object(
    seq: Sequence,
    index: int,
    decode: Callable[[Seq[int], bool], str] | None,
    text_in_logprobs: bool = False,
    server_version: str | None = None,
) -> dict[str, Any]:
    """One sequence as SGLang's GenerateResponse (`text`, `output_ids`, `meta_info`, `index`). `weight_version` is
    the version of its last token, or the server's when it has none (aborted before sampling, scoring only)."""
    # a consistent snapshot: the batcher thread may be appending (token first, then its logprob)
    n = min(len(seq.output_ids), len(seq.output_logprobs))
    output_ids, output_logprobs = seq.output_ids[:n], seq.output_logprobs[:n]
    options = getattr(seq, "text_options", {"skip_special_tokens": True, "no_stop_trim": False})
    text = decode(output_ids, options["skip_special_tokens"]) if decode is not None else ""
    matched = (seq.finish or {}).get("matched")
    if isinstance(matched, str) and not options["no_stop_trim"] and matched in text:
        text = text[: text.rindex(matched)]
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": n,
        "cached_tokens": seq.cached_tokens,
        "weight_version": str(seq.weight_version) if seq.weight_version is not None else server_version,
        "weight_versions": [{"version": str(v), "start": s, "end": e} for v, s, e in seq.weight_versions],
        "e2e_latency": time.monotonic() - seq.created,
    }
    if seq.return_logprob:

        def token_text(t: int) -> str | None:
            return decode([t], False) if (text_in_logprobs and decode is not None) else None

        meta["output_token_logprobs"] = [[lp, t, token_text(t)] for lp, t in zip(output_logprobs, output_ids)]
        if seq.input_logprobs is not None:
            tokens = seq.prompt_ids[seq.logprob_start_len :]
            meta["input_token_logprobs"] = [[lp, t, token_text(t)] for lp, t in zip(seq.input_logprobs, tokens)]
    routed = seq.routed_experts()
    if routed is not None:
        meta["routed_experts"] = base64.b64encode(routed.contiguous().numpy().tobytes()).decode("ascii")
    return {"text": text, "output_ids": output_ids, "meta_info": meta, "index": index}
