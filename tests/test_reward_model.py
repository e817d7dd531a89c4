"""The reward-model worker: a real HF sequence-classification checkpoint scored by a Ray actor, mixed with the rule
reward by weight, refused when its vocabulary cannot read the policy's tokens, and (slow) the RL loop running with it.

Run: `.venv/bin/pytest tests/test_reward_model.py`
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
from _ray_cluster import ray_address_override, train_env

from mcore_rl.data.tokenizer import build_tiny_tokenizer
from mcore_rl.reward.loader import RewardFunctionError, default_compute_score
from mcore_rl.reward.manager import RewardManager
from mcore_rl.reward.reward_model import RewardModelScorer, RewardModelWorker, WeightedReward

RESPONSES = ["7", "12", "no", "3<|im_end|>"]


def _write_rm(path: Path, vocab_size: int = 63, with_tokenizer: bool = True) -> Path:
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_labels=1, pad_token_id=0, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForSequenceClassification(config).float().save_pretrained(path)
    if with_tokenizer:
        build_tiny_tokenizer(str(path))
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    return _write_rm(tmp_path_factory.mktemp("rm") / "rm")


def _direct_scores(path: Path, texts: list[str]) -> list[float]:
    """The same model run in this process, one text at a time (no padding): what the worker must reproduce."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0]) for t in texts]


@pytest.mark.long
def test_worker_scores_a_batch_and_mixes_with_the_rule_reward(rm_dir: Path):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    scorer = RewardModelScorer(str(rm_dir), None, num_cpus=1)
    try:
        expected = _direct_scores(rm_dir, RESPONSES)
        n = len(RESPONSES)
        got = scorer.score_batch(["synthetic/copy_digit"] * n, RESPONSES, ["7"] * n, [None] * n)
        assert got == pytest.approx(expected, abs=1e-5)  # right-padded batch == one at a time
        assert len(set(round(g, 6) for g in got)) > 1  # a real model: different texts, different scores

        mixed = RewardManager(WeightedReward(default_compute_score, 1.0, scorer, 0.5)).score(
            RESPONSES, ["synthetic/copy_digit"] * n, ["7"] * n
        )
        rule = [default_compute_score("synthetic/copy_digit", r, "7") for r in RESPONSES]
        want = [float(r["score"] if isinstance(r, dict) else r) + 0.5 * m for r, m in zip(rule, expected)]
        torch.testing.assert_close(mixed.scores, torch.tensor(want), atol=1e-5, rtol=0)
        assert mixed.extras["model_score"] == pytest.approx(expected, abs=1e-5)
    finally:
        scorer.close()
        ray.shutdown()


def test_reward_model_that_cannot_read_the_policy_vocabulary_is_refused(tmp_path: Path):
    rm = _write_rm(tmp_path / "small_vocab", vocab_size=16, with_tokenizer=False)
    policy = tmp_path / "policy_tok"
    build_tiny_tokenizer(str(policy))
    with pytest.raises(RewardFunctionError, match=r"vocab_size=16, smaller than the policy tokenizer's 63 tokens"):
        RewardModelWorker(str(rm), str(policy))


def test_config_refuses_a_missing_reward_model_dir(tmp_path: Path):
    cmd = [sys.executable, "-m", "mcore_rl.train", f"reward.model_path={tmp_path / 'none'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "reward.model_path=" in out.stderr and "config.json" in out.stderr, out.stderr


@pytest.mark.long
@pytest.mark.slow
def test_rl_loop_runs_with_the_reward_model(rm_dir: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "mcore_rl.train", f"reward.model_path={rm_dir}", "reward.model_weight=0.5",
        "trainer.steps=2", f"trainer.run_dir={run_dir}", "data.batch_size=4", "rollout.n=4", ray_address_override(),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=train_env())
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
