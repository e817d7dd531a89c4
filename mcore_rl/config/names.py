"""The names config validation accepts, listed without importing what implements them.

The registries live with their code (`mcore_rl.algorithms`, the actor's router replay, the weight-sync plan and
transports), all of which import torch: 2.5 s before a CLI could say that a key's value is misspelt. These tuples
are the registries' keys, in their order; `tests/test_config_names.py` checks each against its registry, so adding
an estimator, loss or transport means adding its name here too (the test names the tuple to change).
"""

from __future__ import annotations

ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "opo", "remax", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
POLICY_LOSSES = ("ppo", "gspo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_CONTROLLERS = ("fixed", "adaptive")
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("sequence", "geometric")
DPO_LOSSES = ("sigmoid", "ipo")
ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")
REF_PLACEMENTS = ("resident", "host")
SYNC_MODES = ("full", "shard_aware")
SYNC_TRANSPORTS = ("distributed", "tensor", "disk")
PLACEMENTS = ("split", "colocated")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")

#: each tuple above -> (module, registry name) it mirrors
MIRRORS = {
    "ADVANTAGE_ESTIMATORS": ("mcore_rl.algorithms.advantages", "ADVANTAGE_ESTIMATORS"),
    "POLICY_LOSSES": ("mcore_rl.algorithms.losses", "POLICY_LOSSES"),
    "LOSS_AGG_MODES": ("mcore_rl.algorithms.masked", "LOSS_AGG_MODES"),
    "KL_ESTIMATORS": ("mcore_rl.algorithms.kl", "KL_ESTIMATORS"),
    "KL_CONTROLLERS": ("mcore_rl.algorithms.kl", "KL_CONTROLLERS"),
    "IS_LEVELS": ("mcore_rl.algorithms.mismatch", "IS_LEVELS"),
    "RS_LEVELS": ("mcore_rl.algorithms.mismatch", "RS_LEVELS"),
    "DPO_LOSSES": ("mcore_rl.algorithms.dpo", "DPO_LOSSES"),
    "ROUTER_REPLAY_MODES": ("mcore_rl.actor.router_replay", "ROUTER_REPLAY_MODES"),
    "REF_PLACEMENTS": ("mcore_rl.actor.reference", "PLACEMENTS"),
    "SYNC_MODES": ("mcore_rl.resharding.sync.plan", "MODES"),
    "SYNC_TRANSPORTS": ("mcore_rl.resharding.sync.transports", "TRANSPORTS"),
    "PLACEMENTS": ("mcore_rl.controller.placement", "PLACEMENTS"),
    "LOGGERS": ("mcore_rl.metrics.backends", "BACKENDS"),
}
