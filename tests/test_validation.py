"""Validation metrics (controller/validation.py) and the config rules around validation, the reference model and
the logprob micro-batch size. The run through real engines is in test_train_e2e.py."""

from __future__ import annotations

import itertools
import math
import re

import pytest

from mcore_rl.config import ConfigError, RLConfig
from mcore_rl.controller.validation import expected_best_of, ks_up_to, prompt_metrics


@pytest.mark.parametrize("scores", [[0.0, 1.0, 0.0, 1.0, 0.0], [0.1, 0.7, 0.3, 0.3], [1.0, 1.0, 1.0]])
def test_expected_best_of_equals_enumerating_every_subset(scores: list[float]) -> None:
    for j in range(1, len(scores) + 1):
        subsets = list(itertools.combinations(scores, j))
        assert expected_best_of(scores, j) == pytest.approx(sum(max(s) for s in subsets) / len(subsets))


def test_pass_at_k_is_chen_et_als_unbiased_estimator() -> None:
    scores = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # n = 8 samples, c = 2 pass
    metrics = prompt_metrics(scores)
    for k in (2, 4, 8):
        assert metrics[f"pass@{k}"] == pytest.approx(1 - math.comb(8 - 2, k) / math.comb(8, k))
    assert metrics["mean@8"] == 0.25 and metrics["worst@8/mean"] == 0.0 and metrics["best@8/mean"] == 1.0
    assert ks_up_to(8) == [2, 4, 8] and ks_up_to(6) == [2, 4, 6]


def test_partial_scores_do_not_pass() -> None:
    assert prompt_metrics([0.9, 0.5])["pass@2"] == 0.0


def _config(**groups: dict) -> RLConfig:
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from mcore_rl.config import register_schema

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_module("mcore_rl.configs", version_base=None):
        dcfg = compose(config_name="default")
    GlobalHydra.instance().clear()
    cfg = OmegaConf.to_object(dcfg)
    for group, values in groups.items():
        for key, value in values.items():
            setattr(getattr(cfg, group), key, value)
    return cfg


def test_reference_model_only_when_a_kl_term_uses_it() -> None:
    cfg = _config()
    cfg.validate()
    assert cfg.actor.use_ref is False  # the default job: kl_loss_coef 0
    cfg = _config(actor={"kl_loss_coef": 0.001})
    cfg.validate()
    assert cfg.actor.use_ref is True
    cfg = _config(actor={"use_ref": True})
    cfg.validate()
    assert cfg.actor.use_ref is True  # asked for: its KL is logged
    with pytest.raises(ConfigError, match=re.escape("actor.use_ref=false is invalid with actor.kl_loss_coef=0.01")):
        _config(actor={"use_ref": False, "kl_loss_coef": 0.01}).validate()


@pytest.mark.parametrize(
    "groups, message",
    [
        ({"trainer": {"val_every": 5}, "data": {"train_files": ["t.parquet"]}}, "need data.val_files"),
        ({"trainer": {"val_every": -1}}, "trainer.val_every=-1 is invalid: expected an integer >= 0"),
        ({"rollout": {"val_n": 1}}, "rollout.val_n=1 is invalid: expected 0 (greedy validation only)"),
        ({"data": {"val_batch_size": 0}}, "data.val_batch_size=0 is invalid: expected a positive integer"),
        ({"actor": {"logprob_micro_batch_size": 0}}, "actor.logprob_micro_batch_size=0 is invalid"),
        ({"trainer": {"wandb_mode": "cloud"}}, "trainer.wandb_mode='cloud' is invalid: expected one of"),
    ],
)
def test_bad_validation_and_logging_settings_are_named(groups: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _config(**groups).validate()


def test_synthetic_task_validates_on_a_held_out_set_without_val_files() -> None:
    cfg = _config(trainer={"val_before_train": True})
    cfg.validate()  # no data.val_files: allowed for the synthetic task (the validator writes a held-out set)
    assert cfg.trainer.validates
