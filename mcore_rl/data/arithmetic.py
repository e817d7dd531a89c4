"""Arithmetic prompts for a real pretrained chat model, written as parquet in verl's schema.

The real-model recipe (configs/smollm2_arith.yaml: SmolLM2-135M-Instruct from `make real-model`) trains on
single-digit addition asked in words, in the model's own chat format (the prompt column holds chat messages; the
dataset applies the tokenizer's chat template):

    arith_add    "What is 7 + 5? Answer with just the number."  -> "12"

The untrained 135M model answers about one in five of these right at temperature 1 (it often restates the sum or
keeps talking), so a GRPO group of 4-8 samples usually holds both right and wrong answers: a signal from the first
step, and room to learn. The reward is `mcore_rl.reward.rule.arithmetic_score` (data_source `arith/add`).

Rows (the columns of `synthetic.SYNTHETIC_SCHEMA`, so every reader of the synthetic tasks reads these):

    data_source   "arith/add"
    prompt        [{"role": "user", "content": "What is 7 + 5? Answer with just the number."}]
    ability       "arithmetic"
    reward_model  {"style": "rule", "ground_truth": "12"}
    extra_info    {"split": "train", "index": 0, "task": "arith_add"}

    python -m mcore_rl.data.synthetic /tmp/arith.parquet --task arith_add --num-prompts 512
"""

from __future__ import annotations

import random
from typing import Any

ARITH_TASK = "arith_add"
"""The task's name (data.synthetic_task=arith_add)."""
ARITH_DATA_SOURCE = "arith/add"
"""The rows' data_source: the reward registry scores it with `rule.arithmetic_score`."""
QUESTION = "What is {a} + {b}? Answer with just the number."


def arithmetic_rows(num_prompts: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """`num_prompts` addition questions a + b (0 <= a, b <= 9) in verl's row layout, deterministically from `seed`.

    The 100 pairs are drawn in shuffled rounds (every pair once per round), so no sum is over-represented: an
    unbalanced set would pay a policy that always answers the most common sum.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(f"arith:{seed}")
    pairs: list[tuple[int, int]] = []
    while len(pairs) < num_prompts:
        round_ = [(a, b) for a in range(10) for b in range(10)]
        rng.shuffle(round_)
        pairs.extend(round_)
    return [
        {
            "data_source": ARITH_DATA_SOURCE,
            "prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": index, "task": ARITH_TASK},
        }
        for index, (a, b) in enumerate(pairs[:num_prompts])
    ]
