"""Settings that train on nothing, silently: greedy sampling with n > 1 under a group baseline
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


def test_megatrons_checkpoint_load_does_not_print_torchs_future_warning() -> None:
    """A resume printed torch's FutureWarnings "`load_state_dict` is deprecated" and "... deprecating ShardedTensor"
    from every rank: megatron-core's torch_dist load strategy calls torch.distributed.checkpoint.load_state_dict and
    builds ShardedTensors (megatron-core 0.16.1, torch 2.13; tests/test_checkpoint_resume.py checks a real resume).
    quiet_process (run in every Ray worker) hides exactly that warning; another FutureWarning still shows."""
    import inspect
    import warnings

    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies import torch as megatron_torch
    from torch.distributed._shard._utils import DEPRECATE_MSG

    from mcore_rl._quiet import quiet_process

    assert "checkpoint.load_state_dict(" in inspect.getsource(megatron_torch)  # the call the filter is for
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_process()
        try:
            dcp.load_state_dict({}, storage_reader=None)  # warns on entry, then fails on the missing reader
        except Exception:  # noqa: BLE001 - only the warning matters here
            pass
        warnings.warn(DEPRECATE_MSG, FutureWarning, stacklevel=1)  # what the ShardedTensors of that load print
        warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
    messages = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]
    assert messages == ["something else is deprecated"], messages
