"""A sequence-classification reward model as a Ray worker behind the `BatchRewardFn` seam, and weighted mixing
with the rule rewards.

    reward.model_path=DIR (an HF *ForSequenceClassification checkpoint, num_labels=1)
    decoded responses (+ the prompt's messages when extra_info carries "prompt")
      -> RewardModelWorker (Ray actor, transformers on CPU or one GPU): re-tokenised with the reward model's own
         tokenizer and chat template (as verl's RM worker does), so its vocabulary may differ from the policy's
      -> the score head's logit per sequence
    WeightedReward: score = reward.rule_weight * rule + reward.model_weight * model, per row

Why transformers and not a Megatron model with a scalar head: the RM is frozen (forward only) and scores decoded
text in its own vocabulary, so none of Megatron's training machinery (DDP, optimizer, pipeline schedule) is used;
transformers loads any HF reward model as published. A checkpoint without tokenizer files is read with the policy's
tokenizer, and then its vocabulary must cover the policy's (else a clear error naming both sizes).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from mcore_rl.reward.loader import RewardFn, RewardFunctionError, RewardResult


class RewardModelWorker:
    """Holds one reward model; `score(texts or chats)` -> one float per row. Construct as a Ray actor."""

    def __init__(self, path: str, policy_tokenizer: str | None, device: str = "cpu", max_length: int = 4096) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(1)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise RewardFunctionError(f"reward.model_path={path!r}: no config.json (expected an HF checkpoint dir)")
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        if getattr(config, "num_labels", 1) != 1:
            raise RewardFunctionError(
                f"reward.model_path={path!r}: num_labels={config.num_labels}; expected a scalar head (num_labels=1)"
            )
        own = any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
        if not own and policy_tokenizer is None:
            raise RewardFunctionError(f"reward.model_path={path!r} has no tokenizer and no policy tokenizer was given")
        self.tokenizer = AutoTokenizer.from_pretrained(path if own else policy_tokenizer, trust_remote_code=False)
        if not own and len(self.tokenizer) > config.vocab_size:
            raise RewardFunctionError(
                f"reward.model_path={path!r} has no tokenizer of its own and vocab_size={config.vocab_size}, smaller "
                f"than the policy tokenizer's {len(self.tokenizer)} tokens; expected a reward model with its own "
                "tokenizer files (then text is re-tokenised) or one sharing the policy's vocabulary"
            )
        self.model = (
            AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32, trust_remote_code=False)
            .to(device)
            .eval()
        )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.max_length = device, max_length

    def score(self, rows: Sequence[str | list[dict[str, str]]]) -> list[float]:
        """Rows are plain text or chat messages (rendered with the RM's chat template); returns the head's logits."""
        import torch

        texts = [r if isinstance(r, str) else self.tokenizer.apply_chat_template(r, tokenize=False) for r in rows]
        self.tokenizer.padding_side = "right"
        enc = self.tokenizer(
            texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length,
            add_special_tokens=False,
        )  # fmt: skip
        with torch.no_grad():
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
        return [float(x) for x in logits[:, 0].float().cpu()]


class RewardModelScorer:
    """`BatchRewardFn` over a `RewardModelWorker` Ray actor (started on first use, so the driver may build it
    before Ray is up)."""

    def __init__(self, path: str, policy_tokenizer: str | None, num_cpus: float = 1.0, num_gpus: float = 0.0) -> None:
        self.path, self.policy_tokenizer = path, policy_tokenizer
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self._worker: Any = None

    def _handle(self) -> Any:
        import ray

        if self._worker is None:
            cls = ray.remote(RewardModelWorker).options(num_cpus=self.num_cpus, num_gpus=self.num_gpus)
            device = "cuda" if self.num_gpus else "cpu"
            self._worker = cls.remote(self.path, self.policy_tokenizer, device)
        return self._worker

    def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[str],
        extra_infos: Sequence[dict[str, Any] | None],
    ) -> list[RewardResult]:
        import ray

        rows: list[str | list[dict[str, str]]] = []
        for response, extra in zip(solution_strs, extra_infos):
            prompt = (extra or {}).get("prompt")
            rows.append([*prompt, {"role": "assistant", "content": response}] if prompt else response)
        return list(ray.get(self._handle().score.remote(rows)))

    def close(self) -> None:
        import ray

        if self._worker is not None:
            ray.kill(self._worker)
            self._worker = None


class WeightedReward:
    """`BatchRewardFn`: per row, the weighted sum of a rule reward (per-row `RewardFn`) and a batch scorer."""

    def __init__(self, rule: RewardFn, rule_weight: float, model: RewardModelScorer, model_weight: float) -> None:
        self.rule, self.rule_weight, self.model, self.model_weight = rule, rule_weight, model, model_weight

    def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[str],
        extra_infos: Sequence[dict[str, Any] | None],
    ) -> list[RewardResult]:
        model_scores = self.model.score_batch(data_sources, solution_strs, ground_truths, extra_infos)
        out: list[RewardResult] = []
        for i, model_score in enumerate(model_scores):
            rule = 0.0
            if self.rule_weight:
                got = self.rule(data_sources[i], solution_strs[i], ground_truths[i], extra_infos[i])
                rule = float(got["score"] if isinstance(got, dict) else got)
            total = self.rule_weight * rule + self.model_weight * float(model_score)
            out.append({"score": total, "rule_score": rule, "model_score": float(model_score)})
        return out


def build_reward(cfg: Any, policy_tokenizer: str | None) -> Any:
    """The run's reward from its `reward` config group: the rule/user function alone, or mixed with the reward model
    (`reward.model_path`) by `reward.rule_weight` and `reward.model_weight`."""
    from mcore_rl.reward.loader import build_reward_fn

    rule = build_reward_fn(cfg.path, cfg.name, dict(cfg.kwargs) or None)
    if not cfg.model_path:
        return rule
    scorer = RewardModelScorer(cfg.model_path, policy_tokenizer, num_cpus=cfg.model_num_cpus)
    return WeightedReward(rule, cfg.rule_weight, scorer, cfg.model_weight)
