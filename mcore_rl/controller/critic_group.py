"""The PPO critic as a worker group (algorithm.adv_estimator=gae, critic.enable=true).

    critic = CriticGroup(cfg)                    # critic.world_size Megatron ranks, role "critic", its own layout
    batch.tensors["values"] = critic.values(batch)            # V(s_t) per response token, before the update
    metrics = critic.update(batch)               # clipped value loss towards batch.tensors["returns"] (GAE)
    critic.actor_trains(step)                    # False during critic.warmup_steps: only the critic learns

The ranks are the same role-agnostic Megatron worker as the actor's (actor/megatron_actor.py), built with a scalar
value head (actor/value_head.py) and initialised from critic.path or the policy's checkpoint (or its random init).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mcore_rl.actor.batch import TrainBatch
from mcore_rl.actor.megatron_actor import MegatronActor
from mcore_rl.config import RLConfig
from mcore_rl.controller.actor_group import ActorGroup
from mcore_rl.controller.samples import reduce_rank_metrics


class CriticGroup:
    """The critic's ranks and the calls the loop makes on them."""

    def __init__(self, cfg: RLConfig, options: Callable[[int], dict[str, Any]] | None = None) -> None:
        """`options(rank)`: the critic rank's Ray options from the placement (its bundle, its GPU share)."""
        self.warmup_steps = cfg.critic.warmup_steps
        self.group = ActorGroup(
            cfg.model, cfg.critic, cfg.trainer.runtime, seed=cfg.trainer.seed, role="critic", options=options
        )

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token values [B, R] of the batch (0 on padding)."""
        return ActorGroup.gather_dp(self.group.call(MegatronActor.values, batch))

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One critic update over the batch (needs tensors `values` and `returns`); token-weighted mean metrics."""
        return reduce_rank_metrics(ActorGroup.gather_dp(self.group.call(MegatronActor.update, batch)))

    def actor_trains(self, step: int) -> bool:
        """Whether the policy is updated at `step` (1-based): not during the critic's warm-up."""
        return step > self.warmup_steps

    def shutdown(self) -> None:
        self.group.shutdown()
