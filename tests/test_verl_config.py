"""verl's key tree on `python -m mcore_rl.train`: each verl key is mapped, explained or refused (compat/verl/keys.py),
verl's defaults apply under a verl command and the tiny CPU job's settings do not, values come in verl's forms, every
problem of a command is reported at once (exit 2), and the config layer imports nothing above it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mcore_rl.compat.verl.cli import compose, translate
from mcore_rl.config import to_config

AR = "actor_rollout_ref"


def _run(args: list[str]):
    t = translate(args)
    assert t.errors == [], t.errors
    cfg = to_config(compose(t))
    assert t.errors == [], t.errors
    return cfg, t


def _verl(model_dir: str, *extra: str) -> list[str]:
    return [f"{AR}.model.path={model_dir}", "trainer.total_training_steps=3", "trainer.n_gpus_per_node=2",
            f"{AR}.rollout.tensor_model_parallel_size=1", "data.train_batch_size=8",
            f"{AR}.actor.ppo_mini_batch_size=4", f"{AR}.rollout.name=sglang", *extra]  # fmt: skip


def test_verl_defaults_apply_and_the_tiny_job_does_not_leak(model_dir: str) -> None:
    cfg, _ = _run(_verl(model_dir))
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable  # gae brings its critic, as in verl
    assert cfg.actor.clip_ratio_high == 0.2 and cfg.actor.clip_ratio_low == 0.2
    assert cfg.actor.optim.weight_decay == 0.01 and cfg.actor.optim.lr == 1e-6
    assert cfg.critic.optim.lr == 1e-5 and cfg.critic.optim.weight_decay == 0.01
    assert cfg.rollout.n == 1 and cfg.trainer.val_before_train is True and cfg.rollout.max_new_tokens == 512
    assert cfg.actor.layout.ep == 1 and cfg.model.hf_config == {}  # a dense model needs no actor.layout.ep=1
    assert cfg.actor.micro_batch_size != 32 and cfg.rollout.request_grouping == "prompt"
    assert cfg.actor.mini_batches == 2 and cfg.actor.world_size == 2 and cfg.rollout.num_engines == 2
    assert cfg.trainer.steps == 3 and cfg.trainer.runtime == "cuda" and cfg.model.dtype == "bfloat16"
    assert cfg.model.max_sequence_length == 512 + 512  # verl's prompt + response lengths


def test_grpo_has_no_critic_and_kl_loss_follows_use_kl_loss(model_dir: str) -> None:
    cfg, _ = _run(_verl(model_dir, "algorithm.adv_estimator=grpo", f"{AR}.actor.kl_loss_coef=0.01"))
    assert not cfg.critic.enable and cfg.actor.kl_loss_coef == 0.0  # use_kl_loss defaults to False in verl
    cfg, _ = _run(_verl(model_dir, "algorithm.adv_estimator=grpo", f"{AR}.actor.use_kl_loss=True"))
    assert cfg.actor.kl_loss_coef == 0.001 and cfg.actor.use_ref


def test_values_in_verls_forms(model_dir: str, tmp_path) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from _verl_scripts import write_parquet

    train = str(tmp_path / "train.parquet")
    write_parquet(train, "openai/gsm8k", rows=20)
    args = _verl(model_dir, f"data.train_files={train}", "trainer.logger=console", "data.truncation=left",
                 "data.prompt_key=question", f"{AR}.rollout.val_kwargs.do_sample=True",
                 f"{AR}.rollout.val_kwargs.n=4", f"{AR}.rollout.val_kwargs.temperature=0.6",
                 f"{AR}.rollout.val_kwargs.top_p=0.9", "algorithm.adv_estimator=grpo",
                 f"data.val_files={train}")  # fmt: skip
    args.remove("trainer.total_training_steps=3")
    args.append("trainer.total_epochs=2")
    cfg, _ = _run(args)
    assert cfg.data.train_files == [train] and cfg.trainer.loggers == ["console", "jsonl"]
    assert cfg.data.overlong == "left" and cfg.data.prompt_key == "question"
    assert cfg.rollout.val_n == 4 and cfg.rollout.val_temperature == 0.6 and cfg.rollout.val_top_p == 0.9
    assert cfg.trainer.steps == 2 * (20 // 8)  # epochs x rows // batch, verl's drop_last
    cfg, _ = _run(_verl(model_dir, "data.filter_overlong_prompts=True", "trainer.logger=['console','jsonl']"))
    assert cfg.data.overlong == "drop" and cfg.trainer.loggers == ["console", "jsonl"]
    assert cfg.rollout.val_n == 0 and cfg.rollout.val_temperature is None  # verl's greedy validation


def test_gradient_checkpointing_is_the_recompute_setting(model_dir: str) -> None:
    cfg, _ = _run(_verl(model_dir, f"{AR}.model.enable_gradient_checkpointing=True"))  # FSDP script
    assert (cfg.actor.recompute.granularity, cfg.actor.recompute.method, cfg.actor.recompute.num_layers) == (
        "full", "uniform", 1,
    )  # fmt: skip
    megatron = f"+{AR}.actor.megatron.override_transformer_config"
    cfg, _ = _run(_verl(model_dir, "--config-name=ppo_megatron_trainer", f"{megatron}.recompute_granularity=selective"))
    assert cfg.actor.recompute.granularity == "selective"
    cfg, _ = _run(_verl(model_dir, "--config-name=ppo_megatron_trainer"))
    assert cfg.actor.recompute.granularity is None  # verl's Megatron workers do not read enable_gradient_checkpointing


def test_a_hub_id_is_found_in_the_local_cache(model_dir: str, tmp_path, monkeypatch) -> None:
    snapshot = tmp_path / "hf" / "hub" / "models--Org--Tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(open(os.path.join(model_dir, "config.json")).read())
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    cfg, _ = _run(_verl("Org/Tiny"))
    assert cfg.model.path == str(snapshot) and cfg.model.tokenizer == str(snapshot)
    t = translate(_verl("Org/Missing"))
    assert any("Org/Missing" in e and str(tmp_path / "hf" / "hub" / "models--Org--Missing") in e for e in t.errors)


def test_every_problem_of_a_command_is_reported_at_once(model_dir: str) -> None:
    t = translate(_verl(model_dir, f"{AR}.model.lora_rank=8", "data.truncation=middle", "data.train_batch_sze=8",
                        f"{AR}.actor.ppo_mini_batch_size=3", f"{AR}.ref.megatron.tensor_model_parallel_size=2",
                        f"{AR}.actor.policy_loss.loss_mode=clip_cov"))  # fmt: skip
    errors = "\n".join(t.errors)
    assert len(t.errors) == 6, errors
    assert "lora_rank=8" in errors and "LoRA" in errors
    assert "data.truncation='middle' (our data.overlong)" in errors and "('error', 'left', 'right')" in errors
    assert "did you mean data.train_batch_size? (verl's data.train_batch_size is data.batch_size here)" in errors
    assert "ppo_mini_batch_size=3 (our actor.mini_batches" in errors
    assert "ref.megatron.tensor_model_parallel_size=2" in errors and "actor.layout.tp=1" in errors
    assert "loss_mode='clip_cov' (our actor.policy_loss)" in errors


def test_ignored_keys_say_why(model_dir: str) -> None:
    _, t = _run(_verl(model_dir, f"{AR}.actor.fsdp_config.param_offload=True", f"{AR}.model.use_remove_padding=True",
                      f"+{AR}.actor.megatron.override_transformer_config.apply_rope_fusion=True"))  # fmt: skip
    lines = "\n".join(t.lines)
    assert "fsdp_config.param_offload=True: ignored: FSDP setting" in lines
    assert "use_remove_padding=True: ignored:" in lines and "apply_rope_fusion=True: ignored: always on" in lines


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "mcore_rl.train", *args], capture_output=True, text=True, env=env)


def test_the_cli_exits_2_with_every_problem(model_dir: str) -> None:
    out = _cli(*_verl(model_dir, f"{AR}.model.lora_rank=8", "data.truncation=middle", "trainer.total_epochs_=2"))
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 3, out.stderr
    assert "Traceback" not in out.stderr


def test_our_own_commands_report_every_unknown_key_at_once() -> None:
    out = _cli("trainer.stepz=3", "data.train_batch_size=8", "rollout.nn=2", "--print-config")
    # data.train_batch_size is verl's key: the command is translated as verl's, so our unknown keys are reported
    assert out.returncode == 2 and out.stderr.count("config error: unknown key") == 2, out.stderr
    out = _cli("trainer.stepz=3", "rollout.nn=2")
    assert out.returncode == 2 and out.stderr.count("config error: unknown key") == 2, out.stderr
    assert "did you mean trainer.steps?" in out.stderr


def test_the_default_job_still_composes_from_its_yaml() -> None:
    out = _cli("--print-config", "trainer.steps=3")
    assert out.returncode == 0, out.stderr
    assert "steps: 3" in out.stdout and "ep: 2" in out.stdout  # configs/default.yaml, not verl's defaults


def test_the_config_layer_imports_nothing_above_it() -> None:
    """validate() of a run that saves and resumes, and the verl table, load no controller, checkpoint, metrics or
    pre-flight module (they checked the file system and Ray from inside the config layer, in a circle)."""
    code = (
        "import sys\n"
        "from mcore_rl.config import RLConfig\n"
        "import mcore_rl.compat.verl.keys, mcore_rl.compat.verl.cli, mcore_rl.compat.verl.derive\n"
        "cfg = RLConfig(); cfg.model.hf_config = {'model_type': 'qwen2', 'hidden_size': 64, 'intermediate_size': 128,"
        " 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'vocab_size': 64}\n"
        "cfg.trainer.save_every = 1; cfg.trainer.resume = 'auto'; cfg.trainer.loggers = ['console', 'wandb']\n"
        "cfg.validate()\n"
        "above = ('mcore_rl.controller', 'mcore_rl.checkpoint', 'mcore_rl.metrics', 'mcore_rl.preflight')\n"
        "print(sorted(m for m in sys.modules if m.startswith(above)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert eval(out.stdout.strip()) == []


def test_a_checker_gets_the_config_of_a_verl_command_or_none(model_dir: str) -> None:
    from mcore_rl.compat.verl.cli import config_of_verl_command
    from mcore_rl.config import ConfigError

    assert config_of_verl_command(["trainer.steps=3"]) is None  # ours: Hydra composes it over configs/
    assert config_of_verl_command(_verl(model_dir)).critic.enable
    with pytest.raises(ConfigError, match="(?s)lora_rank=8.*truncation='middle'"):
        config_of_verl_command(_verl(model_dir, f"{AR}.model.lora_rank=8", "data.truncation=middle"))


def test_the_key_table_in_the_docs_is_the_code_s() -> None:
    from mcore_rl.compat.verl.keys import markdown_table

    path = os.path.join(os.path.dirname(__file__), "..", "docs", "verl_keys.md")
    with open(path) as f:
        assert f.read() == markdown_table(), "regenerate: python -m mcore_rl.compat.verl.keys > docs/verl_keys.md"


def test_engine_knobs_go_to_the_chosen_engine(model_dir: str) -> None:
    knobs = [f"{AR}.rollout.gpu_memory_utilization=0.6", f"{AR}.rollout.enforce_eager=True",
             f"{AR}.rollout.max_model_len=2048"]  # fmt: skip
    args = [a for a in _verl(model_dir, *knobs) if not a.startswith(f"{AR}.rollout.name")]
    cfg, _ = _run([*args, f"{AR}.rollout.name=sglang"])
    assert cfg.rollout.sglang.mem_fraction_static == 0.6 and cfg.rollout.sglang.tp == 1
    from mcore_rl.config import ConfigError, RolloutConfig

    try:
        RolloutConfig(engine="vllm").validate()
    except ConfigError:
        pytest.skip("this build's rollout.engine does not accept vllm")
    cfg, _ = _run([*args, f"{AR}.rollout.name=vllm"])
    assert cfg.rollout.engine == "vllm" and cfg.rollout.vllm.gpu_memory_utilization == 0.6
    assert cfg.rollout.vllm.extra_args == ["--enforce-eager"] and cfg.rollout.vllm.max_model_len == 2048


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_truncation_cuts_the_templated_prompt_as_verl_does(tmp_path, truncation: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mcore_rl.data.dataset import PromptDataset
    from mcore_rl.data.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(None)
    path = str(tmp_path / "long.parquet")
    rows = [{"role": "user", "content": "repeat: " + "7" * 40}]
    pq.write_table(pa.table({"data_source": ["s"], "prompt": [rows], "reward_model": [{"ground_truth": "7"}]}), path)
    full = PromptDataset([path], tokenizer, 1000)[0]["prompt_token_ids"]
    cut = PromptDataset([path], tokenizer, 16, overlong=truncation)[0]["prompt_token_ids"]
    assert cut == (full[-16:] if truncation == "left" else full[:16])  # left keeps the end: the generation prompt


def test_our_config_names_do_not_mix_with_verl_keys(model_dir: str) -> None:
    t = translate(["--config-name", "dpo", *_verl(model_dir)])
    assert len(t.errors) == 1 and "--config-name 'dpo' with verl's keys" in t.errors[0]
    assert translate(["--config-name", "ppo_megatron_trainer", "--config-path=config", *_verl(model_dir)]).errors == []


def test_a_command_naming_its_model_gets_no_tiny_job_settings(model_dir: str) -> None:
    """`model.path=<a dense model>` was refused: configs/default.yaml's tiny MoE job asked for actor.layout.ep=2."""
    out = _cli("--print-config", f"model.path={model_dir}")
    assert out.returncode == 0, out.stderr
    assert "\n    ep: 1\n" in out.stdout and "micro_batch_size: 16" in out.stdout and "hf_config: {}" in out.stdout
