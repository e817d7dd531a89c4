"""The weight sync's checks before anything moves (controller/weight_sync.py), on the answers real SGLang 0.5.23
gives: /model_info as its http_server.py builds it, and the broadcast groups an engine GPU joins.

Run: `.venv/bin/pytest tests/test_weight_sync_checks.py`
"""

from __future__ import annotations

import pytest

from mcore_rl.config import SyncConfig
from mcore_rl.controller.weight_sync import SyncError, check_model_info, update_groups_per_engine_gpu

QWEN3_MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2}


def sglang_model_info(model_type: str, architectures: list[str]) -> dict:
    """SGLang 0.5.23's GET /model_info (entrypoints/http_server.py `model_info`): no layer count, no vocabulary."""
    return {
        "model_path": "/run/rollout/engine_model", "served_model_name": "/run/rollout/engine_model",
        "tokenizer_path": None, "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
        "load_format": "dummy", "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
        "has_image_understanding": False, "has_audio_understanding": False, "model_type": model_type,
        "architectures": architectures,
    }  # fmt: skip


def test_sglang_engine_of_the_actor_model_passes() -> None:
    check_model_info("http://e", sglang_model_info("qwen3_moe", ["Qwen3MoeForCausalLM"]), QWEN3_MOE)


def test_sglang_engine_of_another_architecture_is_refused() -> None:
    """SGLang says only model_type and architectures: both are compared."""
    info = sglang_model_info("qwen3_moe", ["Qwen3MoeForSequenceClassification"])
    with pytest.raises(SyncError, match="its architectures is \\['Qwen3MoeForSequenceClassification'\\]"):
        check_model_info("http://e", info, QWEN3_MOE)
    with pytest.raises(SyncError, match="its model_type is 'deepseek_v3'"):
        check_model_info("http://e", sglang_model_info("deepseek_v3", ["DeepseekV3ForCausalLM"]), QWEN3_MOE)


def test_an_answer_without_model_type_is_refused() -> None:
    with pytest.raises(SyncError, match="without a model_type"):
        check_model_info("http://e", {"model_path": "/m"}, QWEN3_MOE)


def test_groups_per_engine_gpu_are_bounded_and_stated() -> None:
    assert update_groups_per_engine_gpu(SyncConfig(), 9) == 9  # pp1 x (dense + ep8) streams
    assert update_groups_per_engine_gpu(SyncConfig(transport="tensor"), 66) == 0  # no groups: CUDA IPC
    with pytest.raises(SyncError, match="join 66 broadcast groups .* sync.max_update_groups=64"):
        update_groups_per_engine_gpu(SyncConfig(), 66)
    assert update_groups_per_engine_gpu(SyncConfig(max_update_groups=66), 66) == 66


def test_rendezvous_port_is_held_until_the_store_serves_it() -> None:
    """A port found free was taken by an engine's HTTP server before the leader's TCP store bound it
    (EADDRINUSE). The leader now binds the port when it gives it out and hands that socket to the store."""
    import datetime
    import socket
    from types import SimpleNamespace

    import torch.distributed as dist

    from mcore_rl.actor.sync_sender import SyncSender
    from mcore_rl.resharding.sync.plan import Stream

    sender = SyncSender(SimpleNamespace(rendezvous_address=lambda: ("127.0.0.1", 0), rank=0))
    sender.plan_ = SimpleNamespace(streams=[Stream(0, 0, None, 0, (0,), "pp0")])  # type: ignore[assignment]
    ((host, port),) = sender.addresses().values()
    with socket.socket() as other, pytest.raises(OSError):  # e.g. an engine's HTTP server asking for a port
        other.bind((host, port))
    sender.join("pp0", host, port, 1, "gloo", 10)
    client = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert sender.groups["pp0"].store.get("k") == b"v", "the group's store serves on the handed-over socket"
