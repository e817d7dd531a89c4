"""The math of the RL step as pure torch functions: no Megatron, no Ray, no process groups.

    masked.py      masked reductions, per-group statistics, loss aggregation (verl's loss_agg_mode names)
    advantages.py  GRPO / Dr.GRPO, RLOO, OPO, ReMax, REINFORCE++(-baseline), GAE; `compute_advantages(name, ...)`
    losses.py      PPO clip (clip-higher, dual-clip), GSPO, value loss, entropy; `get_policy_loss(name)`
    kl.py          k1/k2/k3/abs estimators, GRPO KL loss, in-reward KL penalty, fixed/adaptive KL controllers
    mismatch.py    rollout/training log-prob mismatch: TIS and sequence-level MIS weights, metrics
    dapo.py        dynamic sampling (zero-variance group filter), soft overlong punishment

Tensors: token-level [batch, response_len] with a float `response_mask`; sequence-level [batch]; samples of one
prompt share a `group_ids` entry. Tests: `pytest tests/test_algorithms*.py`.
"""

from mcore_rl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageOutput,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    opo_advantages,
    outcome_to_token_rewards,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from mcore_rl.algorithms.dapo import dynamic_sampling_mask, soft_overlong_penalty
from mcore_rl.algorithms.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
)
from mcore_rl.algorithms.losses import (
    POLICY_LOSSES,
    LossOutput,
    entropy_from_logits,
    get_policy_loss,
    gspo_loss,
    ppo_clip_loss,
    value_loss,
)
from mcore_rl.algorithms.masked import (
    LOSS_AGG_MODES,
    aggregate_loss,
    group_stats,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from mcore_rl.algorithms.mismatch import (
    IS_LEVELS,
    RS_LEVELS,
    mismatch_metrics,
    rollout_correction,
    sequence_masked_importance_weights,
    sequence_truncated_importance_weights,
    truncated_importance_weights,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "IS_LEVELS",
    "KL_CONTROLLERS",
    "RS_LEVELS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageOutput",
    "FixedKLController",
    "LossOutput",
    "aggregate_loss",
    "apply_kl_penalty",
    "compute_advantages",
    "dynamic_sampling_mask",
    "entropy_from_logits",
    "gae_advantages",
    "get_policy_loss",
    "group_stats",
    "grpo_advantages",
    "gspo_loss",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "opo_advantages",
    "outcome_to_token_rewards",
    "ppo_clip_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "rollout_correction",
    "sequence_masked_importance_weights",
    "sequence_truncated_importance_weights",
    "soft_overlong_penalty",
    "truncated_importance_weights",
    "value_loss",
]
