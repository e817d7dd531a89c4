"""Train: Hydra entry point and the RL loop, read top to bottom.

    python -m mcore_rl.train                                  # the default tiny CPU job (configs/default.yaml)
    python -m mcore_rl.train trainer.steps=3 rollout.n=4      # any field of mcore_rl/config.py, by dotted name

One step:  prompts -> rollout engines behind sglang-router (SGLang's HTTP API) -> reward (controller/producer.py)
           -> actor logprobs (old) and reference logprobs -> advantages -> PPO-clip update on the Megatron ranks
           -> weight sync (resharding/sync: actor ranks stream buckets to every engine, version += 1)
The loop's state (step, data position, weight version, controller states, reward history) is one object,
controller/state.py's LoopState, so it can be checkpointed and resumed.
Each step prints one metrics line and appends it to <run_dir>/metrics.jsonl; the run ends with a `summary:` line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import hydra
from omegaconf import DictConfig

from mcore_rl.config import RLConfig, register_schema, to_config


def setup_data(cfg: RLConfig) -> tuple[Any, Any, str]:
    """The tokenizer, the prompt loader and the tokenizer's directory; writes the tiny tokenizer and the synthetic
    parquet into the run dir if asked."""
    from transformers import AutoTokenizer

    from mcore_rl.data.dataset import PromptDataset, PromptLoader
    from mcore_rl.data.synthetic import write_synthetic_dataset
    from mcore_rl.data.tokenizer import build_tiny_tokenizer

    tokenizer_dir = cfg.model.tokenizer or os.path.join(cfg.trainer.run_dir, "tokenizer")
    if cfg.model.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    else:
        tokenizer = build_tiny_tokenizer(tokenizer_dir)
    files = list(cfg.data.train_files)
    if not files:
        path = os.path.join(cfg.trainer.run_dir, f"{cfg.data.synthetic_task}.parquet")
        write_synthetic_dataset(path, cfg.data.synthetic_num_prompts, cfg.data.seed, task=cfg.data.synthetic_task)
        files = [path]
    dataset = PromptDataset(files, tokenizer, cfg.data.max_prompt_length, overlong=cfg.data.overlong)
    loader = PromptLoader(dataset, cfg.data.batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    return tokenizer, loader, tokenizer_dir


def run(cfg: RLConfig) -> dict[str, float]:
    """Run the whole job; returns the summary figures."""
    import ray

    from mcore_rl.algorithms import kl_penalty, masked_mean
    from mcore_rl.checkpoint.manager import Checkpointer
    from mcore_rl.controller.actor_group import ActorGroup
    from mcore_rl.controller.engine_pool import EnginePool
    from mcore_rl.controller.producer import RolloutProducer
    from mcore_rl.controller.samples import outcome_advantages, reduce_rank_metrics
    from mcore_rl.controller.state import LoopState
    from mcore_rl.controller.weight_sync import WeightSync
    from mcore_rl.metrics.logger import MetricsLogger
    from mcore_rl.reward.loader import build_reward_fn
    from mcore_rl.reward.manager import RewardManager

    if cfg.rollout.engine == "sglang":  # checked here, not in the config: a CPU login node validates GPU recipes
        from mcore_rl.rollout.sglang_launcher import sglang_unavailable_reason

        reason = sglang_unavailable_reason()
        if reason is not None:
            raise ValueError(f"rollout.engine=sglang cannot run here: {reason}")
    os.makedirs(cfg.trainer.run_dir, exist_ok=True)
    tokenizer, loader, tokenizer_dir = setup_data(cfg)
    reward = RewardManager(
        build_reward_fn(cfg.reward.path, cfg.reward.name),
        num_threads=cfg.reward.num_threads,
        timeout_s=cfg.reward.timeout_s,
    )
    if not ray.is_initialized():
        cpus = cfg.trainer.ray_num_cpus or int(
            cfg.actor.world_size * cfg.actor.num_cpus_per_rank + cfg.rollout.num_cpus * cfg.rollout.num_engines + 1
        )
        ray.init(
            address=cfg.trainer.ray_address,
            num_cpus=None if cfg.trainer.ray_address else cpus,
            include_dashboard=False,
            log_to_driver=True,
        )
    actor = ActorGroup(cfg.model, cfg.actor, cfg.trainer.runtime, seed=cfg.trainer.seed)
    engines = None
    try:
        engines = EnginePool(
            cfg.rollout,
            model=_engine_model(cfg),
            tokenizer=tokenizer_dir,
            dtype=cfg.model.dtype,
            runtime=cfg.trainer.runtime,
            log_dir=os.path.join(cfg.trainer.run_dir, "rollout"),
        )
        sync = WeightSync(
            actor, engines, cfg.sync, cfg.rollout, cfg.trainer.runtime, cfg.trainer.run_dir, _hf_config(cfg)
        )
        ckpt = Checkpointer(cfg)  # trainer.resume: actor ranks, data position and metric history restored
        state = ckpt.resume(actor, loader, LoopState())
        sync.push(state.weight_version)  # the engines start from the actor's (restored) weights
        producer = RolloutProducer(cfg, loader, engines, reward, tokenizer)
        log = MetricsLogger(os.path.join(cfg.trainer.run_dir, "metrics.jsonl"), history=state.rewards)
        start = time.time() - state.seconds

        for step in range(state.step + 1, cfg.trainer.steps + 1):
            timer = log.timer()
            rollouts = producer.produce(step, timer)  # prompts -> engines -> reward
            batch = rollouts.batch

            batch.tensors["old_logprobs"] = ActorGroup.gather_dp(actor.call("logprobs", batch))
            if cfg.actor.use_ref:
                batch.tensors["ref_logprobs"] = ActorGroup.gather_dp(actor.call("logprobs", batch, use_ref=True))
            timer.lap("time/logprobs")

            batch.tensors["advantages"] = outcome_advantages(
                cfg.algorithm, rollouts.scores, batch.response_mask, rollouts.group_ids
            )
            sync.weights_changing()  # an engine replaced from here on waits for the next push
            update = reduce_rank_metrics(ActorGroup.gather_dp(actor.call("update", batch)))
            timer.lap("time/update")

            state.weight_version += 1
            engines.wait_for_restarts()
            sync.push(state.weight_version)
            timer.lap("time/sync")

            mask = batch.response_mask
            kl = masked_mean(
                kl_penalty(
                    batch.tensors["old_logprobs"],
                    batch.tensors.get("ref_logprobs", batch.tensors["old_logprobs"]),
                    "low_var_kl",
                ),
                mask,
            )
            mismatch = masked_mean((batch.tensors["old_logprobs"] - batch.tensors["rollout_logprobs"]).abs(), mask)
            log.write(
                step,
                {
                    "reward/mean": float(rollouts.scores.mean()),
                    "response/length": float(mask.sum(1).mean()),
                    "actor/kl_ref": float(kl),
                    "rollout/logprob_abs_diff": float(mismatch),
                    "weight_version": state.weight_version,
                    **rollouts.metrics,
                    **{k: v for k, v in update.items() if k in _SHOWN},
                    **timer.laps,
                },
            )
            state.step, state.loader, state.seconds = step, loader.state_dict(), time.time() - start
            ckpt.after_step(actor, state)  # every trainer.save_every steps and after the last
        return log.summary(seconds=time.time() - start)
    finally:  # also on errors: no engine, router or rank outlives the run
        actor.shutdown()
        if engines is not None:
            engines.shutdown()


_SHOWN = ("actor/pg_loss", "actor/clip_frac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/kl_loss")


def _hf_config(cfg: RLConfig) -> dict[str, Any]:
    if cfg.model.path:
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            return json.load(f)
    return dict(cfg.model.hf_config)


def _engine_model(cfg: RLConfig) -> Any:
    """What the rollout engine is built from: the HF checkpoint dir, or the same HF config the actor uses."""
    return cfg.model.path if cfg.model.path else dict(cfg.model.hf_config)


register_schema()


@hydra.main(config_path="pkg://mcore_rl.configs", config_name="default", version_base=None)
def main(dcfg: DictConfig) -> None:
    import ray

    try:
        cfg = to_config(dcfg)
    except ValueError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    try:
        summary = run(cfg)
    except (ValueError, ray.exceptions.RayError) as err:
        # Bad checkpoints, datasets or reward functions surface here (from this process or from a Ray worker).
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    with open(os.path.join(cfg.trainer.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main()
