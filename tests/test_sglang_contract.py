"""Contract tests: our rollout server and client against SGLang 0.5.23's own files, and driven over HTTP the way slime
and verl drive an SGLang server. Run: `make setup` (it extracts the files), then `pytest tests/test_sglang_contract.py`.

SGLang's files are loaded by path from `.venv/sglang-0.5.23/` (SGLang is not installed; importing it needs triton):
`sglang/api/v1/api_types.py` (GenerateRequest, GenerateResponse: msgspec structs generated from the schema SGLang's
Rust gateway enforces) and `sglang/srt/weight_sync/tensor_bucket.py` (FlattenedTensorBucket, `flattened_bucket`).

Where each request shape comes from (slime: THUDM/slime @624b824a, verl: volcengine/verl @b178a3cd):
- slime/rollout/sglang_rollout.py::generate (sampling params of GenerateState.__init__): the /generate body, and the
  partial-rollout resume (prompt + tokens so far, max_new_tokens reduced by the response length).
- slime/utils/types.py::Sample.append_response_tokens / _apply_meta_info: tokens are item[1] and logprobs item[0] of
  meta_info.output_token_logprobs; finish_reason["type"]; weight_version is appended when the key is present.
- slime/agent/adapters/common.py: "rid" on /generate, then POST /abort_request {"rid"} when its client goes away;
  slime/backends/sglang_utils/server_control.py::_abort_server_once: POST /abort_request {"abort_all": true}.
- slime/rollout/on_policy_distillation.py::reward_func: teacher scoring, max_new_tokens 0 and logprob_start_len 0,
  reading meta_info.input_token_logprobs[1:][i][0].
- slime/backends/sglang_utils/sglang_engine.py::SGLangEngine (`requests.post(json=payload or {})`, raise_for_status,
  .json()) in the order of slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py::
  UpdateWeightFromTensor.update_weights (pause_generation -> GET /flush_cache until 200 -> update_weights_from_tensor
  -> continue_generation); /update_weights_from_disk {model_path, weight_version} from slime/ray/actor_group.py.
- verl/workers/rollout/sglang_rollout/async_sglang_server.py::SGLangHttpServer.generate: `for log_prob, token_id, _ in
  output_token_logprobs` (every entry has exactly three items).
- verl/workers/rollout/sglang_rollout/sglang_rollout.py::ServerAdapter.update_weights -> sglang.srt.weight_sync.utils.
  update_weights -> verl/workers/rollout/sglang_rollout/http_server_engine.py::AsyncHttpServerAdapter: the
  update_weights_from_tensor body (one payload per TP rank, load_format null, flush_cache true) and the memory calls
  in the order of verl/workers/engine_workers.py. verl wraps each tensor in SGLang's LocalSerializedTensor, which our
  server's unpickler does not admit; here each is sent bare (SGLang's `_unwrap_tensor` takes both forms).
SGLang >= 0.5.2x refuses update_weights_from_tensor outside /begin_weight_update ... /end_weight_update, as ours does;
slime and verl pin older SGLang releases without that session, so the sequences here add it.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import io
import json
import pickle
import sys
import time
import types
import uuid
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
import torch.multiprocessing
from safetensors.torch import save_file
from tiny_models import tiny_qwen3_moe

from mcore_rl.rollout import server as server_module
from mcore_rl.rollout.client import RolloutClient
from mcore_rl.rollout.engine import HFRolloutEngine
from mcore_rl.rollout.protocol import parse_generate
from mcore_rl.rollout.server import ServerThread, build_server
from mcore_rl.rollout.weight_receiver import encode_payload

SGLANG = Path(__file__).resolve().parents[1] / ".venv" / "sglang-0.5.23"
BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
HF = tiny_qwen3_moe(initializer_range=0.5, max_position_embeddings=512)  # room for long requests that get aborted
PROMPT = [1, 2, 3, 4]
LAYERS = HF["num_hidden_layers"]
# slime's sampling params (GenerateState.__init__ with slime/utils/arguments.py defaults)
SLIME_PARAMS = {
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 24, "stop": None, "stop_token_ids": None,
    "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False,
}  # fmt: skip


def _load(relpath: str, name: str) -> types.ModuleType:
    path = SGLANG / relpath
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make setup` (tools/fetch_sglang_contract.py extracts it from the wheel)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def api() -> types.ModuleType:
    return _load("sglang/api/v1/api_types.py", "sglang_api_types")


@pytest.fixture(scope="module")
def tb() -> types.ModuleType:
    # Loaded under its real name, so its classes pickle by the path SGLang's unpickler (and ours) looks up.
    return _load("sglang/srt/weight_sync/tensor_bucket.py", BUCKET_MODULE)


@pytest.fixture
def bucket_importable(tb: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """SGLang's tensor_bucket importable as `sglang.srt.weight_sync.tensor_bucket` for this test: pickle imports a
    class's module (parents included) before it refers to the class."""
    parts = BUCKET_MODULE.split(".")
    for i in range(1, len(parts)):
        package = types.ModuleType(".".join(parts[:i]))
        package.__path__ = []
        monkeypatch.setitem(sys.modules, package.__name__, package)
    monkeypatch.setitem(sys.modules, BUCKET_MODULE, tb)
    return tb


@pytest.fixture(scope="module")
def server():
    thread = ServerThread(build_server(dict(HF), api_key=None))
    yield thread
    thread.stop()


def post(server: ServerThread, route: str, body: Any = None) -> requests.Response:
    return requests.post(server.url + route, json=body if body is not None else {}, timeout=60)


def sglang_serialize(obj: Any) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True): a ForkingPickler dump in base64. CPU
    tensors go through shared memory by file name (the receiver maps it), as encode_payload sends them."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def control(server: ServerThread, route: str, payload: dict | None = None) -> dict:
    """slime's SGLangEngine._make_request (verl's adapter does the same): POST json or {}, raise, parse JSON."""
    response = requests.post(server.url + route, json=payload or {}, timeout=60)
    if not response.ok:  # raise_for_status, with the server's message
        pytest.fail(f"{route} answered {response.status_code}: {response.text}")
    return response.json() if response.content.strip() else {}


def flush_cache_until_ok(server: ServerThread) -> None:
    for _ in range(60):  # slime and verl: GET, retried (SGLang answers 400 while requests run)
        if requests.get(server.url + "/flush_cache", timeout=10).status_code == 200:
            return
        time.sleep(0.1)
    pytest.fail("/flush_cache never answered 200")


def wait_running(server: ServerThread) -> None:
    """Until a request is in the running batch (admitted, so its first token is sampled)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if requests.get(server.url + "/v1/loads", timeout=10).json()["loads"][0]["num_running_reqs"]:
            return
        time.sleep(0.005)
    pytest.fail("no request started running")


def greedy(server: ServerThread, tokens: int = 8) -> dict:
    params = {"temperature": 0, "max_new_tokens": tokens}
    return post(server, "/generate", {"input_ids": PROMPT, "sampling_params": params, "return_logprob": True}).json()


def reference_greedy(engine: HFRolloutEngine, server: ServerThread, tokens: int = 8) -> list[int]:
    eos = server.server.batcher.eos_token_ids
    return engine.generate([PROMPT], temperature=0.0, max_new_tokens=tokens, eos_token_ids=eos)[0].response_ids


def check_response(api: types.ModuleType, obj: dict, prompt_len: int) -> Any:
    """Decode one answer (asked with return_logprob) as SGLang's GenerateResponse; check the decoded fields."""
    decoded = api.GenerateResponse.from_json_value(obj)
    meta, raw = decoded.meta_info, obj["meta_info"]
    if raw["finish_reason"] is not None:  # a dict here would mean the tagged union fell back (a contract miss)
        kinds = {"stop": api.FinishStop, "length": api.FinishLength, "abort": api.FinishAbort}
        assert isinstance(meta.finish_reason, kinds[raw["finish_reason"]["type"]]), raw["finish_reason"]
    assert meta.id == raw["id"] and meta.id
    assert decoded.output_ids == obj["output_ids"]
    assert (meta.prompt_tokens, meta.completion_tokens) == (prompt_len, len(obj["output_ids"]))
    assert isinstance(meta.weight_version, str)
    entries = meta.output_token_logprobs  # [logprob, token_id, text]; text is null without return_text_in_logprobs
    assert [(e.logprob, e.token_id, e.text) for e in entries] == [tuple(e) for e in raw["output_token_logprobs"]]
    assert [e.token_id for e in entries] == decoded.output_ids
    assert all(isinstance(e.logprob, float) and e.logprob <= 0 and e.text is None for e in entries)
    return decoded


# ---------------------------------------------------------------------------------------------- /generate responses
GENERATE_CASES = {
    "routed": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}, "return_routed_experts": True},
    "batch": {"input_ids": [[1, 2, 3], [5, 6]], "sampling_params": {"max_new_tokens": 3}},
    "n": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "n": 3}},
    "stop_token": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "stop_token_ids": list(range(100))}},
}


@pytest.mark.parametrize("case", GENERATE_CASES)
def test_generate_responses_decode_as_sglang_generate_response(server, api, case: str) -> None:
    body = {**GENERATE_CASES[case], "return_logprob": True}
    answer = post(server, "/generate", body)
    assert answer.status_code == 200, answer.text
    prompts = body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
    lengths = [len(p) for p in prompts for _ in range(body["sampling_params"].get("n", 1))]
    assert isinstance(answer.json(), list) == (len(lengths) > 1)
    outs = answer.json() if len(lengths) > 1 else [answer.json()]
    decoded = [check_response(api, out, length) for out, length in zip(outs, lengths, strict=True)]
    assert [d.index for d in decoded] == list(range(len(outs)))
    assert len({d.meta_info.id for d in decoded}) == len(outs)
    if case == "stop_token":  # every id stops: one token, FinishStop(matched=that token)
        assert decoded[0].meta_info.finish_reason.matched == decoded[0].output_ids[-1]
    else:
        assert all(d.meta_info.finish_reason.length == len(d.output_ids) for d in decoded)
    if body.get("return_routed_experts"):  # not in api_types (its structs ignore the key): base64 of int32
        routed = base64.b64decode(outs[0]["meta_info"]["routed_experts"])
        rows = len(PROMPT) + len(outs[0]["output_ids"]) - 1
        assert len(routed) == rows * LAYERS * HF["num_experts_per_tok"] * 4


def stream(server: ServerThread, max_new_tokens: int) -> list[dict]:
    """The parsed SSE chunks of one streamed request (checked to end with `data: [DONE]`)."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": max_new_tokens}, "return_logprob": True}
    with requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]" and all(line.startswith(b"data: ") for line in lines)
    return [json.loads(line[len(b"data: ") :]) for line in lines[:-1]]


def test_streamed_chunks_decode_and_accumulate(server, api) -> None:
    chunks = [check_response(api, chunk, len(PROMPT)) for chunk in stream(server, 6)]
    final = chunks[-1].output_ids
    for chunk in chunks[:-1]:  # cumulative, as SGLang streams without --incremental-streaming-output
        assert chunk.meta_info.finish_reason is None and final[: len(chunk.output_ids)] == chunk.output_ids


def test_stream_ends_with_its_finished_chunk(server, api) -> None:
    # (a race once sent [DONE] before the final chunk: the loop saw `finish` before the last event was queued)
    for _ in range(10):
        last = check_response(api, stream(server, 3)[-1], len(PROMPT))
        assert isinstance(last.meta_info.finish_reason, api.FinishLength) and len(last.output_ids) == 3


def test_request_aborted_by_pause_decodes_with_finish_abort(server, api) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400}, "return_logprob": True}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(requests.post, server.url + "/generate", json=body, timeout=60)
        wait_running(server)
        try:
            assert control(server, "/pause_generation")["status"] == "ok"  # mode abort: in-flight requests end
        finally:
            control(server, "/continue_generation")
        answer = pending.result(timeout=60)
    assert answer.status_code == 200  # SGLang answers an aborted request 200, with its partial output
    decoded = check_response(api, answer.json(), len(PROMPT))
    assert isinstance(decoded.meta_info.finish_reason, api.FinishAbort) and 0 < len(decoded.output_ids) < 400


# ---------------------------------------------------------------------------------------------- client requests
def test_client_request_bodies_decode_as_sglang_generate_request(server, api, monkeypatch) -> None:
    seen: list[dict] = []

    def recording(body: Any, **kwargs: Any) -> Any:  # the body as the server decoded it from the wire
        seen.append(copy.deepcopy(body))
        return parse_generate(body, **kwargs)

    monkeypatch.setattr(server_module, "parse_generate", recording)
    client = RolloutClient(server.url, timeout_s=60)
    params = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "max_new_tokens": 150}
    request = client.agenerate_one(PROMPT, 2, params, seed=11, return_routed_experts=True, num_layers=LAYERS)
    try:
        with ThreadPoolExecutor(1) as pool:
            run = pool.submit(client.run, request)
            wait_running(server)
            # slime's server_control._abort_server_once; the client continues each aborted sample
            assert post(server, "/abort_request", {"abort_all": True}).status_code == 200
            samples = run.result(timeout=60)
    finally:
        client.close()
    first = api.GenerateRequest.from_json_value(seen[0])
    sampling = first.sampling_params
    assert (first.input_ids, first.return_logprob, seen[0]["return_routed_experts"]) == (PROMPT, True, True)
    assert (sampling.n, sampling.sampling_seed, sampling.max_new_tokens) == (2, 11, 150)
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 0.9, 20)
    assert len(seen) >= 2, "the abort should have cut the samples short"
    for body in seen[1:]:  # partial rollout: prompt + tokens so far, the remaining budget, one sample
        resumed = api.GenerateRequest.from_json_value(body)
        done = 150 - resumed.sampling_params.max_new_tokens
        assert resumed.sampling_params.n == 1 and resumed.input_ids[: len(PROMPT)] == PROMPT
        assert len(resumed.input_ids) == len(PROMPT) + done
    assert [len(s.response_ids) for s in samples] == [150, 150] and {s.finish_reason for s in samples} == {"length"}


# ---------------------------------------------------------------------------------------------- weight payloads
def test_our_flattened_bucket_rebuilds_with_sglang_bucket(tb) -> None:
    # SGLang views each tensor's bytes in place, so every byte offset must be a multiple of its dtype's size
    # (FlattenedTensorBucket.empty refuses unaligned tensors); neither side pads, and this order keeps them aligned.
    named = [
        ("a.int64", torch.arange(6).reshape(2, 3)),
        ("b.float32", torch.randn(3, 5)),
        ("c.transposed", torch.randn(4, 6).t()),
        ("d.bfloat16", torch.randn(7).bfloat16()),
        ("e.float16", torch.randn(2, 3, 4).half()),
        ("f.scalar", torch.tensor(1.5, dtype=torch.bfloat16)),
        ("g.float8", torch.randn(16).to(torch.float8_e4m3fn)),
    ]
    obj = pickle.loads(base64.b64decode(encode_payload(named)))  # SGLang's unpickler, less its allow-list
    # As SGLang's weight_updater._update_weights_from_flattened_bucket converts the metadata records:
    fields = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
    metadata = [tb.FlattenedTensorMetadata(**{f: getattr(m, f) for f in fields}) for m in obj["metadata"]]
    rebuilt = tb.FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=metadata)
    for (name, want), (got_name, got) in zip(named, rebuilt.reconstruct_tensors(), strict=True):
        assert (got_name, got.dtype, got.shape) == (name, want.dtype, want.shape)
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    sglang_own = tb.FlattenedTensorBucket(named_tensors=named)  # the same bytes and byte offsets as SGLang's
    assert metadata == sglang_own.get_metadata()
    assert torch.equal(obj["flattened_tensor"], sglang_own.get_flattened_tensor())


def sglang_bucket_payload(tb: types.ModuleType, named: list[tuple[str, torch.Tensor]]) -> str:
    """What slime sends per TP rank: SGLang's own bucket and metadata records, serialized as SGLang does."""
    bucket = tb.FlattenedTensorBucket(named_tensors=named)
    return sglang_serialize({"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()})


def test_sglang_flattened_bucket_loads_through_our_server(server, bucket_importable) -> None:
    weights = HFRolloutEngine(dict(HF), init_seed=5).state_dict_hf()
    dtypes = {
        "model.norm.weight": torch.bfloat16,
        "model.layers.0.mlp.gate.weight": torch.float32,
        "model.layers.1.mlp.experts.2.down_proj.weight": torch.float16,
        "model.embed_tokens.weight": torch.float32,
    }
    named = [(name, weights[name].to(dtype)) for name, dtype in dtypes.items()]
    payload = sglang_bucket_payload(bucket_importable, named)
    raw = base64.b64decode(payload)  # (not unpickled here: a shared-memory payload is opened once, by the server)
    assert BUCKET_MODULE.encode() in raw and b"FlattenedTensorMetadata" in raw  # SGLang's class, by its path
    control(server, "/begin_weight_update")
    body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket", "weight_version": "contract"}
    assert control(server, "/update_weights_from_tensor", body)["success"]
    assert control(server, "/end_weight_update")["weight_version"] == "contract"
    for name, tensor in named:  # the server's parameters are float32: each holds the sent value, cast
        got = post(server, "/get_weights_by_name", {"name": name, "truncate_size": 1000}).json()
        assert torch.equal(torch.tensor(got), tensor.float()), name


# ---------------------------------------------------------------------------------------------- slime and verl
def slime_read(output: dict) -> tuple[list[int], list[float], str]:
    """What slime takes from an answer (Sample.append_response_tokens / _apply_meta_info)."""
    meta = output["meta_info"]
    entries = meta.get("output_token_logprobs", [])
    return [item[1] for item in entries], [item[0] for item in entries], meta["finish_reason"]["type"]


def test_slime_generate_and_partial_rollout_resume(server, api) -> None:
    body = {"input_ids": PROMPT, "sampling_params": dict(SLIME_PARAMS), "return_logprob": True}
    assert api.GenerateRequest.from_json_value(body).sampling_params.no_stop_trim is True
    first = post(server, "/generate", body).json()
    check_response(api, first, len(PROMPT))
    tokens, logprobs, finish = slime_read(first)
    assert (len(tokens), len(logprobs), finish, first["text"]) == (24, 24, "length", "")
    done = 10  # an aborted sample resumes with its tokens so far and the rest of the budget
    resumed = {**body, "input_ids": PROMPT + tokens[:done], "sampling_params": {**SLIME_PARAMS, "max_new_tokens": 14}}
    api.GenerateRequest.from_json_value(resumed)
    second = post(server, "/generate", resumed).json()
    check_response(api, second, len(PROMPT) + done)
    assert [len(x) for x in slime_read(second)[:2]] == [14, 14] and slime_read(second)[2] == "length"


def test_slime_agent_rid_and_abort_request(server, api) -> None:
    rid = uuid.uuid4().hex
    body = {"rid": rid, "input_ids": PROMPT, "sampling_params": {**SLIME_PARAMS, "max_new_tokens": 400}}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            requests.post, server.url + "/generate", json={**body, "return_logprob": True}, timeout=60
        )
        wait_running(server)
        assert requests.post(server.url + "/abort_request", json={"rid": rid}, timeout=10).status_code == 200
        answer = pending.result(timeout=60)
    assert answer.status_code == 200  # slime depends on an aborted request answering 200 with its partial output
    decoded = check_response(api, answer.json(), len(PROMPT))
    assert decoded.meta_info.id == rid and slime_read(answer.json())[2] == "abort"
    assert 0 < len(decoded.output_ids) < 400


def test_slime_teacher_scoring_request(server, api) -> None:
    student = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}, "return_logprob": True}
    tokens, logprobs, _ = slime_read(post(server, "/generate", student).json())
    sampling = {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False}
    body = {"input_ids": PROMPT + tokens, "sampling_params": sampling, "return_logprob": True, "logprob_start_len": 0}
    scored = post(server, "/generate", body).json()
    decoded = api.GenerateResponse.from_json_value(scored)
    assert decoded.output_ids == [] and decoded.meta_info.completion_tokens == 0
    assert [e.token_id for e in decoded.meta_info.input_token_logprobs] == PROMPT + tokens
    assert decoded.meta_info.input_token_logprobs[0].logprob is None  # nothing predicts the first token
    teacher = [item[0] for item in scored["meta_info"]["input_token_logprobs"][1:]]  # reward_func's read
    # The scored response tokens carry the logprobs they were sampled with (prefill vs decode: float32 rounding).
    torch.testing.assert_close(torch.tensor(teacher[len(PROMPT) - 1 :]), torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_slime_weight_update_sequence(server, bucket_importable) -> None:
    source = HFRolloutEngine(dict(HF), init_seed=1)
    named = list(source.state_dict_hf().items())
    assert control(server, "/pause_generation")["status"] == "ok"  # json {}: mode abort
    try:
        flush_cache_until_ok(server)
        assert control(server, "/begin_weight_update")["success"]
        for part in (named[:20], named[20:]):  # one call per bucket
            body = {"serialized_named_tensors": [sglang_bucket_payload(bucket_importable, part)]}
            body.update(load_format="flattened_bucket", flush_cache=False, weight_version="7")
            assert control(server, "/update_weights_from_tensor", body)["success"]
        assert control(server, "/end_weight_update")["success"]
    finally:
        assert control(server, "/continue_generation")["status"] == "ok"
    out = greedy(server)
    assert out["meta_info"]["weight_version"] == "7" and slime_read(out)[0] == reference_greedy(source, server)


def test_slime_update_weights_from_disk(server, tmp_path) -> None:
    source = HFRolloutEngine(dict(HF), init_seed=2)
    save_file({n: t.clone() for n, t in source.state_dict_hf().items()}, str(tmp_path / "model.safetensors"))
    answer = control(server, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "8"})
    assert answer["success"]
    out = greedy(server)
    assert out["meta_info"]["weight_version"] == "8" and out["output_ids"] == reference_greedy(source, server)


def test_verl_memory_and_weight_update_sequence(server, monkeypatch) -> None:
    source = HFRolloutEngine(dict(HF), init_seed=3)
    named = [(name, tensor.clone()) for name, tensor in source.state_dict_hf().items()]
    assert control(server, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})["success"]
    try:
        assert control(server, "/resume_memory_occupation", {"tags": ["weights"]})["success"]
        control(server, "/begin_weight_update")
        # verl: [(name, LocalSerializedTensor(values=[bytes of tensor for infer TP rank 0, rank 1]))], the same
        # payload for every infer TP rank (2 here); rank r unpickles values[r]
        local = types.new_class("LocalSerializedTensor", (types.SimpleNamespace,))
        local.__module__ = "sglang.srt.model_executor.model_runner_components.weight_updater"
        parts = local.__module__.split(".")
        for i in range(1, len(parts) + 1):  # pickle imports the class's module, parents included
            module = types.ModuleType(".".join(parts[:i]))
            module.__path__ = []
            monkeypatch.setitem(sys.modules, module.__name__, module)
        sys.modules[local.__module__].LocalSerializedTensor = local
        raw = [(n, local(values=[base64.b64decode(sglang_serialize(t))] * 2)) for n, t in named]
        payload = sglang_serialize(raw)
        body = {"serialized_named_tensors": [payload, payload], "load_format": None, "flush_cache": True}
        assert control(server, "/update_weights_from_tensor", body)["success"]
        control(server, "/end_weight_update")
        flush_cache_until_ok(server)
        assert control(server, "/resume_memory_occupation", {"tags": ["kv_cache"]})["success"]
    except BaseException:  # leave the module's server serving for the tests after this one
        control(server, "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
        raise
    tokens, logprobs = [], []
    for log_prob, token_id, _ in greedy(server)["meta_info"]["output_token_logprobs"]:  # verl's unpacking
        tokens.append(token_id)
        logprobs.append(log_prob)
    assert tokens == reference_greedy(source, server) and all(lp <= 0 for lp in logprobs)


def test_pause_in_abort_mode_while_clients_continue_answers_every_request(server, api) -> None:
    """slime pauses with {} (mode abort) while its rollout keeps sending: every request gets an answer (a race once
    dropped a request that arrived while the pause was aborting the others)."""
    client = RolloutClient(server.url, timeout_s=60)
    try:
        for _ in range(5):
            request = client.agenerate_one(PROMPT, 2, {"max_new_tokens": 120, "ignore_eos": True})
            with ThreadPoolExecutor(1) as pool:
                run = pool.submit(client.run, request)
                wait_running(server)
                assert control(server, "/pause_generation")["status"] == "ok"
                time.sleep(0.05)  # continuations queue while paused
                control(server, "/continue_generation")
                samples = run.result(timeout=60)
            assert [len(s.response_ids) for s in samples] == [120, 120]
    finally:
        client.close()


def test_unreadable_or_misaligned_buckets_are_refused_and_spoil_the_session(server) -> None:
    source = HFRolloutEngine(dict(HF), init_seed=4)
    named = [(n, t.clone()) for n, t in source.state_dict_hf().items()]
    version = requests.get(server.url + "/get_weight_version").json()["weight_version"]
    control(server, "/begin_weight_update")
    good = {"serialized_named_tensors": [sglang_serialize(named[:2])], "load_format": None}
    assert requests.post(server.url + "/update_weights_from_tensor", json=good).status_code == 200
    bad = requests.post(server.url + "/update_weights_from_tensor", json={"serialized_named_tensors": ["!!notbase64"]})
    assert bad.status_code == 400 and "could not be decoded" in bad.json()["message"]
    assert requests.post(server.url + "/end_weight_update", json={}).status_code == 400, "nothing is committed"
    assert requests.get(server.url + "/get_weight_version").json()["weight_version"] == version
    # a flattened bucket whose float32 tensor starts at an odd byte: 400 naming it
    flat = torch.zeros(7 * 2 + 8, dtype=torch.uint8)
    meta = [
        types.SimpleNamespace(name="a", shape=torch.Size([7]), dtype=torch.bfloat16, start_idx=0, end_idx=14, numel=14),
        types.SimpleNamespace(name="b", shape=torch.Size([2]), dtype=torch.float32, start_idx=14, end_idx=22, numel=8),
    ]
    control(server, "/begin_weight_update")
    body = {
        "serialized_named_tensors": [sglang_serialize({"flattened_tensor": flat, "metadata": meta})],
        "load_format": "flattened_bucket",
    }
    answer = requests.post(server.url + "/update_weights_from_tensor", json=body)
    assert answer.status_code == 400 and "tensor 'b' starts at byte 14" in answer.json()["message"]
    control(server, "/abort_weight_update")  # leave no spoiled session behind (a second begin is refused)
