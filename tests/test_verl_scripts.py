"""verl's own launch scripts (tests/fixtures/verl_scripts/, one override per line as the shell passes them) pass our
config check with only the program name changed: every override is mapped or explained, none is unknown, and the
translated config validates (RLConfig.validate: layouts against the model's shape, batches against the GPUs).

rollout.name=vllm maps to rollout.engine=vllm where this build's rollout config accepts vllm; where it does not, the
test expects that one refusal per script (naming both keys) and checks the rest with rollout.name=sglang."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _verl_scripts import SCRIPTS, make_world, script_args  # noqa: E402

VLLM_REFUSAL = "actor_rollout_ref.rollout.name='vllm'"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    home = str(tmp_path_factory.mktemp("home"))
    env = make_world(home)
    old = {k: os.environ.get(k) for k in (*env, "HF_HUB_CACHE")}
    os.environ.update(env)
    os.environ.pop("HF_HUB_CACHE", None)
    yield home
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _vllm_accepted() -> bool:
    from mcore_rl.config import ConfigError, RolloutConfig

    try:
        RolloutConfig(engine="vllm").validate()
        return True
    except ConfigError:
        return False


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_verl_script_passes_the_config_check(world: str, script: str) -> None:
    from mcore_rl.compat.verl.cli import compose, translate
    from mcore_rl.config import to_config

    args = script_args(script, world)
    t = translate(args)
    assert t.verl
    errors = t.errors
    if not _vllm_accepted():  # the one refusal, naming the verl key and our key; sglang runs the same script
        assert len(errors) == 1 and VLLM_REFUSAL in errors[0] and "rollout.engine" in errors[0], errors
        t = translate([a.replace("rollout.name=vllm", "rollout.name=sglang") for a in args])
    assert t.errors == []
    cfg = to_config(compose(t))
    assert t.errors == []
    assert cfg.trainer.runtime == "cuda" and cfg.model.path and cfg.model.tokenizer == cfg.model.path
    assert cfg.model.hf_config == {}  # nothing of the tiny CPU job
    assert cfg.critic.enable == (cfg.algorithm.adv_estimator == "gae")


def test_the_cli_prints_the_translation_and_the_config_in_our_keys(world: str) -> None:
    args = [a.replace("rollout.name=vllm", "rollout.name=sglang") for a in script_args("ppo_quickstart", world)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", "--print-config", *args], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "verl: data.train_batch_size=256 -> data.batch_size=256" in out.stdout
    assert "verl: critic.ppo_micro_batch_size_per_gpu=4 -> critic.micro_batch_size=4" in out.stdout
    assert "adv_estimator: gae" in out.stdout and "enable: true" in out.stdout  # gae brings its critic
    assert "batch_size: 256" in out.stdout


def test_the_moe_script_keeps_its_deepep_dispatcher(world: str) -> None:
    """verl's Qwen3-30B script asks for DeepEP (flex dispatcher) and fused permutes: they are settings here, which
    pre-flight checks against the machine (TE, CUDA, deep_ep), not knobs silently dropped."""
    from mcore_rl.compat.verl.cli import compose, translate
    from mcore_rl.config import to_config

    t = translate(script_args("grpo_qwen3moe_30b_megatron", world))
    if t.errors:  # rollout.engine without vllm here
        t = translate([a.replace("rollout.name=vllm", "rollout.name=sglang") for a in script_args(
            "grpo_qwen3moe_30b_megatron", world)])  # fmt: skip
    cfg = to_config(compose(t))
    assert cfg.actor.moe_dispatcher == "flex" and cfg.actor.moe_permute_fusion is True
    assert cfg.actor.layout.ep == 8 and cfg.actor.optim.offload_fraction == 1.0
