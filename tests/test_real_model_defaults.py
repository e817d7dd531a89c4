"""A command of our keys that names a real checkpoint (`model.path=...`, no recipe) gets defaults for a pretrained
model, and the CPU demo jobs keep their toy values, stated in their own YAML.

The schema's lr, response and prompt lengths were the tiny random-init demo's (lr 1e-3, 8 new tokens, 64 prompt
tokens): a pretrained model named by model.path alone was trained at a learning rate that wrecks it in a step, and
its answers cut after 8 tokens. They are verl's now (actor lr 1e-6, critic lr 1e-5, 512 + 512 tokens); the demo
configs (configs/default.yaml, dpo.yaml on top of it, multiturn_tool.yaml) set the values they ran with.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_rl.compat.verl.cli import compose_command
from mcore_rl.compat.verl.keys import VERL_DEFAULTS
from mcore_rl.config import RLConfig

#: a small dense Qwen2 config.json, shaped as a pretrained checkpoint's
QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
         "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": True}  # fmt: skip

#: (actor lr, critic lr, rollout.max_new_tokens, data.max_prompt_length) each demo job ran with before the change
DEMO = {
    "default": (2e-3, 1e-2, 2, 64),
    "dpo": (2e-3, 1e-2, 2, 64),
    "multiturn_tool": (2e-3, 1e-2, 6, 64),
}


def _figures(cfg: RLConfig) -> tuple[float, float, int, int]:
    return cfg.actor.optim.lr, cfg.critic.optim.lr, cfg.rollout.max_new_tokens, cfg.data.max_prompt_length


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    return str(tmp_path)


def test_a_command_naming_only_its_model_gets_a_pretrained_models_defaults(checkpoint_dir: str) -> None:
    cfg = compose_command([f"model.path={checkpoint_dir}"])
    lr, critic_lr, new_tokens, prompt_tokens = _figures(cfg)
    assert (lr, critic_lr) == (1e-6, 1e-5), "verl's actor and critic learning rates"
    assert (new_tokens, prompt_tokens) == (512, 512), "verl's response and prompt lengths"
    assert cfg.model.max_sequence_length == 1024
    assert all(_figures(cfg)[i] != DEMO["default"][i] for i in range(4)), "none of the demo's values"


def test_the_schema_defaults_are_verls_for_these_keys() -> None:
    """A command of ours and a verl command that name the same model start from the same lr and lengths."""
    cfg = RLConfig()
    for key, value in [
        ("actor.optim.lr", cfg.actor.optim.lr),
        ("critic.optim.lr", cfg.critic.optim.lr),
        ("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
        ("data.max_prompt_length", cfg.data.max_prompt_length),
    ]:
        assert value == VERL_DEFAULTS[key][0], key


@pytest.mark.parametrize("recipe", sorted(DEMO))
def test_the_demo_jobs_keep_their_toy_values(recipe: str) -> None:
    args = [] if recipe == "default" else ["--config-name", recipe]
    cfg = compose_command(args)
    assert _figures(cfg) == DEMO[recipe]
    assert cfg.model.path is None and cfg.model.hf_config["hidden_size"] == 64, "the tiny random-init model"
