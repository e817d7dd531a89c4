"""Validation through the rollout engines: a greedy pass and a sampled pass@k over the validation set, per data source.

    validator = Validator.from_config(cfg, tokenizer, engines, producer.score)   # None when validation is off
    metrics = validator.run(seed)          # {"val-core/<data_source>/reward/mean@1": ..., "val-core/<ds>/acc/mean@1"}
    validator.due(step, last_step)         # trainer.val_every, and always after the last step

The prompts go to the same engines as the training rollouts (router -> embedded server or SGLang), at the current
weight version, and are scored by the training reward function:

    greedy   temperature 0, one sample per prompt               -> reward/mean@1
    sampled  rollout.val_n = k samples per prompt (rollout.temperature, top_p)
             -> reward/mean@k, reward/std@k (within a prompt), reward/best@j/mean, reward/worst@j/mean,
                pass@j  for j = 2, 4, ... up to k

Names follow verl (`val-core/<data_source>/<var>/<metric>`, core = the @k metrics at the largest k and mean@1, the rest
`val-aux/`). verl estimates best@j by bootstrap; here it is the exact expectation of the best of j samples drawn
without replacement from the k (the unbiased pass@k estimator of Chen et al. 2021 when rewards are 0/1). pass@j
counts a sample as passing when its score reaches the data source's full score 1.0 (the rule rewards' maximum).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from mcore_rl.config import RLConfig

SYNTHETIC_VAL_PROMPTS = 64
"""Size of the held-out synthetic validation set (written when data.val_files is empty and validation is on)."""


def expected_best_of(scores: list[float], j: int) -> float:
    """E[max of j samples drawn without replacement from `scores`]: sum_i s_(i) C(i-1, j-1) / C(k, j) (ascending s)."""
    ordered = sorted(scores)
    k = len(ordered)
    total = math.comb(k, j)
    return sum(s * math.comb(i, j - 1) for i, s in enumerate(ordered)) / total


def ks_up_to(k: int) -> list[int]:
    """2, 4, 8, ... below k, then k (verl's choice of subset sizes)."""
    out, j = [], 2
    while j < k:
        out.append(j)
        j *= 2
    return out + [k]


def prompt_metrics(scores: list[float]) -> dict[str, float]:
    """One prompt's sampled-pass metrics (averaged over prompts by the caller)."""
    k = len(scores)
    mean = sum(scores) / k
    out = {f"mean@{k}": mean, f"std@{k}": math.sqrt(sum((s - mean) ** 2 for s in scores) / k)}
    passed = [1.0 if s >= 1.0 else 0.0 for s in scores]
    for j in ks_up_to(k):
        out[f"best@{j}/mean"] = expected_best_of(scores, j)
        out[f"worst@{j}/mean"] = -expected_best_of([-s for s in scores], j)
        out[f"pass@{j}"] = expected_best_of(passed, j)
    return out


def validation_sampling(cfg: RLConfig) -> dict[str, float]:
    """Sampling overrides of validation: {} (greedy first pass, rollout's sampling after) unless
    rollout.val_temperature is set."""
    r = cfg.rollout
    if r.val_temperature is None:
        return {}
    return {"temperature": r.val_temperature, "top_p": r.top_p if r.val_top_p is None else r.val_top_p}


class Validator:
    """See the module docstring."""

    def __init__(
        self,
        prompts: list[dict[str, Any]],
        engines: Any,
        score: Callable[[list[dict[str, Any]], list[Any], int], torch.Tensor],
        eos: list[int],
        val_n: int,
        batch_size: int | None,
        val_every: int,
        sampling: dict[str, float] | None = None,
        reward: Any = None,
    ) -> None:
        self.prompts, self.engines, self.score, self.eos = prompts, engines, score, eos
        self.val_n, self.batch_size, self.val_every = val_n, batch_size or len(prompts), val_every
        # rollout.val_temperature / val_top_p (verl's val_kwargs with do_sample=True): both passes sample with them
        self.sampling = sampling or {}
        self.reward = reward  # the RewardManager: its last_output() holds the extras (acc) of a scoring call

    @classmethod
    def from_config(
        cls, cfg: RLConfig, tokenizer: Any, engines: Any, score: Callable, reward: Any = None
    ) -> Validator | None:
        """The validation set of the config (data.val_files, or a held-out synthetic set), or None when off."""
        from mcore_rl.data.dataset import PromptDataset
        from mcore_rl.data.synthetic import write_synthetic_dataset

        if not cfg.trainer.validates:
            return None
        files = list(cfg.data.val_files)
        if not files:  # RLConfig.validate allows this only for a synthetic task
            path = os.path.join(cfg.trainer.run_dir, f"{cfg.data.synthetic_task}_val.parquet")
            task = cfg.data.synthetic_task
            write_synthetic_dataset(path, SYNTHETIC_VAL_PROMPTS, cfg.data.seed + 1, task=task, split="test")
            files = [path]
        dataset = PromptDataset(
            files, tokenizer, cfg.data.max_prompt_length, overlong=cfg.data.overlong, prompt_key=cfg.data.prompt_key
        )
        if len(dataset) == 0:
            raise ValueError(f"data.val_files={files}: no validation prompts left (all dropped or empty files)")
        return cls(
            [dataset[i] for i in range(len(dataset))],
            engines,
            score,
            [tokenizer.eos_token_id],
            cfg.rollout.val_n,
            cfg.data.val_batch_size,
            cfg.trainer.val_every,
            validation_sampling(cfg),
            reward,
        )

    def due(self, step: int, last_step: int) -> bool:
        """Validate after this step? Every val_every steps and after the last one."""
        return self.val_every > 0 and (step % self.val_every == 0 or step == last_step)

    def run(self, seed: int) -> dict[str, float]:
        """Greedy and sampled passes over the whole set; val-core/val-aux metrics per data source."""
        per_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for start in range(0, len(self.prompts), self.batch_size):
            prompts = self.prompts[start : start + self.batch_size]
            ids = [p["prompt_token_ids"] for p in prompts]
            first = self.sampling or {"temperature": 0.0}
            greedy = self.engines.generate(ids, 1, seed, self.eos, overrides=first)
            scores = self.score(prompts, greedy, 1).tolist()
            for p, s, acc in zip(prompts, scores, self._acc(len(scores))):
                per_source[p["data_source"]]["mean@1"].append(s)
                if acc is not None:
                    per_source[p["data_source"]]["acc:mean@1"].append(acc)
            if self.val_n:
                k = self.val_n
                sampled = self.engines.generate(ids, k, seed + start * k, self.eos, overrides=self.sampling or None)
                scores = self.score(prompts, sampled, k).view(len(prompts), k).tolist()
                accs = self._acc(len(prompts) * k)
                for i, (p, row) in enumerate(zip(prompts, scores)):
                    for name, value in prompt_metrics(row).items():
                        per_source[p["data_source"]][name].append(value)
                    acc = accs[i * k : (i + 1) * k]
                    if None not in acc:
                        per_source[p["data_source"]][f"acc:mean@{k}"].append(sum(acc) / k)
        out: dict[str, float] = {}
        for source, metrics in sorted(per_source.items()):
            for name, values in metrics.items():
                var, _, name = name.rpartition(":")  # "acc:mean@4": verl's acc variable
                kind, _, at = name.partition("@")
                core = name == "mean@1" or (kind in ("mean", "best", "pass") and at.split("/")[0] == str(self.val_n))
                where = "val-core" if core else "val-aux"
                out[f"{where}/{source}/{var or 'reward'}/{name}"] = sum(values) / len(values)
        return out

    def _acc(self, n: int) -> list[float | None]:
        """The `acc` the reward function returned for the last `n` scored samples (verl logs val-core/<data_source>/
        acc/mean@N when it does), else None for each."""
        output = self.reward.last_output() if self.reward is not None else None
        accs = (output.extras.get("acc") if output is not None else None) or [None] * n
        if len(accs) != n:
            return [None] * n
        return [None if a is None else float(a) for a in accs]
