"""The objective: advantage estimation, the in-reward KL, DAPO's dynamic sampling and overlong shaping, the
rollout/training mismatch correction, the reward function, and offline DPO."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcore_rl.config.checks import _check, _positive


@dataclass
class KLControlConfig:
    """The coefficient of the in-reward KL penalty (verl's algorithm.kl_ctrl)."""

    type: str = "fixed"  #: fixed | adaptive (Ziegler et al. 2019), algorithms/kl.py's KL_CONTROLLERS
    kl_coef: float = 0.001  #: the coefficient (the adaptive controller's initial value)
    target_kl: float = 0.1  #: adaptive: the per-token KL the controller steers towards
    horizon: int = 10000  #: adaptive: samples over which the coefficient responds

    def validate(self) -> None:
        from mcore_rl.config.names import KL_CONTROLLERS

        _check(self.type in KL_CONTROLLERS, "algorithm.kl_ctrl.type", self.type, f"one of {tuple(KL_CONTROLLERS)}")
        _check(self.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", self.kl_coef, ">= 0")
        _check(self.target_kl > 0, "algorithm.kl_ctrl.target_kl", self.target_kl, "> 0")
        _positive("algorithm.kl_ctrl.horizon", self.horizon)


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling (verl's algorithm.filter_groups): groups whose samples all got the same reward are
    dropped and more prompts are generated until the batch holds data.batch_size groups."""

    enable: bool = False
    max_num_gen_batches: int = 10  #: generation rounds (of data.batch_size prompts) per step at most
    #: when the rounds run out: error (stop the run) | shrink (log a warning, train on the groups found, cut to a
    #: size the mini-batches and data-parallel ranks divide)
    on_unfilled: str = "error"

    def validate(self) -> None:
        _positive("algorithm.filter_groups.max_num_gen_batches", self.max_num_gen_batches)
        _check(
            self.on_unfilled in ("error", "shrink"),
            "algorithm.filter_groups.on_unfilled",
            self.on_unfilled,
            "error or shrink",
        )


@dataclass
class RolloutCorrectionConfig:
    """Importance weights for the rollout/training mismatch (verl's algorithm.rollout_correction), applied to the
    policy loss; algorithms/mismatch.py."""

    rollout_is: str | None = None  #: token (TIS) | sequence (truncated sequence ratio) | null = off
    rollout_is_threshold: float = 2.0  #: the truncation cap C of the importance weights
    rollout_rs: str | None = None  #: rejection (MIS): sequence (summed log-ratio) | geometric (mean) | null = off
    rollout_rs_threshold: float = 2.0  #: upper bound of the sequence ratio; outside [lower, upper] -> weight 0
    rollout_rs_threshold_lower: float | None = None  #: lower bound (null = 1 / upper)

    def validate(self) -> None:
        from mcore_rl.config.names import IS_LEVELS, RS_LEVELS

        name = "algorithm.rollout_correction"
        _check(
            self.rollout_is in (None, *IS_LEVELS), f"{name}.rollout_is", self.rollout_is, f"null or one of {IS_LEVELS}"
        )
        _check(
            self.rollout_rs in (None, *RS_LEVELS), f"{name}.rollout_rs", self.rollout_rs, f"null or one of {RS_LEVELS}"
        )
        _check(self.rollout_is_threshold > 0, f"{name}.rollout_is_threshold", self.rollout_is_threshold, "> 0")
        _check(self.rollout_rs_threshold > 0, f"{name}.rollout_rs_threshold", self.rollout_rs_threshold, "> 0")
        lower = self.rollout_rs_threshold_lower
        _check(
            lower is None or 0 <= lower <= self.rollout_rs_threshold,
            f"{name}.rollout_rs_threshold_lower",
            lower,
            f"null or in [0, rollout_rs_threshold={self.rollout_rs_threshold}]",
        )


@dataclass
class AlgorithmConfig:
    """Advantage estimation and what shapes the reward before it (verl's `algorithm` group)."""

    #: algorithms/advantages.py's ADVANTAGE_ESTIMATORS: grpo | gae (needs critic.enable) | rloo | opo | remax
    #: (a greedy baseline rollout per prompt) | reinforce_plus_plus | reinforce_plus_plus_baseline
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True  #: GRPO: divide by the group std (false = Dr.GRPO)
    gamma: float = 1.0  #: discount (GAE, REINFORCE++)
    lam: float = 1.0  #: GAE lambda (PPO with a critic)
    use_kl_in_reward: bool = False  #: subtract kl_ctrl.kl_coef * KL(old || ref) per token from the reward
    kl_penalty: str = "kl"  #: the in-reward KL estimator: algorithms/kl.py's KL_ESTIMATORS
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def validate(self) -> None:
        from mcore_rl.config.names import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS

        known = tuple(ADVANTAGE_ESTIMATORS)
        _check(self.adv_estimator in known, "algorithm.adv_estimator", self.adv_estimator, f"one of {known}")
        _check(self.kl_penalty in KL_ESTIMATORS, "algorithm.kl_penalty", self.kl_penalty, f"one of {KL_ESTIMATORS}")
        _check(0 <= self.gamma <= 1, "algorithm.gamma", self.gamma, "in [0, 1]")
        _check(0 <= self.lam <= 1, "algorithm.lam", self.lam, "in [0, 1]")
        self.kl_ctrl.validate()
        self.filter_groups.validate()
        self.rollout_correction.validate()


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (verl's reward_model.overlong_buffer), added to the reward: 0 up to
    rollout.max_new_tokens - len, then a linear ramp down to -penalty_factor at max_new_tokens."""

    enable: bool = False
    len: int = 4  #: tokens of the ramp before rollout.max_new_tokens
    penalty_factor: float = 1.0  #: the penalty at the longest response

    def validate(self, max_new_tokens: int) -> None:
        if self.enable:
            _check(
                isinstance(self.len, int) and 0 < self.len <= max_new_tokens,
                "reward.overlong_buffer.len",
                self.len,
                f"in [1, rollout.max_new_tokens={max_new_tokens}]",
            )
            _check(self.penalty_factor >= 0, "reward.overlong_buffer.penalty_factor", self.penalty_factor, ">= 0")


@dataclass
class RewardConfig:
    """Reward function (verl's custom_reward_function: path + name), else built-ins by data_source."""

    path: str | None = None  #: python file defining the reward function; null = built-ins by data_source
    name: str | None = None  #: function name in `path` (verl's custom_reward_function.name)
    #: keyword arguments bound to every call of the function in `path` (verl's custom_reward_function.reward_kwargs)
    kwargs: dict[str, Any] = field(default_factory=dict)
    num_threads: int = 1  #: concurrent calls of a per-response function
    #: per-call limit in seconds (null = none); a call past it fails the step, naming the row. 60 s: a rule reward
    #: takes microseconds and a math verifier's symbolic check seconds at worst; a code reward's sandbox bounds each run
    #: at 10-30 s (verl's sandbox default is 30). A call still running after a minute is hung or swapping, and without
    #: a limit it stalled the run with no message (a reward allocating 2 GB per call)
    timeout_s: float | None = 60.0
    #: HF sequence-classification reward model dir (num_labels=1), scored by a Ray worker (reward/reward_model.py)
    model_path: str | None = None
    model_weight: float = 1.0  #: weight of the reward model's score in the per-row sum
    rule_weight: float = 1.0  #: weight of the rule (or user) reward in the per-row sum when a reward model is set
    model_num_cpus: float = 0.0  #: Ray CPUs reserved for the reward-model worker (0: it shares the run's)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)

    def validate(self) -> None:
        _positive("reward.num_threads", self.num_threads)
        if self.timeout_s is not None:
            _check(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "> 0 seconds, or null for no limit")
        _check(not self.kwargs or self.path is not None, "reward.kwargs", self.kwargs, "{} unless reward.path is set")
        _check(
            self.name is None or self.path is not None,
            "reward.name",
            self.name,
            "null unless reward.path names the file that defines it",
        )
        if self.model_path is not None:
            import os

            _check(
                os.path.isfile(os.path.join(self.model_path, "config.json")),
                "reward.model_path",
                self.model_path,
                "an HF checkpoint dir with config.json",
            )
        _check(self.model_num_cpus >= 0, "reward.model_num_cpus", self.model_num_cpus, ">= 0")


@dataclass
class DPOConfig:
    """Offline DPO (`python -m mcore_rl.train --config-name dpo`, trainer.mode=dpo): preference pairs train the actor
    against its frozen reference; the rollout engines only sample the policy to score it with the rule reward."""

    beta: float = 0.1  #: inverse temperature of the implicit reward beta * log(pi / ref) (IPO: its tau)
    loss_type: str = "sigmoid"  #: a loss of mcore_rl.algorithms.dpo.DPO_LOSSES: sigmoid (DPO) | ipo
    #: parquet files with prompt/chosen/rejected (data/preference.py); empty = pairs derived from data.synthetic_task
    train_files: list[str] = field(default_factory=list)

    def validate(self) -> None:
        from mcore_rl.config.names import DPO_LOSSES

        _check(self.beta > 0, "dpo.beta", self.beta, "> 0")
        _check(self.loss_type in DPO_LOSSES, "dpo.loss_type", self.loss_type, f"one of {sorted(DPO_LOSSES)}")
