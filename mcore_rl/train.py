"""Train: the RL loop, read top to bottom (the command line that starts it: mcore_rl/cli.py).

    python -m mcore_rl.train                                  # the default tiny CPU job (configs/default.yaml)
    python -m mcore_rl.train trainer.steps=3 rollout.n=4      # any field of mcore_rl/config/, by dotted name
    python -m mcore_rl.train <verl's overrides>               # a verl launch line (docs/coming_from_verl.md)
    python -m mcore_rl.train --print-config ...               # the validated config in our keys, then stop

One step:  prompts -> rollout engines behind sglang-router (SGLang's HTTP API) -> reward (controller/producer.py)
           -> actor logprobs (old, and the reference's in the same call when a KL term uses it) -> advantages
           -> PPO-clip update on the Megatron ranks -> weight sync (resharding/sync: actor ranks stream buckets to
           every engine, version += 1) [-> validation through the engines (controller/validation.py)]
The loop's state (step, data position, weight version, controller states, reward history) is one object,
controller/state.py's LoopState, so it can be checkpointed and resumed.
Each step's metrics (verl's names, metrics/compute.py) go to the console and trainer.loggers (jsonl, TensorBoard,
wandb: metrics/backends.py); the run ends with a `summary:` line.
"""

from __future__ import annotations

import os
import time
from typing import Any

from mcore_rl.config import RLConfig


def setup_data(cfg: RLConfig) -> tuple[Any, Any, str]:
    """The tokenizer, the prompt loader and the tokenizer's directory; writes the tiny tokenizer and the synthetic
    parquet into the run dir if asked."""
    from transformers import AutoTokenizer

    from mcore_rl.data.dataset import PromptDataset, PromptLoader
    from mcore_rl.data.synthetic import write_synthetic_dataset
    from mcore_rl.data.tokenizer import build_tiny_tokenizer

    tokenizer_dir = cfg.model.tokenizer or os.path.join(cfg.trainer.run_dir, "tokenizer")
    if cfg.model.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer, trust_remote_code=False)
    else:
        tokenizer = build_tiny_tokenizer(tokenizer_dir, tools=cfg.agent.enabled)
    files = list(cfg.data.train_files)
    if not files:
        path = os.path.join(cfg.trainer.run_dir, f"{cfg.data.synthetic_task}.parquet")
        write_synthetic_dataset(path, cfg.data.synthetic_num_prompts, cfg.data.seed, task=cfg.data.synthetic_task)
        files = [path]
    dataset = PromptDataset(
        files, tokenizer, cfg.data.max_prompt_length, overlong=cfg.data.overlong, prompt_key=cfg.data.prompt_key
    )
    loader = PromptLoader(dataset, cfg.data.batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    return tokenizer, loader, tokenizer_dir


def run(cfg: RLConfig) -> dict[str, float]:
    """Run the whole job; returns the summary figures."""

    from mcore_rl.metrics.startup import StartupClock
    from mcore_rl.preflight import check

    clock = StartupClock()  # from this process's start to step 1, by phase: <run_dir>/startup.json
    clock.lap("interpreter, imports, config")
    check(cfg)  # inputs that would fail later (files, run dir, checkpoint, Ray CPUs): refused before anything starts
    clock.lap("pre-flight")

    from mcore_rl.checkpoint.manager import hf_config_of
    from mcore_rl.controller.advantage_stage import AdvantageStage
    from mcore_rl.controller.async_producer import make_producer
    from mcore_rl.controller.producer import dump_rollouts
    from mcore_rl.controller.session import RunSession
    from mcore_rl.controller.train_step import TrainStep
    from mcore_rl.controller.validation import Validator
    from mcore_rl.metrics.compute import FlopsModel, step_metrics
    from mcore_rl.reward.manager import RewardManager
    from mcore_rl.reward.reward_model import build_reward

    # SGLang installed with CUDA; the vLLM virtualenv, its version and plugin, its CPU KV budget: checked before Ray
    # starts, here, not in the config (a CPU login node validates GPU recipes)
    problem = cfg.rollout.kind.unavailable_reason(cfg, lambda: hf_config_of(cfg))
    if problem is not None:
        raise ValueError(problem)
    clock.lap("driver imports, engine checks")
    os.makedirs(cfg.trainer.run_dir, exist_ok=True)
    tokenizer, loader, tokenizer_dir = setup_data(cfg)  # before Ray: a bad dataset is refused before anything starts
    reward = RewardManager(
        build_reward(cfg.reward, tokenizer_dir),
        num_threads=cfg.reward.num_threads,
        timeout_s=cfg.reward.timeout_s,
    )
    # Ray, placement, actor ranks (+ critic), engines and weight sync, stopped in reverse: controller/session.py
    clock.lap("tokenizer, data, reward")
    with RunSession(cfg, tokenizer_dir, clock) as session:
        actor, engines = session.actor, session.engines
        state = session.resume(loader)  # trainer.resume restored; the engines start from the actor's weights
        producer = make_producer(cfg, loader, engines, reward, tokenizer, state)  # single-turn | agent, sync | async
        if hasattr(producer, "close"):  # the async producer's generation thread stops before the engines
            session.close_first(producer.close)
            session.fence_pushes(producer.push_fence)  # rollout.partial_rollout=false: no request spans a push
        advantages = AdvantageStage(cfg.algorithm, state.controllers)
        train = TrainStep(cfg, session, advantages, first_step=state.step + 1)  # the step's orderings, one method
        log = session.logger(state)  # metrics.jsonl and trainer.loggers; a NaN loss stops the run (exit 1)
        flops = FlopsModel.for_run(cfg, hf_config_of(cfg), actor.ranks[0].get("device_name"))
        validator = Validator.from_config(cfg, tokenizer, engines, producer.score, reward)
        clock.lap("loop set-up")
        if validator is not None and cfg.trainer.val_before_train and state.step == 0:
            log.write(0, validator.run(seed=0))
            clock.lap("validation before training")
        clock.finish(cfg.trainer.run_dir)
        start = time.time() - state.seconds

        for step in range(state.step + 1, cfg.trainer.steps + 1):
            timer = log.timer()
            rollouts = producer.produce(step, timer)  # prompts -> engines -> reward
            if cfg.trainer.rollout_data_dir:  # what the model wrote, per sample (verl's rollout dump)
                dump_rollouts(cfg.trainer.rollout_data_dir, step, rollouts, tokenizer)
            rollouts.metrics.update(reward.memory_metrics())  # the driver's growth over the reward phase
            rollouts.metrics.update(session.placement.to_training(actor, engines))
            update, adv_metrics = train.run(step, rollouts, timer, state)  # logprobs, advantages, updates, push
            if validator is not None and validator.due(step, cfg.trainer.steps):
                rollouts.metrics.update(validator.run(seed=step))
                timer.lap("testing")

            kl_in_reward = adv_metrics.get("actor/reward_kl_penalty_coeff")
            metrics = step_metrics(
                rollouts.batch, rollouts.scores, update, timer.laps, max_response_length=cfg.rollout.max_new_tokens,
                actor_ranks=cfg.actor.world_size, flops=flops, max_prompt_length=cfg.data.max_prompt_length,
                reward_kl=None if kl_in_reward is None else (kl_in_reward, cfg.algorithm.kl_penalty),
                kl_loss_coef=cfg.actor.kl_loss_coef,
            )  # fmt: skip
            metrics.update({"training/global_step": step, "training/epoch": loader.epoch})
            log.write(step, {**metrics, "weight_version": state.weight_version, **rollouts.metrics, **adv_metrics})
            state.step, state.loader, state.seconds = step, loader.state_dict(), time.time() - start
            session.ckpt.after_step(actor, state, session.critic)  # every trainer.save_every steps and after the last
        return log.summary(seconds=time.time() - start)


if __name__ == "__main__":  # `python -m mcore_rl.train ...`: the command line is mcore_rl/cli.py's
    from mcore_rl.cli import main

    main(run)
