"""The typed configuration tree of a run: one dataclass per group, each field documented, each group validating
itself (`validate()`).

Hydra composes YAML from configs/ over this schema (registered in the ConfigStore as `rl_schema`), so a key that
does not exist is refused by name. `to_config(cfg)` turns the composed DictConfig into these dataclasses, running every
`validate()`; errors name the field and the expected value.

    python -m mcore_rl.train actor.layout.ep=2 rollout.n=8 trainer.steps=40

The groups live in this package's modules, by meaning: checks.py (ConfigError and the checks), model.py (model,
layout, optimizer, actor, critic), rollout.py (engines, weight sync, agent episodes), algorithm.py (advantages, KL,
DAPO, rollout correction, reward, DPO), trainer.py (data, trainer); validate.py holds the checks that span groups.
verl's keys are read into this tree by mcore_rl/compat/verl/ (docs/coming_from_verl.md).
Every public name is importable from `mcore_rl.config` itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcore_rl.config.algorithm import (
    AlgorithmConfig,
    DPOConfig,
    FilterGroupsConfig,
    KLControlConfig,
    OverlongBufferConfig,
    RewardConfig,
    RolloutCorrectionConfig,
)
from mcore_rl.config.checks import ConfigError
from mcore_rl.config.model import ActorConfig, CriticConfig, LayoutConfig, ModelConfig, OptimConfig
from mcore_rl.config.rollout import ROUTER_POLICIES, AgentConfig, RolloutConfig, SGLangConfig, SyncConfig
from mcore_rl.config.trainer import TRAINER_MODES, DataConfig, TrainerConfig
from mcore_rl.config.validate import validate_run

__all__ = [
    "ROUTER_POLICIES",
    "TRAINER_MODES",
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "ConfigError",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "LayoutConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "RLConfig",
    "RewardConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SGLangConfig",
    "SyncConfig",
    "TrainerConfig",
    "register_schema",
    "to_config",
]


@dataclass
class RLConfig:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def validate(self) -> None:
        """Every group's own validation, then the checks that span groups (config/validate.py); fills in
        actor.use_ref, actor.logit_temperature, model.max_sequence_length, rollout.vllm.max_model_len (vLLM runs) and
        the optimizers' lr_decay_steps when they are null."""
        validate_run(self)
        if self.model.max_sequence_length is None:  # the longest sample this run can make
            response = self.agent.max_response_tokens if self.agent.enabled else self.rollout.max_new_tokens
            # DPO trains on the dataset's pairs, whose length no setting bounds: the former fixed default
            longest = 512 if self.trainer.mode == "dpo" else self.data.max_prompt_length + response
            self.model.max_sequence_length = longest
        self.rollout.kind.complete(self)  # vLLM: rollout.vllm.max_model_len, the run's longest sample
        if self.actor.logit_temperature is None:  # the actor's logprobs are those of the distribution sampled from
            sampled = self.rollout.temperature if self.rollout.temperature > 0 else 1.0
            self.actor.logit_temperature = 1.0 if self.trainer.mode == "dpo" else sampled

    def uses_reference(self) -> bool:
        """Whether a KL term of the objective needs the reference model's logprobs (then the reference pass runs
        every step; otherwise neither the model is built nor the pass run, unless actor.use_ref=true asks). DPO's
        implicit reward is a log-ratio to the reference, so DPO always uses it."""
        return self.actor.kl_loss_coef > 0 or self.algorithm.use_kl_in_reward or self.trainer.mode == "dpo"


def register_schema() -> None:
    """Register the schema with Hydra's ConfigStore (configs/*.yaml list `rl_schema` first in their defaults)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="rl_schema", node=RLConfig)


def to_config(cfg: Any) -> RLConfig:
    """Composed DictConfig -> RLConfig, running every group's validation."""
    from omegaconf import OmegaConf

    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, RLConfig):
        raise ConfigError("the composed config is not an RLConfig: does configs/*.yaml list rl_schema first?")
    obj.validate()
    return obj
