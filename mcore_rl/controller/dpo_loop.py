"""The offline DPO loop: preference pairs train the Megatron actor against its frozen reference.

    python -m mcore_rl.train --config-name dpo                       # synthetic copy_digit pairs (configs/dpo.yaml)
    python -m mcore_rl.train --config-name dpo dpo.loss_type=ipo dpo.train_files=[pairs.parquet]

One step:  pairs (prompt, chosen, rejected) -> TrainBatch of interleaved chosen/rejected sequences
           -> reference logprobs (frozen colocated reference) -> DPO update on the Megatron ranks (actor/dpo_step.py)
           -> weight sync to the rollout engines -> the policy samples `rollout.n` answers per prompt of this step
           -> rule reward (its mean is the run's learning curve, measured as for the RL algorithms)
Each step prints one metrics line (dpo/loss, dpo/rewards_margin, dpo/rewards_accuracy, critic/score/mean ...)
and the run ends with the same `summary:` line as the RL loop (reward_first / reward_last: 3-step means).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from mcore_rl.actor.batch import TrainBatch
from mcore_rl.config import RLConfig
from mcore_rl.controller.producer import RolloutProducer
from mcore_rl.metrics.logger import SCORE


def pairs_to_batch(pairs: list[dict[str, Any]]) -> TrainBatch:
    """Preference items -> a TrainBatch of 2P sequences [chosen_0, rejected_0, chosen_1, ...] (pairs never split)."""
    responses = [ids for p in pairs for ids in (p["chosen_ids"], p["rejected_ids"])]
    longest = max(len(r) for r in responses)
    tokens = torch.zeros(len(responses), longest, dtype=torch.long)
    mask = torch.zeros(len(responses), longest)
    for i, ids in enumerate(responses):
        tokens[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        mask[i, : len(ids)] = 1.0
    prompts = [list(p["prompt_token_ids"]) for p in pairs for _ in range(2)]
    return TrainBatch(prompts=prompts, responses=tokens, response_mask=mask)


def setup_pairs(cfg: RLConfig) -> tuple[Any, Any, str]:
    """The tokenizer, the pair loader and the tokenizer's directory; writes the tiny tokenizer and the synthetic
    preference parquet (data.synthetic_task, data.synthetic_num_prompts pairs) into the run dir when asked."""
    from transformers import AutoTokenizer

    from mcore_rl.data.dataset import PromptLoader
    from mcore_rl.data.preference import PreferenceDataset
    from mcore_rl.data.synthetic import write_synthetic_preferences
    from mcore_rl.data.tokenizer import build_tiny_tokenizer

    tokenizer_dir = cfg.model.tokenizer or os.path.join(cfg.trainer.run_dir, "tokenizer")
    tokenizer = (
        AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
        if cfg.model.tokenizer
        else build_tiny_tokenizer(tokenizer_dir)
    )
    files = list(cfg.dpo.train_files)
    if not files:
        path = os.path.join(cfg.trainer.run_dir, f"{cfg.data.synthetic_task}_pairs.parquet")
        files = [
            write_synthetic_preferences(path, cfg.data.synthetic_num_prompts, cfg.data.seed, cfg.data.synthetic_task)
        ]
    dataset = PreferenceDataset(files, tokenizer, cfg.data.max_prompt_length, cfg.model.max_sequence_length - 1)
    loader = PromptLoader(dataset, cfg.data.batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    return tokenizer, loader, tokenizer_dir


def run_dpo(cfg: RLConfig) -> dict[str, float]:
    """Run the whole DPO job; returns the summary figures. The run's keys mean what they mean in the RL loop
    (train.py): pre-flight before anything starts, trainer.loggers, trainer.save_every / keep_last / resume (model,
    optimizer, RNG, data position and weight version restored exactly), validation through the engines
    (trainer.val_every, val_before_train). The keys it cannot honour are refused by config/validate.py's check_dpo."""
    from mcore_rl.metrics.startup import StartupClock
    from mcore_rl.preflight import check

    clock = StartupClock()  # from this process's start to step 1, by phase: <run_dir>/startup.json
    clock.lap("interpreter, imports, config")
    check(cfg)  # run dir, loggers, tokenizer, checkpoints, Ray CPUs: refused before anything starts
    clock.lap("pre-flight")

    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.controller.actor_group import ActorGroup
    from mcore_rl.controller.samples import reduce_rank_metrics
    from mcore_rl.controller.session import RunSession
    from mcore_rl.controller.validation import Validator
    from mcore_rl.reward.loader import build_reward_fn
    from mcore_rl.reward.manager import RewardManager

    os.makedirs(cfg.trainer.run_dir, exist_ok=True)
    tokenizer, loader, tokenizer_dir = setup_pairs(cfg)
    reward = RewardManager(
        build_reward_fn(cfg.reward.path, cfg.reward.name),
        num_threads=cfg.reward.num_threads,
        timeout_s=cfg.reward.timeout_s,
    )
    # Ray, placement, actor ranks, engines and weight sync, stopped in reverse: controller/session.py
    clock.lap("driver imports, tokenizer, data, reward")
    with RunSession(cfg, tokenizer_dir, clock) as session:
        actor, engines, sync, ckpt = session.actor, session.engines, session.sync, session.ckpt
        state = session.resume(loader)  # trainer.resume restored; the engines start from the actor's weights
        log = session.logger(state)
        eos = [tokenizer.eos_token_id]
        producer = RolloutProducer(cfg, None, engines, reward, tokenizer)
        validator = Validator.from_config(cfg, tokenizer, engines, producer.score, reward)
        clock.lap("loop set-up")
        if validator is not None and cfg.trainer.val_before_train and state.step == 0:
            log.write(0, validator.run(seed=0))
            clock.lap("validation before training")
        clock.finish(cfg.trainer.run_dir)
        start = time.time() - state.seconds
        for step in range(state.step + 1, cfg.trainer.steps + 1):
            timer = log.timer()
            pairs = next(loader)
            batch = pairs_to_batch(pairs)
            batch.tensors["ref_logprobs"] = ActorGroup.gather_dp(
                actor.call(MegatronActor.logprobs, batch, use_ref=True)
            )
            timer.lap("ref_log_prob")
            sync.weights_changing(step)
            update = reduce_rank_metrics(
                ActorGroup.gather_dp(actor.call(MegatronActor.dpo_update, batch, cfg.dpo.beta, cfg.dpo.loss_type))
            )
            timer.lap("update_actor")
            session.push(step, state)  # version + 1; a non-finite push: TrainingDiverged
            timer.lap("update_weights")
            metrics: dict[str, float] = dict(update)
            if all(p["data_source"] is not None and p["ground_truth"] is not None for p in pairs):
                metrics.update(_score_policy(cfg, engines, producer, pairs, step, eos))
                timer.lap("gen")
            if validator is not None and validator.due(step, cfg.trainer.steps):
                metrics.update(validator.run(seed=step))
                timer.lap("testing")
            log.write(
                step,
                {
                    **metrics,
                    "weight_version": state.weight_version,
                    **{f"timing_s/{k}": v for k, v in timer.laps.items()},
                },
            )
            state.step, state.loader, state.seconds = step, loader.state_dict(), time.time() - start
            ckpt.after_step(actor, state)  # every trainer.save_every steps and after the last
        return log.summary(seconds=time.time() - start)


def _score_policy(  # the RL loop's scoring (controller/producer.py), so both report the same figure
    cfg: RLConfig, engines: Any, producer: RolloutProducer, pairs: list[dict[str, Any]], step: int, eos: list[int]
) -> dict[str, float]:
    """Sample the just-synced policy on this step's prompts and score the answers with the rule reward."""
    n = cfg.rollout.n
    seed = cfg.rollout.seed * 1_000_003 + step * len(pairs) * n
    samples = engines.generate([p["prompt_token_ids"] for p in pairs], n, seed, eos)
    scores = producer.score(pairs, samples, n)
    return {SCORE: float(scores.mean())}
