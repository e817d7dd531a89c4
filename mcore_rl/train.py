"""Train: Hydra entry point and the RL loop, read top to bottom.

    python -m mcore_rl.train                                  # the default tiny CPU job (configs/default.yaml)
    python -m mcore_rl.train trainer.steps=3 rollout.n=4      # any field of mcore_rl/config.py, by dotted name

One step:  prompts -> rollout engine (generate) -> rule reward -> actor logprobs (old) and reference logprobs
           -> GRPO advantages -> PPO-clip update on the Megatron ranks -> weight sync (actor -> engine, version += 1)
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


def setup_data(cfg: RLConfig) -> tuple[Any, Any]:
    """The tokenizer and prompt loader; writes the tiny tokenizer and synthetic parquet into the run dir if asked."""
    from transformers import AutoTokenizer

    from mcore_rl.data.dataset import PromptDataset, PromptLoader
    from mcore_rl.data.synthetic import write_synthetic_dataset
    from mcore_rl.data.tokenizer import build_tiny_tokenizer

    if cfg.model.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    else:
        tokenizer = build_tiny_tokenizer(os.path.join(cfg.trainer.run_dir, "tokenizer"))
    files = list(cfg.data.train_files)
    if not files:
        path = os.path.join(cfg.trainer.run_dir, f"{cfg.data.synthetic_task}.parquet")
        write_synthetic_dataset(path, cfg.data.synthetic_num_prompts, cfg.data.seed, task=cfg.data.synthetic_task)
        files = [path]
    dataset = PromptDataset(files, tokenizer, cfg.data.max_prompt_length, overlong=cfg.data.overlong)
    return tokenizer, PromptLoader(dataset, cfg.data.batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)


def run(cfg: RLConfig) -> dict[str, float]:
    """Run the whole job; returns the summary figures."""
    import ray

    from mcore_rl.algorithms import kl_penalty, masked_mean
    from mcore_rl.controller.actor_group import ActorGroup
    from mcore_rl.controller.samples import outcome_advantages, reduce_rank_metrics, samples_to_batch
    from mcore_rl.metrics.logger import MetricsLogger
    from mcore_rl.reward.loader import build_reward_fn
    from mcore_rl.reward.manager import RewardManager
    from mcore_rl.rollout import create_rollout_engine_actor

    os.makedirs(cfg.trainer.run_dir, exist_ok=True)
    tokenizer, loader = setup_data(cfg)
    reward = RewardManager(
        build_reward_fn(cfg.reward.path, cfg.reward.name),
        num_threads=cfg.reward.num_threads,
        timeout_s=cfg.reward.timeout_s,
    )
    if not ray.is_initialized():
        cpus = cfg.trainer.ray_num_cpus or int(
            cfg.actor.world_size * cfg.actor.num_cpus_per_rank + cfg.rollout.num_cpus + 1
        )
        ray.init(
            address=cfg.trainer.ray_address,
            num_cpus=None if cfg.trainer.ray_address else cpus,
            include_dashboard=False,
            log_to_driver=True,
        )
    actor = ActorGroup(cfg.model, cfg.actor, cfg.trainer.runtime, seed=cfg.trainer.seed)
    engine = create_rollout_engine_actor(
        _engine_model(cfg),
        num_cpus=cfg.rollout.num_cpus,
        dtype=cfg.model.dtype,
        device="cuda" if cfg.trainer.runtime == "cuda" else "cpu",
    )
    ray.get(engine.update_weights_from_tensors.remote(actor.export_hf()))  # engine starts from the actor's weights
    log = MetricsLogger(os.path.join(cfg.trainer.run_dir, "metrics.jsonl"))
    eos = [tokenizer.eos_token_id]
    start = time.time()

    for step in range(1, cfg.trainer.steps + 1):
        timer = log.timer()
        prompts = next(loader)
        samples = ray.get(
            engine.generate.remote(
                [p["prompt_token_ids"] for p in prompts],
                n=cfg.rollout.n,
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                max_new_tokens=cfg.rollout.max_new_tokens,
                eos_token_ids=eos,
                seed=cfg.rollout.seed + step,
            )
        )
        timer.lap("time/generate")

        per_sample = {k: [p[k] for p in prompts for _ in range(cfg.rollout.n)] for k in _PROMPT_FIELDS}
        texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        scored = reward.score(texts, *(per_sample[k] for k in _PROMPT_FIELDS))
        batch, group_ids = samples_to_batch(samples, cfg.rollout.n)
        timer.lap("time/reward")

        batch.tensors["old_logprobs"] = ActorGroup.gather_dp(actor.call("logprobs", batch))
        if cfg.actor.use_ref:
            batch.tensors["ref_logprobs"] = ActorGroup.gather_dp(actor.call("logprobs", batch, use_ref=True))
        timer.lap("time/logprobs")

        batch.tensors["advantages"] = outcome_advantages(cfg.algorithm, scored.scores, batch.response_mask, group_ids)
        update = reduce_rank_metrics(ActorGroup.gather_dp(actor.call("update", batch)))
        timer.lap("time/update")

        version = ray.get(engine.update_weights_from_tensors.remote(actor.export_hf()))
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
                "reward/mean": float(scored.scores.mean()),
                "response/length": float(mask.sum(1).mean()),
                "actor/kl_ref": float(kl),
                "rollout/logprob_abs_diff": float(mismatch),
                "weight_version": version,
                **{k: v for k, v in update.items() if k in _SHOWN},
                **timer.laps,
            },
        )

    summary = log.summary(seconds=time.time() - start)
    actor.shutdown()
    ray.kill(engine)
    return summary


_PROMPT_FIELDS = ("data_source", "ground_truth", "extra_info")
_SHOWN = ("actor/pg_loss", "actor/clip_frac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/kl_loss")


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
