"""The RL algorithms through the real loop (Ray, Megatron ranks, an engine behind sglang-router), a few steps
each: PPO with a critic group, ReMax's greedy baselines with the entropy bonus, adaptive KL in the reward and
rollout correction, DAPO's dynamic sampling with overlong shaping (with RLOO over two engines), REINFORCE++ with a
baseline under GSPO's sequence-level loss and a KL loss (so the reference pass runs); and DAPO's refusal when no batch
can be filled. The cases share runs: each run costs a Ray start, two Megatron ranks and the engines, the steps little.

Run: `.venv/bin/pytest tests/test_algorithms_e2e.py` (the learning figures: tools/bench_algorithms.py)
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from _ray_cluster import ray_address_override, train_env
from tiny_models import tiny_qwen3_moe

from mcore_rl.config import ModelConfig, RLConfig
from mcore_rl.controller.filters import AlgorithmProducer
from mcore_rl.data.tokenizer import build_tiny_tokenizer

TRAIN = [sys.executable, "-m", "mcore_rl.train", "data.batch_size=4", "rollout.n=4"]


def _train(run_dir: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = subprocess.run(
        [*TRAIN, f"trainer.run_dir={run_dir}", ray_address_override(), *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        env=train_env(),
    )
    path = run_dir / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return out, lines


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, expected_keys",
    [
        (
            ["algorithm.adv_estimator=gae", "critic.enable=true", "critic.warmup_steps=1", "trainer.steps=3"],
            ["critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/grad_norm"],
        ),
        (
            [
                "algorithm.adv_estimator=remax",
                "actor.entropy_coef=0.01",
                "algorithm.use_kl_in_reward=true",
                "algorithm.kl_ctrl.type=adaptive",
                "algorithm.rollout_correction.rollout_is=token",
                "algorithm.rollout_correction.rollout_rs=geometric",
                "algorithm.rollout_correction.rollout_rs_threshold=1.001",
                "trainer.steps=2",
            ],
            [
                "timing_s/gen_max",
                "actor/reward_kl_penalty_coeff",
                "rollout_corr/is_truncated_frac",
                "rollout_corr/rs_masked_frac",
            ],
        ),
        (
            [
                "algorithm.adv_estimator=rloo",
                "rollout.num_engines=2",
                "algorithm.filter_groups.enable=true",
                "algorithm.filter_groups.max_num_gen_batches=3",
                "algorithm.filter_groups.on_unfilled=shrink",
                "rollout.max_new_tokens=3",
                "reward.overlong_buffer.enable=true",
                "reward.overlong_buffer.len=1",
                "trainer.steps=2",
            ],
            ["filter/gen_rounds", "filter/kept_groups", "critic/score/unfiltered_mean"],
        ),
        (
            [
                "algorithm.adv_estimator=reinforce_plus_plus_baseline",
                "actor.policy_loss=gspo",
                "actor.clip_ratio_low=3e-4",
                "actor.clip_ratio_high=4e-4",
                "actor.loss_agg_mode=seq-mean-token-mean",
                "actor.kl_loss_coef=0.01",  # a KL term: the reference model is built and its pass runs
                "trainer.steps=2",
            ],
            ["actor/kl_ref", "actor/kl_loss"],
        ),
    ],
    ids=["gae", "remax_kl_entropy_correction", "dapo_rloo_two_engines", "reinforce_pp_baseline_gspo_kl"],
)
def test_algorithm_runs_through_the_loop(tmp_path: Path, overrides: list[str], expected_keys: list[str]):
    out, lines = _train(tmp_path / "run", *overrides)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = int(next(o for o in overrides if o.startswith("trainer.steps=")).split("=")[1])
    assert [r["step"] for r in lines] == list(range(1, steps + 1))
    for key in expected_keys:
        assert key in lines[-1], key
    trained = [r for r in lines if "actor/pg_loss" in r]
    assert trained and all(abs(r["actor/pg_loss"]) < 1e3 and r["actor/grad_norm"] >= 0 for r in trained)
    if "critic.warmup_steps=1" in overrides:  # step 1 trains only the critic: the engines keep version 1
        assert [r["weight_version"] for r in lines] == [1, 2, 3]
        assert "actor/pg_loss" not in lines[0] and "actor/pg_loss" in lines[1]
    if "reward.overlong_buffer.enable=true" in overrides:
        # 3-token answers pay the full penalty (-1): the random policy rarely stops after the digit
        assert all(r["critic/score/unfiltered_mean"] < 0 for r in lines)
        assert all(0 < r["filter/kept_groups"] <= 4 for r in lines)


@pytest.mark.long
@pytest.mark.slow
def test_dynamic_sampling_that_cannot_fill_a_batch_is_refused(tmp_path: Path):
    reward = tmp_path / "constant.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    out, _ = _train(
        tmp_path / "run",
        "trainer.steps=1",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=2",
        "algorithm.filter_groups.on_unfilled=error",
        f"reward.path={reward}",
    )
    assert out.returncode == 2  # a user error (mcore_rl/lifecycle.py)
    assert "algorithm.filter_groups: 0 of data.batch_size=4 groups had non-zero reward variance after " in out.stderr
    assert "max_num_gen_batches=2 rounds of 4 prompts" in out.stderr
    assert "expected a full batch: raise algorithm.filter_groups.max_num_gen_batches, or set" in out.stderr


def test_shrink_keeps_a_batch_the_update_can_split(tmp_path: Path, caplog):
    cfg = RLConfig(model=ModelConfig(hf_config=tiny_qwen3_moe()))
    # 4 mini-batches x dp 2 (2 ranks, no model parallelism) = 8 samples: groups of 2 in multiples of 4
    cfg.rollout.n, cfg.data.batch_size, cfg.actor.mini_batches = 2, 8, 4
    cfg.algorithm.filter_groups.on_unfilled = "shrink"
    producer = AlgorithmProducer(cfg, None, None, None, build_tiny_tokenizer(str(tmp_path)))
    with caplog.at_level(logging.WARNING):
        assert producer._unfilled(kept=5, want=8, rounds=3) == 4
    assert "training on 4 groups (on_unfilled=shrink)" in caplog.text
    with pytest.raises(ValueError, match="on_unfilled=shrink needs at least 4 groups"):
        producer._unfilled(kept=3, want=8, rounds=3)
    cfg.algorithm.filter_groups.on_unfilled = "error"
    with pytest.raises(ValueError, match="5 of data.batch_size=8 groups"):
        producer._unfilled(kept=5, want=8, rounds=3)
