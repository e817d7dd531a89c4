"""A verl command line runs end to end on CPU (slow: starts Ray): GRPO over verl's keys on a tiny Qwen2 checkpoint in
its own directory, 2 Megatron ranks colocated with 2 embedded engines, validation before training, verl's metric
names in metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

AR = "actor_rollout_ref"


def _tiny_checkpoint(path: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mcore_rl.data.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(path)
    config = Qwen2Config(vocab_size=63, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=0,
                         bos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path, safe_serialization=True)


@pytest.mark.slow
def test_a_verl_grpo_command_runs_on_cpu(tmp_path) -> None:
    from mcore_rl.data.synthetic import write_synthetic_dataset

    model, run = str(tmp_path / "model"), str(tmp_path / "run")
    _tiny_checkpoint(model)
    write_synthetic_dataset(str(tmp_path / "train.parquet"), 64, 0, task="copy_digit")
    write_synthetic_dataset(str(tmp_path / "test.parquet"), 16, 1, task="copy_digit", split="test")
    args = [
        f"data.train_files={tmp_path}/train.parquet", f"data.val_files={tmp_path}/test.parquet",
        "data.train_batch_size=8", "data.max_prompt_length=64", "data.max_response_length=2",
        f"{AR}.model.path={model}", f"{AR}.actor.optim.lr=1e-3", f"{AR}.actor.ppo_mini_batch_size=4",
        f"{AR}.actor.ppo_micro_batch_size_per_gpu=8", f"{AR}.rollout.name=hf", f"{AR}.rollout.n=4",
        f"{AR}.rollout.tensor_model_parallel_size=1", "algorithm.adv_estimator=grpo", "trainer.device=cpu",
        "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "trainer.total_training_steps=2", "trainer.logger=console",
        f"trainer.default_local_dir={run}", "trainer.test_freq=2", "model.dtype=float32",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-m", "mcore_rl.train", *args], capture_output=True, text=True, env=env,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "verl: data.train_batch_size=8 -> data.batch_size=8" in out.stdout
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    names = set().union(*rows)
    for name in ("val-core/synthetic/copy_digit/acc/mean@1", "training/global_step", "critic/rewards/mean",
                 "response/aborted_ratio", "rollout_corr/kl"):  # fmt: skip
        assert name in names, name
