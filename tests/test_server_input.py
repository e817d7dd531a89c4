"""The embedded rollout server refuses bad requests and bad weights, and one bad request fails no other.

Every bad input path (text, input_ids, batched prompts, raw JSON, the update-group and disk routes) is a 400 naming
the field; a bad request never reaches the running batch, so a valid request in flight beside it is served;
non-finite or wrongly typed weights are refused on every update route with the old weights kept; sampling from
non-finite logits fails the request; `/update_weights_from_disk` reads regular files only (a FIFO cannot freeze the
server) and answers "not a model directory" alike for every path that is not one; a client that goes away
mid-stream leaves one quiet line in the server's log, no traceback.

The FIFO and disconnect tests run the server as its own process (`python -m mcore_rl.rollout.server`): a server
frozen by a FIFO would freeze a test that shares its interpreter, and the log checked is the process's stderr.

Run: `.venv/bin/pytest tests/test_server_input.py`
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import save_file
from tiny_models import tiny_qwen3_moe

from mcore_rl.parallel.groups import free_port
from mcore_rl.rollout.engine import HFRolloutEngine
from mcore_rl.rollout.sampling import sample_rows
from mcore_rl.rollout.server import ServerThread, build_server
from mcore_rl.rollout.weight_receiver import WeightUpdateError, encode_payload, read_safetensors_dir

HF = tiny_qwen3_moe(max_position_embeddings=256)
NORM = "model.norm.weight"  # a float parameter of the tiny model
NOT_A_MODEL_DIRECTORY = "is not a model directory"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An in-process server with the tiny ChatML tokenizer, room for 64 sequences at once."""
    from mcore_rl.data.tokenizer import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(str(path))
    thread = ServerThread(build_server(dict(HF), tokenizer=str(path), max_running_requests=64))
    yield thread
    thread.stop()


def post(server, route: str, body=None, timeout: float = 60, **kwargs) -> requests.Response:
    return requests.post(server.url + route, json=body if body is not None else {}, timeout=timeout, **kwargs)


def message(answer: requests.Response) -> str:
    payload = answer.json()
    return payload["error"]["message"] if "error" in payload else payload["message"]


def loads(server) -> dict:
    return requests.get(server.url + "/v1/loads", timeout=60).json()["loads"][0]


def wait_for(condition, what: str, timeout: float = 120) -> None:
    """Poll the server's own state until `condition()` holds (a deadline turns a hang into a failure)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def greedy(server, prompt=(3, 1, 4), tokens: int = 6) -> list[int]:
    body = {"input_ids": list(prompt), "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}
    answer = post(server, "/generate", {**body, "sampling_params": {**body["sampling_params"], "ignore_eos": True}})
    assert answer.status_code == 200, answer.text
    return answer.json()["output_ids"]


def version(server) -> str:
    return requests.get(server.url + "/get_weight_version", timeout=60).json()["weight_version"]


# ---------------------------------------------------------------------------------------------------- /generate
ONE = {"max_new_tokens": 2}
BAD_GENERATE = [
    ({"text": "", "sampling_params": ONE}, "text[0]"),
    ({"text": ["hi", ""], "sampling_params": ONE}, "text[1]"),
    ({"text": [], "sampling_params": ONE}, "text"),
    ({"text": "\ud800abc", "sampling_params": ONE}, "text[0]"),
    ({"text": ["hi", "a\udfffb"], "sampling_params": ONE}, "text[1]"),
    ({"input_ids": [], "sampling_params": ONE}, "input_ids"),
    ({"input_ids": [True, 2], "sampling_params": ONE}, "input_ids[0]"),
    ({"input_ids": [1], "sampling_params": {**ONE, "top_k": 2**70}}, "sampling_params.top_k"),
    ({"input_ids": [[1], [2]], "sampling_params": [ONE, {**ONE, "top_k": 2**63}]}, "sampling_params.top_k"),
    ({"text": ["hi", "ho"], "sampling_params": {**ONE, "top_k": 2**31}}, "sampling_params.top_k"),
    ({"input_ids": [1], "sampling_params": {**ONE, "stop": ["\ud800"]}}, "sampling_params.stop"),
]


@pytest.mark.parametrize("body, field", BAD_GENERATE, ids=range(len(BAD_GENERATE)))
def test_bad_generate_inputs_are_400s_naming_the_field(server, body, field) -> None:
    answer = post(server, "/generate", body)
    assert answer.status_code == 400 and field in message(answer), answer.text


@pytest.mark.parametrize(
    "raw, field",
    [
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": ' + b"1" * 5000 + b"}}", "max_new_tokens"),
        (b'{"input_ids": [1, ' + b"7" * 5000 + b"]}", "input_ids"),
        (b'{"text": "hi", "sampling_params": {"top_k": -' + b"9" * 4500 + b"}}", "top_k"),
    ],
    ids=["sampling_param", "input_id", "negative"],
)
def test_a_5000_digit_number_is_a_400_naming_the_field(server, raw, field) -> None:
    answer = requests.post(server.url + "/generate", data=raw, timeout=60)
    assert answer.status_code == 400 and field in message(answer) and "digits" in message(answer), answer.text


def test_a_bad_request_fails_no_valid_request_in_flight(server) -> None:
    """A valid n=64 request is running (held in place by /pause_generation in_place, so the order is certain)
    while bad requests arrive. Each is refused with a 400 before it reaches the batch, and the valid request is
    served whole. Before the checks, the bad requests queued behind the pause and, once generation continued,
    failed the shared batch step: every sequence in it, the valid request's 64 too, was answered 500."""
    valid = {"input_ids": [5, 6, 7], "sampling_params": {"n": 64, "max_new_tokens": 64, "ignore_eos": True}}
    answers: dict = {}
    runner = threading.Thread(target=lambda: answers.update(valid=post(server, "/generate", valid, timeout=600)))
    runner.start()
    wait_for(lambda: loads(server)["num_running_reqs"] == 64, "the valid request to run")
    assert post(server, "/pause_generation", {"mode": "in_place"}).ok
    try:
        assert loads(server)["num_running_reqs"] == 64, "the valid request finished before the pause"
        bad = [body for body, _ in BAD_GENERATE]
        senders = [
            threading.Thread(target=lambda i=i, b=b: answers.update({i: post(server, "/generate", b, timeout=600)}))
            for i, b in enumerate(bad)
        ]
        for sender in senders:
            sender.start()
        # every bad request is either answered or waiting in the paused queue (where it used to go)
        wait_for(
            lambda: sum(i in answers for i in range(len(bad))) + loads(server)["num_waiting_reqs"] == len(bad),
            "the bad requests to be answered or queued",
        )
    finally:
        assert post(server, "/continue_generation").ok
    for sender in senders:
        sender.join(timeout=600)
    runner.join(timeout=600)
    for i, (_, field) in enumerate(BAD_GENERATE):
        assert answers[i].status_code == 400 and field in message(answers[i]), answers[i].text
    assert answers["valid"].status_code == 200, answers["valid"].text
    outs = answers["valid"].json()
    assert len(outs) == 64 and all(len(o["output_ids"]) == 64 for o in outs)


# ---------------------------------------------------------------------------------------------------- update group
@pytest.mark.parametrize(
    "change, field",
    [
        ({"master_port": 70000}, "master_port"),
        ({"master_port": 0}, "master_port"),
        ({"timeout_s": 1e308}, "timeout_s"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"world_size": 2**70}, "world_size"),
        ({"rank_offset": -1}, "rank_offset"),
    ],
)
def test_update_group_arguments_out_of_range_are_400s_naming_the_field(server, change, field) -> None:
    body = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1, "world_size": 2, **change}
    answer = post(server, "/init_weights_update_group", {**body, "backend": "gloo"})
    assert answer.status_code == 400 and field in message(answer), answer.text


# ---------------------------------------------------------------------------------------------------- weights
def _update_from_tensor(server, named, load_format=None) -> tuple[requests.Response, requests.Response]:
    assert post(server, "/begin_weight_update").status_code == 200
    body = {"serialized_named_tensors": [encode_payload(named, load_format)], "load_format": load_format}
    staged = post(server, "/update_weights_from_tensor", {**body, "weight_version": "poisoned"})
    return staged, post(server, "/end_weight_update")


def _poisoned(value: float) -> torch.Tensor:
    tensor = torch.ones(HF["hidden_size"])
    tensor[3] = value
    return tensor


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_non_finite_weights_are_refused_on_the_tensor_route(server, value, load_format) -> None:
    before, old_version = greedy(server), version(server)
    staged, ended = _update_from_tensor(server, [(NORM, _poisoned(value))], load_format)
    assert staged.status_code == 400 and NORM in message(staged) and "non-finite" in message(staged), staged.text
    assert ended.status_code == 400, ended.text  # nothing committed
    assert greedy(server) == before and version(server) == old_version


def test_non_finite_weights_are_refused_on_the_distributed_route(server) -> None:
    from mcore_rl.parallel.update_group import broadcast, new_update_group

    port = free_port()
    group: dict = {}
    joiner = threading.Thread(
        target=lambda: group.update(g=new_update_group("gloo", "127.0.0.1", port, 0, 2, "nan", timeout_s=60))
    )
    joiner.start()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    assert post(server, "/init_weights_update_group", {**body, "group_name": "nan", "backend": "gloo"}).ok
    joiner.join()
    before, old_version = greedy(server), version(server)
    tensor = _poisoned(float("nan"))
    meta = {"names": [NORM], "dtypes": ["float32"], "shapes": [list(tensor.shape)], "group_name": "nan"}
    assert post(server, "/begin_weight_update").ok
    done: dict = {}
    call = threading.Thread(target=lambda: done.update(r=post(server, "/update_weights_from_distributed", meta)))
    call.start()
    broadcast(group["g"], tensor)
    call.join()
    assert done["r"].status_code == 400 and NORM in message(done["r"]) and "non-finite" in message(done["r"])
    assert post(server, "/end_weight_update").status_code == 400
    assert greedy(server) == before and version(server) == old_version
    assert post(server, "/destroy_weights_update_group", {"group_name": "nan"}).ok


@pytest.mark.parametrize(
    "tensor, expected",
    [
        (_poisoned(float("nan")), "non-finite"),
        (torch.ones(HF["hidden_size"], dtype=torch.int64), "int64"),
        (torch.ones(HF["hidden_size"], dtype=torch.bool), "bool"),
    ],
    ids=["nan", "int64", "bool"],
)
def test_bad_weights_are_refused_on_the_disk_route_and_the_old_ones_kept(server, tmp_path, tensor, expected) -> None:
    save_file({NORM: tensor}, str(tmp_path / "model.safetensors"))
    before, old_version = greedy(server), version(server)
    answer = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "bad"})
    assert answer.status_code == 400 and NORM in message(answer) and expected in message(answer), answer.text
    assert greedy(server) == before and version(server) == old_version


def test_an_integer_tensor_for_a_float_parameter_is_refused_on_the_tensor_route(server) -> None:
    staged, ended = _update_from_tensor(server, [(NORM, torch.ones(HF["hidden_size"], dtype=torch.int64))])
    assert staged.status_code == 400 and "int64" in message(staged) and NORM in message(staged), staged.text
    assert ended.status_code == 400


def test_a_float_tensor_of_another_float_dtype_is_still_accepted(server, tmp_path) -> None:
    """bf16 checkpoints load into a float32 engine (as SGLang loads them into its --dtype): only the kind of the
    dtype must match."""
    named = list(HFRolloutEngine(dict(HF), init_seed=5).state_dict_hf().items())
    save_file({n: t.to(torch.bfloat16).contiguous() for n, t in named}, str(tmp_path / "model.safetensors"))
    answer = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "bf16"})
    assert answer.status_code == 200, answer.text
    assert version(server) == "bf16"


def test_sampling_from_non_finite_logits_raises_naming_the_rows() -> None:
    logits = torch.randn(3, 10)
    logits[1, 4] = float("nan")
    logits[2] = float("-inf")
    args = (torch.tensor([0.0, 1.0, 1.0]), torch.ones(3), torch.full((3,), -1), torch.zeros(3))
    with pytest.raises(ValueError, match=r"non-finite logits in rows \[1, 2\]"):
        sample_rows(logits, *args, [torch.Generator() for _ in range(3)])
    banned = torch.randn(2, 10)
    banned[:, :3] = float("-inf")  # tokens masked to -inf (min_new_tokens) are not an error
    tokens, logprobs = sample_rows(banned, *(a[:2] for a in args), [torch.Generator() for _ in range(2)])
    assert bool((tokens >= 3).all()) and bool(torch.isfinite(logprobs).all())


def test_generation_with_non_finite_weights_fails_and_returns_no_tokens() -> None:
    """Weights that became NaN (the update routes refuse them now; here they are written in place) once gave 200
    with token ids 0 (argmax of NaN logits)."""
    thread = ServerThread(build_server(dict(HF)))
    try:
        with torch.no_grad():
            thread.server.engine.parameter(thread.server.engine.param_key(NORM)).fill_(float("nan"))
        for params in ({"temperature": 0}, {"temperature": 1.0, "top_p": 0.9}):
            body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, **params}}
            answer = post(thread, "/generate", body)
            assert answer.status_code == 500 and "non-finite" in message(answer), answer.text
            assert "output_ids" not in answer.text
    finally:
        thread.stop()


# ---------------------------------------------------------------------------------------------------- disk paths
def test_read_safetensors_dir_has_a_bound_on_time(tmp_path) -> None:
    save_file({NORM: torch.ones(4)}, str(tmp_path / "model.safetensors"))
    assert [n for n, _ in read_safetensors_dir(str(tmp_path))] == [NORM]
    with pytest.raises(WeightUpdateError, match="more than 0 s"):
        read_safetensors_dir(str(tmp_path), timeout_s=0)


@pytest.fixture(scope="module")
def process_server(tmp_path_factory):
    """The server as its own process (`python -m mcore_rl.rollout.server`), its log in a file."""
    work = tmp_path_factory.mktemp("process_server")
    (work / "config.json").write_text(json.dumps(HF))
    port = free_port()
    log = open(work / "server.log", "wb")  # noqa: SIM115 (closed below)
    command = [sys.executable, "-m", "mcore_rl.rollout.server", "--hf-config", str(work / "config.json")]
    proc = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)

    class Handle:
        url = f"http://127.0.0.1:{port}"
        log_path = work / "server.log"

    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (work / "server.log").read_text()
            try:
                if requests.get(Handle.url + "/health", timeout=60).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        Handle.port = port
        yield Handle
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def _release_fifo(path: Path) -> None:
    """Open the FIFO for writing and close it: a reader blocked in open() gets end-of-file (test cleanup)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader is blocked on it: nothing to release
        pass


def test_a_fifo_named_model_safetensors_is_refused_and_health_answers(process_server, tmp_path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    done: dict = {}

    def update() -> None:
        try:
            done["r"] = post(process_server, "/update_weights_from_disk", {"model_path": str(tmp_path)}, timeout=60)
        except requests.RequestException as err:
            done["r"] = err

    sender = threading.Thread(target=update)
    sender.start()
    try:
        # /health answers while the FIFO path is being refused (it used to freeze every route: safetensors opened
        # the FIFO while holding the GIL, and open() waits for a writer)
        assert requests.get(process_server.url + "/health", timeout=60).status_code == 200
        sender.join(timeout=120)
        answer = done["r"]
        assert isinstance(answer, requests.Response), answer
        assert answer.status_code == 400 and NOT_A_MODEL_DIRECTORY in message(answer), answer.text
    finally:
        _release_fifo(fifo)
        sender.join(timeout=120)
    assert requests.get(process_server.url + "/health", timeout=60).status_code == 200


def test_every_path_that_is_not_a_model_directory_is_answered_alike(process_server, tmp_path) -> None:
    """No oracle: a missing path, a file, /dev/zero, a FIFO, a directory without safetensors, or one whose
    safetensors entry is a directory, a FIFO or a device all get the same answer."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "subdir" / "model.safetensors").mkdir(parents=True)
    (tmp_path / "fifo_dir").mkdir()
    os.mkfifo(tmp_path / "fifo_dir" / "model.safetensors")
    (tmp_path / "device_dir").mkdir()
    os.symlink("/dev/zero", tmp_path / "device_dir" / "model.safetensors")
    os.mkfifo(tmp_path / "fifo")
    paths = ["nope", "file", "empty", "subdir", "fifo_dir", "device_dir", "fifo", "/dev/zero"]
    answers = {}
    try:
        for name in paths:
            path = name if name.startswith("/") else str(tmp_path / name)
            answer = post(process_server, "/update_weights_from_disk", {"model_path": path}, timeout=60)
            assert answer.status_code == 400, (name, answer.text)
            answers[name] = message(answer).replace(repr(path), "PATH")
    finally:
        _release_fifo(tmp_path / "fifo_dir" / "model.safetensors")
    assert len(set(answers.values())) == 1, answers
    text = answers["nope"]
    assert NOT_A_MODEL_DIRECTORY in text
    for wrong in ("does not exist", "not found", "No such file", "is not a directory", "holds no"):
        assert wrong not in text


# ---------------------------------------------------------------------------------------------------- disconnects
def _raw_generate(port: int, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps(body).encode()
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    sock.sendall(head.encode() + b"\r\n" + data)
    return sock


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_a_client_that_disconnects_mid_request_leaves_no_traceback(process_server, stream) -> None:
    start = process_server.log_path.stat().st_size
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}, "stream": stream}
    sock = _raw_generate(process_server.port, body)
    if stream:
        assert sock.recv(64).startswith(b"HTTP/1.1 200")  # the stream has begun
    else:
        wait_for(lambda: loads(process_server)["num_running_reqs"] == 1, "the request to run")
    sock.close()

    def log() -> str:
        return process_server.log_path.read_bytes()[start:].decode(errors="replace")

    if stream:  # the server notices at its next write: one quiet line, and the request is aborted
        wait_for(lambda: "client went away" in log() or "Traceback" in log(), "the server to notice")
    wait_for(lambda: loads(process_server)["num_running_reqs"] == 0, "the request to end")
    assert "Traceback" not in log() and "Error handling request" not in log(), log()
    assert log().count("\n") <= 1, log()


# ---------------------------------------------------------------------------------------------------- command line
def _serve(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mcore_rl.rollout.server", *args, "--port", str(free_port())]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_a_config_path_that_is_not_a_regular_file_is_named_exit_2(tmp_path) -> None:
    """--hf-config naming a FIFO used to wait for a writer forever (and /dev/zero to be read into memory without
    end); a directory gave 'Is a directory'. Each is named as what it is, exit 2, before anything is read."""
    fifo, directory, model = tmp_path / "fifo.json", tmp_path / "directory.json", tmp_path / "model"
    os.mkfifo(fifo)
    directory.mkdir()
    model.mkdir()
    os.mkfifo(model / "config.json")
    try:
        for path in (fifo, directory):
            res = _serve("--hf-config", str(path))
            assert res.returncode == 2 and "is not a regular file" in res.stderr, res.stderr[-2000:]
        res = _serve("--model", str(model))
        assert res.returncode == 2 and "config.json there is not a regular file" in res.stderr, res.stderr[-2000:]
    finally:
        _release_fifo(fifo)
