"""Settings that train on nothing, silently (issue 30, item 10): greedy sampling with n > 1 under a group baseline
gives every sample of a prompt the same tokens, so every group advantage is zero. The producer warns once."""

from __future__ import annotations

import types

import pytest

from mcore_rl.config import RLConfig
from mcore_rl.controller import producer


def _make(temperature: float, n: int, estimator: str = "grpo") -> None:
    cfg = RLConfig()
    cfg.rollout.temperature, cfg.rollout.n, cfg.algorithm.adv_estimator = temperature, n, estimator
    producer.RolloutProducer(cfg, None, None, None, types.SimpleNamespace(eos_token_id=2))


def test_greedy_groups_warn_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(producer, "_warned_identical", False)
    with caplog.at_level("WARNING", logger="mcore_rl.controller.producer"):
        _make(0.0, 4)
        _make(0.0, 4)
    assert caplog.text.count("rollout.temperature=0 with rollout.n=4 under algorithm.adv_estimator=grpo") == 1
    assert "advantages are all zero" in caplog.text


@pytest.mark.parametrize("temperature,n,estimator", [(1.0, 4, "grpo"), (0.0, 1, "grpo"), (0.0, 4, "remax")])
def test_no_warning_where_samples_can_differ_or_no_group_baseline(monkeypatch, caplog, temperature, n, estimator):
    monkeypatch.setattr(producer, "_warned_identical", False)
    with caplog.at_level("WARNING", logger="mcore_rl.controller.producer"):
        _make(temperature, n, estimator)
    assert not caplog.text
