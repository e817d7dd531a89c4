"""One RL step's training calls, from scored rollouts to the engines serving the new weights, in one method.

    step = TrainStep(cfg, session, advantages, first_step=state.step + 1)
    update, adv_metrics = step.run(step_index, rollouts, timer, state)   # state.weight_version moves on a push

The step has three orderings, chosen here and nowhere else:

    fused       (no critic, nothing reads old logprobs before the update, cp 1): one actor call computes the old
                logprobs and updates -> advantages were computed first, correction metrics after -> push
    separate    old (+ ref) logprobs -> [critic values] -> advantages (+ correction weights) -> [critic update]
                -> actor update -> push
    warm-up     (a critic in its warm-up steps): as separate, but the actor is not updated; colocated engines take
                their unchanged weights back instead of a push

The first step compares the engines' logprobs of the sampled tokens with the actor's, before any push
(advantage_stage.check_engine_agrees): a run whose engines sample from another model stops there.
"""

from __future__ import annotations

from typing import Any

from mcore_rl.actor.megatron_actor import MegatronActor
from mcore_rl.config import RLConfig
from mcore_rl.controller.actor_group import ActorGroup
from mcore_rl.controller.advantage_stage import AdvantageStage, check_engine_agrees
from mcore_rl.controller.producer import Rollouts
from mcore_rl.controller.samples import reduce_rank_metrics
from mcore_rl.controller.state import LoopState


class TrainStep:
    """The training half of a step: logprobs, values, advantages, updates and the weight push, in the run's order."""

    def __init__(self, cfg: RLConfig, session: Any, advantages: AdvantageStage, first_step: int) -> None:
        """`session`: controller/session.py's RunSession (actor, critic, engines, weight sync, placement);
        `first_step`: the step whose engine-vs-actor logprob check stops a run whose engines sample elsewhere."""
        self.cfg, self.advantages, self.first_step = cfg, advantages, first_step
        self.session, self.actor, self.critic = session, session.actor, session.critic
        # Advantages that do not read old logprobs (no KL in the reward, no correction weights) let the old-logprob
        # pass run inside the update call: one actor call per step instead of two, the same logprobs.
        self.fused = self.critic is None and not advantages.reads_old_logprobs and cfg.actor.layout.cp == 1
        self.setup = (
            f"tokenizer {cfg.model.tokenizer or 'built-in tiny'}, rollout.engine={cfg.rollout.engine}, "
            f"rollout.temperature={cfg.rollout.temperature}, actor.logit_temperature={cfg.actor.logit_temperature}"
        )

    def run(self, step: int, rollouts: Rollouts, timer: Any, state: LoopState) -> tuple[dict[str, Any], dict[str, Any]]:
        """Train on `rollouts` (their batch gains old/ref logprobs, values, advantages) and push the new weights as
        `state.weight_version + 1`; returns (update metrics, advantage metrics). `timer` gets one lap per phase."""
        actor, critic, batch = self.actor, self.critic, rollouts.batch
        tolerance = self.cfg.actor.first_step_logprob_tolerance
        if not self.fused:
            batch.tensors.update(actor.logprobs(batch, with_ref=self.cfg.actor.use_ref))  # old (+ ref): one call
            timer.lap("old_log_prob")
        if critic is not None:
            batch.tensors["values"] = critic.values(batch)
            timer.lap("values")
        if not self.fused and step == self.first_step:
            check_engine_agrees(rollouts, tolerance, self.setup)
        adv_metrics = self.advantages.compute(rollouts, correct=not self.fused)  # correction, KL in reward, estimator
        timer.lap("adv")
        update = critic.update(batch) if critic is not None else {}
        if critic is not None:
            timer.lap("update_critic")
        if critic is not None and not critic.actor_trains(step):
            # the actor is unchanged: colocated engines take their weights back
            self.session.placement.to_generation(self.session.sync, state.weight_version)
            return update, adv_metrics

        self.session.sync.weights_changing(step)  # an engine replaced from here on waits for the next push
        if self.fused:
            per_rank, logprobs, logprob_seconds = actor.logprobs_and_update(batch, self.cfg.actor.use_ref)
            batch.tensors.update(logprobs)
            if step == self.first_step:  # before the push: the engines keep the weights they had
                check_engine_agrees(rollouts, tolerance, self.setup)
            timer.lap_split("update_actor", "old_log_prob", logprob_seconds)
            adv_metrics.update(self.advantages.correction(rollouts))  # the mismatch metrics (no weights)
        else:
            per_rank = ActorGroup.gather_dp(actor.call(MegatronActor.update, batch))
            timer.lap("update_actor")
        update.update(reduce_rank_metrics(per_rank))
        rollouts.metrics.update(self.session.push(step, state))  # version + 1; a non-finite push: TrainingDiverged
        timer.lap("update_weights")
        return update, adv_metrics
