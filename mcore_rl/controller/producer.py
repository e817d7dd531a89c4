"""Where a step's training batch comes from: prompts -> rollout engines -> reward -> a scored batch.

    producer = RolloutProducer(cfg, loader, engines, reward, tokenizer)
    rollouts = producer.produce(step, timer)     # Rollouts: samples, scores, TrainBatch, group ids, metrics

The loop in train.py asks for one batch per step and does not care how it was made, so the ways of making one live
here: single-turn sampling (this file), and the variants other modules add behind the same `produce` call (filters
that keep generating until a batch is full, multi-turn agent episodes, generation that runs ahead of training).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_rl.actor.batch import TrainBatch
from mcore_rl.config import RLConfig
from mcore_rl.controller.samples import samples_to_batch
from mcore_rl.metrics.logger import StepTimer
from mcore_rl.rollout.sampling import Sample

log = logging.getLogger(__name__)

PROMPT_FIELDS = ("data_source", "ground_truth", "extra_info")
"""Per-prompt columns (verl's schema) handed to the reward function with each response."""


@dataclass
class Rollouts:
    """One step's scored samples, prompt-major (prompt i's samples are i*n .. i*n+n-1)."""

    prompts: list[dict[str, Any]]
    samples: list[Sample]
    scores: torch.Tensor  #: [B*n] sequence rewards
    batch: TrainBatch
    group_ids: torch.Tensor  #: [B*n] prompt index of each sample
    metrics: dict[str, float] = field(default_factory=dict)
    baseline_scores: torch.Tensor | None = None  #: [B*n] ReMax: the reward of a greedy rollout of each prompt


#: estimators whose baseline is the prompt's group of n samples: identical samples give every one a zero advantage
GROUP_BASELINES = ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline")
_warned_identical = False


def warn_identical_groups(cfg: RLConfig) -> None:
    """Warn once: greedy sampling (rollout.temperature=0) with n > 1 under a group baseline makes a prompt's n samples
    the same, so every advantage is zero and the run trains on nothing, silently."""
    global _warned_identical
    rollout, estimator = cfg.rollout, cfg.algorithm.adv_estimator
    if _warned_identical or rollout.temperature != 0 or rollout.n < 2 or estimator not in GROUP_BASELINES:
        return
    _warned_identical = True
    log.warning(
        "rollout.temperature=0 with rollout.n=%d under algorithm.adv_estimator=%s: greedy decoding makes the %d "
        "samples of a prompt identical, so their group advantages are all zero and the policy does not learn; "
        "expected rollout.temperature > 0 (1.0 is usual) or rollout.n=1 with a non-group estimator",
        rollout.n, estimator, rollout.n,
    )  # fmt: skip


class RolloutProducer:
    """Single-turn rollouts: `rollout.n` samples per prompt from the engines, scored by the reward manager."""

    def __init__(self, cfg: RLConfig, loader: Any, engines: Any, reward: Any, tokenizer: Any) -> None:
        self.cfg, self.loader, self.engines, self.reward, self.tokenizer = cfg, loader, engines, reward, tokenizer
        self.eos = [tokenizer.eos_token_id]
        warn_identical_groups(cfg)

    def seed(self, step: int, num_prompts: int) -> int:
        """Disjoint seeds per step: sample j of prompt i gets seed + i * n + j."""
        return self.cfg.rollout.seed * 1_000_003 + step * num_prompts * self.cfg.rollout.n

    def produce(self, step: int, timer: StepTimer) -> Rollouts:
        """Generate and score the next batch of prompts (laps `gen` and `reward`: timing_s/gen, timing_s/reward)."""
        n = self.cfg.rollout.n
        prompts = next(self.loader)
        samples = self._sample(prompts, step)
        timer.lap("gen")
        scores = self.score(prompts, samples, n)
        batch, group_ids = samples_to_batch(samples, n)
        timer.lap("reward")
        return Rollouts(prompts, samples, scores, batch, group_ids)

    def regenerate(self, prompts: list[dict[str, Any]], step: int) -> Rollouts:
        """`prompts`' groups generated and scored again on the weights the engines serve now (the async producer's
        rollout.staleness_action=regenerate), with step `step`'s seeds."""
        n = self.cfg.rollout.n
        samples = self._sample(prompts, step)
        batch, group_ids = samples_to_batch(samples, n)
        return Rollouts(prompts, samples, self.score(prompts, samples, n), batch, group_ids)

    def _sample(self, prompts: list[dict[str, Any]], step: int) -> list[Sample]:
        return self.engines.generate(
            [p["prompt_token_ids"] for p in prompts],
            self.cfg.rollout.n,
            self.seed(step, len(prompts)),
            self.eos,
            return_routed_experts=self.cfg.actor.router_replay_mode == "R3",
        )

    def score(self, prompts: list[dict[str, Any]], samples: list[Sample], n: int) -> torch.Tensor:
        """Sequence rewards [len(samples)] of prompt-major samples (n per prompt)."""
        per_sample = {k: [p[k] for p in prompts for _ in range(n)] for k in PROMPT_FIELDS}
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        return self.reward.score(texts, *(per_sample[k] for k in PROMPT_FIELDS)).scores


def dump_rollouts(directory: str, step: int, rollouts: Rollouts, tokenizer: Any) -> str:
    """Write `<directory>/<step>.jsonl` (verl's trainer.rollout_data_dir): per sample, prompt-major, its prompt text
    (chat template and special tokens as the model saw them), response text (special tokens dropped, as the reward
    read it), score, ground truth, data source and the weight version that generated it. Written to a temporary file
    and renamed, so a reader never sees half a step. Returns the file's path."""
    os.makedirs(directory, exist_ok=True)
    n = max(1, len(rollouts.samples) // max(1, len(rollouts.prompts)))
    prompts = tokenizer.batch_decode([p["prompt_token_ids"] for p in rollouts.prompts], skip_special_tokens=False)
    responses = tokenizer.batch_decode([s.response_ids for s in rollouts.samples], skip_special_tokens=True)
    path = os.path.join(directory, f"{step}.jsonl")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for i, (sample, response) in enumerate(zip(rollouts.samples, responses)):
            prompt = rollouts.prompts[i // n]
            row = {
                "step": step,
                "prompt": prompts[i // n],
                "response": response,
                "score": float(rollouts.scores[i]),
                "ground_truth": prompt.get("ground_truth"),
                "data_source": prompt.get("data_source"),
                "weight_version": sample.weight_version,
                "finish_reason": getattr(sample, "finish_reason", None),
            }
            f.write(json.dumps(row, default=str) + "\n")
    os.replace(tmp, path)
    return path
