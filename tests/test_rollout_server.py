"""The embedded SGLang-compatible server, route by route, over HTTP on loopback (one server per module, no Ray).

Run: `.venv/bin/pytest tests/test_rollout_server.py`
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch
from tiny_models import tiny_qwen3_moe

from mcore_rl.parallel.groups import free_port
from mcore_rl.rollout.engine import HFRolloutEngine
from mcore_rl.rollout.server import ServerThread, build_server
from mcore_rl.rollout.weight_receiver import encode_payload

HF = tiny_qwen3_moe(initializer_range=0.5, max_position_embeddings=256)
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    thread = ServerThread(build_server(dict(HF), api_key=KEY, max_running_requests=64))
    yield thread
    thread.stop()


def post(server, route: str, body=None, **kwargs) -> requests.Response:
    return requests.post(server.url + route, json=body if body is not None else {}, headers=AUTH, timeout=60, **kwargs)


def generate(server, body: dict) -> requests.Response:
    return post(server, "/generate", body)


def source_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    return list(HFRolloutEngine(dict(HF), init_seed=seed).state_dict_hf().items())


def sync(server, named, version: str, load_format="flattened_bucket") -> None:
    assert post(server, "/begin_weight_update").status_code == 200
    body = {"serialized_named_tensors": [encode_payload(named, load_format)], "load_format": load_format}
    answer = post(server, "/update_weights_from_tensor", {**body, "weight_version": version})
    assert answer.status_code == 200, answer.text
    assert post(server, "/end_weight_update").json()["weight_version"] == version


def greedy(server, prompt, tokens=6) -> list[int]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    return generate(server, body).json()["output_ids"]


def test_generate_single_batch_and_n_samples(server) -> None:
    one = generate(server, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    assert one.status_code == 200
    out = one.json()
    assert isinstance(out, dict) and len(out["output_ids"]) == 4
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 4)
    batch = generate(server, {"input_ids": [[1, 2], [3, 4, 5]], "sampling_params": {"max_new_tokens": 2, "n": 3}})
    outs = batch.json()
    assert [o["index"] for o in outs] == list(range(6)) and [o["meta_info"]["prompt_tokens"] for o in outs] == [
        2
    ] * 3 + [3] * 3
    # The n samples of a prompt share one prefill: all but the first report the prompt as cached.
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 2, 2, 0, 3, 3]


def test_rollout_logprobs_equal_teacher_forced_and_seeds_are_per_sample(server) -> None:
    sync(server, source_weights(3), "3")
    engine = HFRolloutEngine(dict(HF), init_seed=3)
    params = {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.95, "n": 4, "sampling_seed": 11, "ignore_eos": True}
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": params, "return_logprob": True}
    outs = generate(server, body).json()
    seqs = [[5, 6, 7, 8] + o["output_ids"] for o in outs]
    forced = engine.logprobs(seqs, [4] * 4, temperature=0.8)
    for out, expected in zip(outs, forced):
        entries = out["meta_info"]["output_token_logprobs"]
        assert [e[1] for e in entries] == out["output_ids"]
        torch.testing.assert_close(torch.tensor([e[0] for e in entries]), expected, atol=5e-5, rtol=0)
    # The same seed gives the same samples while other requests share the batch (per-sequence generators).
    noise = [
        threading.Thread(
            target=generate, args=(server, {"input_ids": [9] * k, "sampling_params": {"max_new_tokens": 9}})
        )
        for k in (2, 5, 7)
    ]
    for t in noise:
        t.start()
    again = generate(server, body).json()
    for t in noise:
        t.join()
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1, "sample j is seeded sampling_seed + j"


def test_requests_join_and_leave_the_running_batch() -> None:
    from mcore_rl.rollout.scheduler import ContinuousBatcher, GenParams, Sequence

    engine = HFRolloutEngine(dict(HF), init_seed=3)
    batcher = ContinuousBatcher(engine, max_running=8)
    long = Sequence("long", [1, 2, 3], GenParams(max_new_tokens=30, temperature=0, ignore_eos=True))
    short = Sequence("short", [4, 5, 6, 7, 8], GenParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    batcher.submit([long])
    for _ in range(5):
        batcher.step()
    batcher.submit([short])  # joins at the next step boundary, into the running batch
    batcher.step()
    assert batcher.num_running == 2 and len(long.output_ids) == 7 and len(short.output_ids) == 2
    batcher.step()
    assert short.finish == {"type": "length", "length": 3} and long.finish is None
    assert batcher.num_running == 1, "the finished row left the batch"
    while long.finish is None:
        batcher.step()
    assert batcher.stats["decode_steps"] == 30 - 1, "one decode step per token after the first, shared by both"
    # Each sequence computed what it computes alone (left padding, position ids, per-row masks).
    alone = [
        engine.generate([p], temperature=0, max_new_tokens=k)[0].response_ids
        for p, k in ([[1, 2, 3], 30], [[4, 5, 6, 7, 8], 3])
    ]
    assert [long.output_ids, short.output_ids] == alone


def test_stop_conditions(server) -> None:
    free = greedy(server, [1, 2, 3], 8)
    stop_at = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    stopped = generate(
        server, {**body, "sampling_params": {**body["sampling_params"], "stop_token_ids": [free[stop_at]]}}
    )
    assert stopped.json()["output_ids"] == free[: stop_at + 1]
    assert stopped.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": free[stop_at]}
    # min_new_tokens masks the stop token until that many tokens exist
    params = {**body["sampling_params"], "stop_token_ids": [free[0]], "min_new_tokens": 3}
    assert len(generate(server, {**body, "sampling_params": params}).json()["output_ids"]) >= 3
    # max_new_tokens=0 with logprob_start_len=0 scores the prompt (slime's teacher scoring)
    scored = generate(
        server,
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    ).json()
    assert scored["output_ids"] == [] and len(scored["meta_info"]["input_token_logprobs"]) == 3
    assert scored["meta_info"]["input_token_logprobs"][0][0] is None


def test_routed_experts_layout(server) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    out = generate(server, {**body, "return_routed_experts": True}).json()
    import base64

    import numpy as np

    routed = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    routed = routed.reshape(3 + 4 - 1, HF["num_hidden_layers"], HF["num_experts_per_tok"])
    assert routed.min() >= 0 and routed.max() < HF["num_experts"]
    assert all(len(set(row)) == HF["num_experts_per_tok"] for row in routed.reshape(-1, HF["num_experts_per_tok"]))


def test_streaming_sends_cumulative_chunks_then_done(server) -> None:
    body = {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    response = requests.post(server.url + "/generate", json=body, headers=AUTH, stream=True, timeout=60)
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(line[len(b"data: ") :]) for line in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == sorted(len(c["output_ids"]) for c in chunks)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length" and len(chunks[-1]["output_ids"]) == 5


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "temprature": 1}}, "unknown sampling_params key"),
        ({"input_ids": [1, 2, 300]}, "outside the vocabulary [0, 100)"),
        ({"input_ids": [1] * 256}, "the context length is 256"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p=0 is invalid"),
        ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "regex"),
        ({"input_ids": [1], "bogus": 1}, "unknown request key 'bogus'"),
        ({"text": "hello"}, "text prompts need a tokenizer"),
        ({}, "give exactly one of input_ids"),
    ],
)
def test_bad_generate_requests_get_400_naming_the_key(server, body, message) -> None:
    answer = generate(server, body)
    assert answer.status_code == 400
    assert message in answer.json()["error"]["message"]


def test_malformed_json_and_auth(server) -> None:
    bad = requests.post(server.url + "/generate", data="{nope", headers=AUTH, timeout=10)
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    for route in ("/health", "/health_generate"):  # probes need no key (SGLang's auth exempts /health*)
        assert requests.get(server.url + route, timeout=30).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert requests.get(server.url + "/model_info", headers=headers, timeout=10).status_code == 401
        assert requests.post(server.url + "/generate", json={"input_ids": [1]}, headers=headers).status_code == 401


def test_info_routes(server) -> None:
    for route in ("/model_info", "/get_model_info"):
        info = requests.get(server.url + route, headers=AUTH).json()
        assert info["model_type"] == "qwen3_moe" and info["is_generation"] is True
    for route in ("/server_info", "/get_server_info"):
        assert requests.get(server.url + route, headers=AUTH).json()["context_length"] == 256
    assert requests.get(server.url + "/health_generate", headers=AUTH).status_code == 200
    loads = requests.get(server.url + "/v1/loads", headers=AUTH).json()["loads"][0]
    assert loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 0


def test_weight_update_is_staged_and_atomic(server) -> None:
    sync(server, source_weights(1), "1")
    before = greedy(server, [1, 2, 3])
    new = source_weights(2)
    assert post(server, "/begin_weight_update").status_code == 200
    half = len(new) // 2
    for part in (new[:half], new[half:]):
        body = {"serialized_named_tensors": [encode_payload(part, None)], "load_format": None, "weight_version": "2"}
        assert post(server, "/update_weights_from_tensor", body).status_code == 200
        assert greedy(server, [1, 2, 3]) == before, "staged tensors must not be visible before end_weight_update"
        assert requests.get(server.url + "/get_weight_version", headers=AUTH).json()["weight_version"] == "1"
    assert post(server, "/end_weight_update").json()["weight_version"] == "2"
    assert (
        greedy(server, [1, 2, 3])
        == HFRolloutEngine(dict(HF), init_seed=2).generate([[1, 2, 3]], temperature=0, max_new_tokens=6)[0].response_ids
    )
    name, tensor = new[0]
    got = post(server, "/get_weights_by_name", {"name": name, "truncate_size": 2}).json()
    torch.testing.assert_close(torch.tensor(got), tensor[:2].float())


@pytest.mark.parametrize(
    "bucket, message",
    [
        ([("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))], "has shape [3, 3], expected [32, 32]"),
        ([("model.nope.weight", torch.zeros(2))], "unknown tensor 'model.nope.weight'"),
    ],
)
def test_refused_bucket_keeps_old_weights_and_version(server, bucket, message) -> None:
    sync(server, source_weights(4), "4")
    before = greedy(server, [7, 8])
    assert post(server, "/begin_weight_update").status_code == 200
    good = {"serialized_named_tensors": [encode_payload(source_weights(5), None)], "weight_version": "5"}
    assert post(server, "/update_weights_from_tensor", good).status_code == 200
    refused = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [encode_payload(bucket, None)]})
    assert refused.status_code == 400 and message in refused.json()["message"]
    assert post(server, "/end_weight_update").status_code == 400  # nothing of the session is committed
    assert greedy(server, [7, 8]) == before
    assert requests.get(server.url + "/get_weight_version", headers=AUTH).json()["weight_version"] == "4"


def test_update_without_begin_is_refused(server) -> None:
    body = {"serialized_named_tensors": [encode_payload(source_weights(1)[:1], None)]}
    answer = post(server, "/update_weights_from_tensor", body)
    assert answer.status_code == 400
    assert (
        answer.json()["message"]
        == "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
    )
    assert post(server, "/end_weight_update").status_code == 400


def test_update_weights_from_distributed_over_gloo(server) -> None:
    from mcore_rl.parallel.update_group import broadcast, new_update_group

    port = free_port()
    group: dict = {}
    sender = threading.Thread(
        target=lambda: group.update(g=new_update_group("gloo", "127.0.0.1", port, 0, 2, "pp0", timeout_s=60))
    )
    sender.start()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "group_name": "pp0"}
    assert post(server, "/init_weights_update_group", {**body, "backend": "gloo"}).status_code == 200
    sender.join()
    named = source_weights(6)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named])
    meta = {
        "names": [n for n, _ in named],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "group_name": "pp0",
        "load_format": "flattened_bucket",
        "weight_version": "6",
    }
    assert post(server, "/begin_weight_update").status_code == 200
    # As slime does: the HTTP call goes out first and the server joins the broadcast the sender then starts.
    done: dict = {}
    call = threading.Thread(target=lambda: done.update(r=post(server, "/update_weights_from_distributed", meta)))
    call.start()
    broadcast(group["g"], flat)
    call.join()
    assert done["r"].status_code == 200, done["r"].text
    assert post(server, "/end_weight_update").json()["weight_version"] == "6"
    engine = HFRolloutEngine(dict(HF), init_seed=6)
    assert greedy(server, [3, 1]) == engine.generate([[3, 1]], temperature=0, max_new_tokens=6)[0].response_ids
    assert post(server, "/destroy_weights_update_group", {"group_name": "pp0"}).status_code == 200


def test_update_weights_from_disk_commits_at_once(server, tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(HF)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(8)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    answer = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "8"})
    assert answer.status_code == 200, answer.text
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[2, 4, 6]])
    expected = reference.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)[0, 3:].tolist()
    assert greedy(server, [2, 4, 6]) == expected
    missing = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "nope")})
    assert missing.status_code == 400 and "is not a model directory" in missing.json()["message"]


def _long_request(server, out: list) -> threading.Thread:
    # 200 decode steps: pausing after the first one leaves a wide margin on a loaded machine
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    thread = threading.Thread(target=lambda: out.append(generate(server, body)))
    thread.start()
    deadline = time.monotonic() + 10
    while requests.get(server.url + "/v1/loads", headers=AUTH).json()["loads"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return thread


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes(server, mode) -> None:
    out: list = []
    thread = _long_request(server, out)
    assert post(server, "/pause_generation", {"mode": mode}).json()["status"] == "ok"
    if mode == "abort":
        thread.join(timeout=30)
        answer = out[0]
        assert answer.status_code == 200 and answer.json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(answer.json()["output_ids"]) < 200
    else:
        time.sleep(0.2)
        assert not out, "a paused request makes no progress"
        flush = requests.get(server.url + "/flush_cache", headers=AUTH)
        # as SGLang's is_fully_idle(ignore_waiting=paused): a request paused in place still runs (400); one that a
        # retract put back in the queue does not count (200)
        assert flush.status_code == (400 if mode == "in_place" else 200), flush.text
    assert post(server, "/continue_generation").status_code == 200
    thread.join(timeout=30)
    if mode != "abort":
        assert len(out[0].json()["output_ids"]) == 200
    assert requests.get(server.url + "/flush_cache", headers=AUTH).status_code == 200


def test_abort_request_by_rid(server) -> None:
    out: list = []
    body = {"rid": "victim", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
    assert post(server, "/pause_generation", {"mode": "in_place"}).status_code == 200  # it waits in the queue
    thread = threading.Thread(target=lambda: out.append(generate(server, body)))
    thread.start()
    deadline = time.monotonic() + 10
    while requests.get(server.url + "/v1/loads", headers=AUTH).json()["loads"][0]["num_waiting_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert post(server, "/abort_request", {"rid": "victim"}).status_code == 200
    thread.join(timeout=30)
    assert post(server, "/continue_generation").status_code == 200
    assert out[0].status_code == 200 and out[0].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(server, "/abort_request", {}).status_code == 400


def test_a_whole_update_swaps_storage_with_the_shadows_and_allocates_nothing(server) -> None:
    receiver, engine = server.server.receiver, server.server.engine
    sync(server, source_weights(11), "11")
    resident = receiver.resident_bytes
    live = {key: engine.parameter(key).data_ptr() for key in receiver._shadows}
    shadows = {key: t.data_ptr() for key, t in receiver._shadows.items()}
    assert set(shadows) == {engine.param_key(name) for name, _ in source_weights(11)}  # every parameter has one
    assert resident >= sum(t.numel() * t.element_size() for _, t in source_weights(11))  # one model, kept
    sync(server, source_weights(12), "12")
    assert receiver.resident_bytes == resident, "the second update allocated new shadows"
    # The commit moved no bytes: each parameter now lives in its former shadow, and its old storage is the shadow.
    assert {key: engine.parameter(key).data_ptr() for key in live} == shadows
    assert {key: t.data_ptr() for key, t in receiver._shadows.items()} == live
    assert (
        greedy(server, [5, 6])
        == HFRolloutEngine(dict(HF), init_seed=12).generate([[5, 6]], temperature=0, max_new_tokens=6)[0].response_ids
    )


def test_an_update_of_part_of_a_parameter_copies_only_that_part(server) -> None:
    sync(server, source_weights(13), "13")
    engine = server.server.engine
    new = dict(source_weights(14))
    expert = "model.layers.0.mlp.experts.1.up_proj.weight"  # one chunk of one expert of a fused parameter
    key = engine.param_key(expert)
    before = engine.parameter(key).clone()
    pointer = engine.parameter(key).data_ptr()
    sync(server, [(expert, new[expert])], "14")
    state = engine.state_dict_hf()
    assert torch.equal(state[expert], new[expert])
    assert engine.parameter(key).data_ptr() == pointer  # copied in place, not swapped
    changed = (engine.parameter(key) != before).sum().item()
    assert changed == (new[expert] != dict(source_weights(13))[expert]).sum().item()  # nothing else moved
    assert torch.equal(
        state["model.layers.0.mlp.experts.1.gate_proj.weight"],
        dict(source_weights(13))["model.layers.0.mlp.experts.1.gate_proj.weight"],
    )


def test_release_and_resume_memory(server) -> None:
    sync(server, source_weights(9), "9")
    expected = greedy(server, [4, 4])
    assert server.server.receiver.resident_bytes > 0  # staging kept for the next update ...
    assert post(server, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]}).status_code == 200
    assert server.server.receiver.resident_bytes == 0  # ... and released with the weights
    assert requests.get(server.url + "/server_info", headers=AUTH).json()["internal_states"][0]["weights_released"]
    assert post(server, "/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    sync(server, source_weights(9), "10")  # the values are gone until the next sync (as with SGLang's saver)
    assert post(server, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert greedy(server, [4, 4]) == expected
    assert post(server, "/release_memory_occupation", {"tags": ["vram"]}).status_code == 400


def test_without_kept_buffers_a_commit_leaves_no_staging_behind() -> None:
    """sync.keep_buffers=false, the engine's side: once each update is applied, its staging copy of the weights, its
    receive buffers and the payload segments it mapped are freed (the kept ones are a whole model: the test above),
    and the weights are the update's as when they are kept."""
    thread = ServerThread(build_server(dict(HF), api_key=KEY, max_running_requests=64, keep_update_buffers=False))
    try:
        for version in (11, 12):
            sync(thread, source_weights(version), str(version))
            receiver = thread.server.receiver
            assert receiver.resident_bytes == 0 and not receiver._mapped and not receiver._mapped_last
        expected = HFRolloutEngine(dict(HF), init_seed=12).generate([[5, 6]], temperature=0, max_new_tokens=6)
        assert greedy(thread, [5, 6]) == expected[0].response_ids
    finally:
        thread.stop()


def test_update_weight_version(server) -> None:
    answer = post(server, "/update_weight_version", {"new_version": "42"})
    assert answer.json()["new_version"] == "42"
    out = generate(server, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).json()
    assert out["meta_info"]["weight_version"] == "42"


def test_cli_serves_and_refuses_bad_arguments(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HF))
    cli = [sys.executable, "-m", "mcore_rl.rollout.server"]
    refused = subprocess.run([*cli, "--hf-config", str(config), "--host", "0.0.0.0"], capture_output=True, text=True)
    assert refused.returncode == 2 and "needs --api-key" in refused.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    out = subprocess.run([*cli, "--hf-config", str(broken)], capture_output=True, text=True)
    assert out.returncode == 2 and f"--hf-config {broken}: not valid JSON" in out.stderr
    broken.write_text("[1, 2]")
    out = subprocess.run([*cli, "--hf-config", str(broken)], capture_output=True, text=True)
    assert out.returncode == 2 and f"--hf-config {broken}: expected a JSON object" in out.stderr
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([*cli, "--hf-config", str(config), "--port", str(port)], env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not come up"
            time.sleep(0.2)
        answer = requests.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": [1, 2]}, timeout=30)
        assert answer.status_code == 200 and answer.json()["meta_info"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_client_retries_after_on_failure_and_refuses_bad_requests(server) -> None:
    from mcore_rl.rollout.client import RolloutClient, RolloutRequestError

    calls: list[str] = []
    client = RolloutClient(f"http://127.0.0.1:{free_port()}", api_key=KEY, max_retries=2, backoff_s=0.01)

    def failover() -> None:  # what the engine pool does: find the dead engine, route around it
        calls.append(client.url)
        client.url = server.url

    client.on_failure = failover
    try:
        samples = client.generate_samples([[1, 2, 3]], 2, {"max_new_tokens": 3, "ignore_eos": True}, seed=5)
        assert len(calls) == 1 and client.stats["retries"] == 1
        assert [len(s.response_ids) for s in samples] == [3, 3] and samples[0].finish_reason == "length"
        with pytest.raises(RolloutRequestError, match="unknown sampling_params key 'bogus'"):
            client.generate_samples([[1]], 1, {"bogus": 1})
        assert client.stats["retries"] == 1, "a 400 is not retried"
    finally:
        client.close()
