"""rollout.latency_model_s_per_token: the embedded engine as a model of a GPU engine (rollout/engine.py `forward`).

Each forward (a prefill, or one decode step of the whole running batch) sleeps instead of running the model, so
generation costs wall time but next to no CPU; tokens are uniform draws of each sequence's seeded generator, with
logprob -log V. The config accepts the key only with an engine kind that models latency, and only > 0.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import Qwen3Config

from mcore_rl.config import RolloutConfig
from mcore_rl.config.checks import ConfigError
from mcore_rl.rollout.engine import HFRolloutEngine
from mcore_rl.rollout.scheduler import ContinuousBatcher, GenParams, Sequence

REPO = Path(__file__).resolve().parents[1]
VOCAB = 64


def tiny_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip


def latency_engine(s_per_token: float) -> HFRolloutEngine:
    return HFRolloutEngine(tiny_config(), latency_model_s_per_token=s_per_token)


def test_generation_costs_wall_time_per_step_but_little_cpu() -> None:
    """N tokens take at least N steps of sleep (prefill samples the first token, each decode step one more), while
    the process's CPU time stays well under the wall time: the decode steps are asleep, not computing."""
    s_per_token, tokens = 0.05, 20
    engine = latency_engine(s_per_token)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    samples = engine.generate([[1, 2, 3], [4, 5]], n=2, max_new_tokens=tokens, seed=7)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    assert all(len(s.response_ids) == tokens for s in samples)
    # one batched step for all four sequences: the time is that of one sequence, not four
    assert wall >= 0.95 * tokens * s_per_token, wall
    assert cpu < 0.5 * wall, (cpu, wall)


def test_same_seed_same_tokens_and_every_logprob_is_minus_log_vocab() -> None:
    engine = latency_engine(0.001)
    first = engine.generate([[1, 2, 3]], n=3, max_new_tokens=12, seed=11)
    again = engine.generate([[1, 2, 3]], n=3, max_new_tokens=12, seed=11)
    other = engine.generate([[1, 2, 3]], n=3, max_new_tokens=12, seed=12)
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    assert [s.response_ids for s in first] != [s.response_ids for s in other]
    assert len({t for s in first for t in s.response_ids}) > 5  # uniform draws, not one repeated token
    for sample in first:
        assert all(lp == pytest.approx(-math.log(VOCAB), abs=1e-5) for lp in sample.response_logprobs)


def test_stop_tokens_and_weight_versions_behave_as_with_the_model() -> None:
    """A stop token ends a sequence with finish reason stop; a weight update committed between two decode steps
    splits its version spans, as in normal mode; the update loads the tensors for real."""
    engine = latency_engine(0.001)
    stopped = engine.generate([[1, 2]], n=8, max_new_tokens=40, eos_token_ids=range(0, 16), seed=3)
    assert any(s.finish_reason == "stop" and s.response_ids[-1] < 16 for s in stopped)
    assert all(s.finish_reason == "length" or s.response_ids[-1] < 16 for s in stopped)

    batcher = ContinuousBatcher(engine, max_running=4)
    seq = Sequence("a", [1, 2, 3], GenParams(max_new_tokens=6, seed=1))
    batcher.submit([seq])
    for _ in range(3):  # the first step prefills (token 1) and decodes (token 2); each later step decodes one
        batcher.step()
    weight = engine.model.model.embed_tokens.weight
    new = weight.detach().clone().fill_(0.25)
    engine.update_weights_from_tensors([("model.embed_tokens.weight", new)])
    while seq.finish is None:
        batcher.step()
    assert float(weight[0, 0]) == 0.25
    assert seq.weight_versions == [[0, 0, 4], [1, 4, 6]]
    assert seq.finish == {"type": "length", "length": 6}


def _train(*overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", *overrides, "--print-config"],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )  # fmt: skip


@pytest.mark.parametrize("value", ["0", "-0.5"])
def test_the_config_refuses_a_non_positive_latency(value: str) -> None:
    with pytest.raises(ConfigError, match="rollout.latency_model_s_per_token"):
        RolloutConfig(latency_model_s_per_token=float(value)).validate()
    res = _train(f"rollout.latency_model_s_per_token={value}")
    assert res.returncode == 2 and "rollout.latency_model_s_per_token" in res.stderr, res.stderr[-2000:]


def test_the_config_refuses_the_latency_model_with_an_engine_kind_that_has_none() -> None:
    RolloutConfig(latency_model_s_per_token=0.01).validate()  # the embedded engine models it
    with pytest.raises(ConfigError, match="rollout.latency_model_s_per_token.*rollout.engine=sglang"):
        RolloutConfig(engine="sglang", latency_model_s_per_token=0.01).validate()
    res = _train("rollout.engine=sglang", "rollout.latency_model_s_per_token=0.01")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "rollout.latency_model_s_per_token" in res.stderr, res.stderr[-2000:]
