"""Producers that shape a step's batch for an algorithm, behind the same `produce(step, timer)` as RolloutProducer.

producer = build_producer(cfg, loader, engines, reward, tokenizer)
rollouts = producer.produce(step, timer)

DAPO dynamic sampling (algorithm.filter_groups.enable):
    repeat: data.batch_size prompts -> engines -> reward -> keep the groups whose rewards are not all equal
    until data.batch_size groups are kept or max_num_gen_batches rounds are spent; then error or a smaller batch
    (filter_groups.on_unfilled). The filter reads the final (shaped) sequence reward.
DAPO overlong reward shaping (reward.overlong_buffer.enable): a length penalty added to every score.
ReMax (algorithm.adv_estimator=remax): one greedy (temperature 0) rollout per kept prompt through the same
    engines; its reward is the baseline of that prompt's n samples (Rollouts.baseline_scores).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from mcore_rl.algorithms import dynamic_sampling_mask, soft_overlong_penalty
from mcore_rl.config import RLConfig
from mcore_rl.controller.producer import RolloutProducer, Rollouts
from mcore_rl.controller.samples import samples_to_batch
from mcore_rl.metrics.logger import StepTimer
from mcore_rl.rollout.sampling import Sample

log = logging.getLogger(__name__)


class AlgorithmProducer(RolloutProducer):
    """RolloutProducer with DAPO's dynamic sampling and overlong shaping and ReMax's greedy baseline, as configured."""

    def produce(self, step: int, timer: StepTimer) -> Rollouts:
        """One step's batch: filtered to informative groups if asked, with greedy baselines for ReMax."""
        if self.cfg.algorithm.filter_groups.enable:
            rollouts = self._fill_informative(step, timer)
        else:
            rollouts = super().produce(step, timer)
        if self.cfg.algorithm.adv_estimator == "remax":
            rollouts.baseline_scores = self.greedy_baseline(rollouts.prompts, step)
            timer.lap("gen_max")  # verl's name for ReMax's greedy pass
        return rollouts

    def regenerate(self, prompts: list[dict[str, Any]], step: int) -> Rollouts:
        """The plain regeneration, with ReMax's greedy baselines for those prompts (dynamic sampling refuses
        regeneration: config/validate.py)."""
        rollouts = super().regenerate(prompts, step)
        if self.cfg.algorithm.adv_estimator == "remax":
            rollouts.baseline_scores = self.greedy_baseline(prompts, step)
        return rollouts

    def score(self, prompts: list[dict[str, Any]], samples: list[Sample], n: int) -> torch.Tensor:
        """The reward function's scores plus DAPO's soft overlong penalty when reward.overlong_buffer is enabled."""
        scores = super().score(prompts, samples, n)
        buffer = self.cfg.reward.overlong_buffer
        if buffer.enable:
            lengths = torch.tensor([len(s.response_ids) for s in samples])
            scores = scores + soft_overlong_penalty(
                lengths,
                max_response_len=self.cfg.rollout.max_new_tokens,
                overlong_buffer_len=buffer.len,
                penalty_factor=buffer.penalty_factor,
            ).to(scores.dtype)
        return scores

    def greedy_baseline(self, prompts: list[dict[str, Any]], step: int) -> torch.Tensor:
        """ReMax: the reward of one temperature-0 rollout per prompt, repeated for its n samples -> [B*n]."""
        greedy = self.engines.generate(
            [p["prompt_token_ids"] for p in prompts],
            1,
            self.seed(step, len(prompts)),
            self.eos,
            overrides={"temperature": 0.0},
        )
        return self.score(prompts, greedy, 1).repeat_interleave(self.cfg.rollout.n)

    def _fill_informative(self, step: int, timer: StepTimer) -> Rollouts:
        cfg, n = self.cfg, self.cfg.rollout.n
        fg, want = cfg.algorithm.filter_groups, cfg.data.batch_size
        prompts: list[dict[str, Any]] = []
        samples: list[Sample] = []
        scores: list[torch.Tensor] = []
        generated: list[torch.Tensor] = []
        rounds = 0
        while len(prompts) < want and rounds < fg.max_num_gen_batches:
            part = super().produce(step, timer)
            rounds += 1
            generated.append(part.scores)
            keep = dynamic_sampling_mask(part.scores, part.group_ids)
            for i, prompt in enumerate(part.prompts):
                if bool(keep[i * n]) and len(prompts) < want:
                    prompts.append(prompt)
                    samples.extend(part.samples[i * n : (i + 1) * n])
                    scores.append(part.scores[i * n : (i + 1) * n])
        kept = len(prompts)
        if kept < want:
            kept = self._unfilled(kept, want, fg.max_num_gen_batches)
            prompts, samples, scores = prompts[:kept], samples[: kept * n], scores[:kept]
        batch, group_ids = samples_to_batch(samples, n)
        all_scores = torch.cat(generated)
        metrics = {
            "filter/gen_rounds": float(rounds),
            "filter/kept_groups": float(kept),
            "filter/kept_frac": kept / (all_scores.numel() // n),
            # The mean over every generated sample: the filtered batch's own mean is biased towards mixed groups.
            "critic/score/unfiltered_mean": float(all_scores.mean()),
        }
        return Rollouts(prompts, samples, torch.cat(scores), batch, group_ids, metrics)

    def _unfilled(self, kept: int, want: int, rounds: int) -> int:
        """Too few informative groups after the last round: refuse, or shrink to a size the update can split."""
        fg = self.cfg.algorithm.filter_groups
        where = (
            f"algorithm.filter_groups: {kept} of data.batch_size={want} groups had non-zero reward variance after "
            f"max_num_gen_batches={rounds} rounds of {want} prompts"
        )
        if fg.on_unfilled == "error":
            raise ValueError(
                f"{where}; expected a full batch: raise algorithm.filter_groups.max_num_gen_batches, or set "
                "algorithm.filter_groups.on_unfilled=shrink to train on a smaller batch"
            )
        unit = self._group_unit()
        usable = kept // unit * unit
        if usable == 0:
            raise ValueError(
                f"{where}; on_unfilled=shrink needs at least {unit} groups (the mini-batches and data-parallel ranks "
                "must divide the batch); expected more max_num_gen_batches"
            )
        log.warning("%s; training on %d groups (on_unfilled=shrink)", where, usable)
        return usable

    def _group_unit(self) -> int:
        return group_unit(self.cfg)


def group_unit(cfg: RLConfig) -> int:
    """The smallest number of groups whose samples every worker group's mini-batches x dp ranks divide."""
    n = cfg.rollout.n
    divisors = [cfg.actor.mini_batches * cfg.actor.layout.to_layout().dp(cfg.actor.world_size)]
    if cfg.critic.enable:
        divisors.append(cfg.critic.mini_batches * cfg.critic.layout.to_layout().dp(cfg.critic.world_size))
    samples = math.lcm(*divisors)
    return samples // math.gcd(samples, n)


def build_producer(cfg: RLConfig, loader: Any, engines: Any, reward: Any, tokenizer: Any) -> RolloutProducer:
    """The producer the config asks for: the plain one, or AlgorithmProducer when an algorithm shapes the batch."""
    shaped = (
        cfg.algorithm.filter_groups.enable
        or cfg.reward.overlong_buffer.enable
        or cfg.algorithm.adv_estimator == "remax"
    )
    cls = AlgorithmProducer if shaped else RolloutProducer
    return cls(cfg, loader, engines, reward, tokenizer)
