"""Synthetic prompt datasets for the default CPU RL job, written as parquet in verl's schema.

The default job trains a randomly initialised tiny MoE (2 layers, hidden 64) with GRPO for ~50 steps, so the task
must be learnable from scratch by RL alone, with prompts and answers a few tokens long:

    copy_digit   "repeat: 7"   -> "7"     the default; the policy must learn to attend to one prompt token
    copy_digits  "repeat: 372" -> "372"   three digits, scored per position
    successor    "next: 7"     -> "8"     digit + 1 mod 10: a fixed lookup the policy must learn
    lookup       "lookup: 7"   -> "3"     multi-turn (configs/multiturn_tool.yaml): the value under key 7 is drawn
                                          per row and only the `lookup` tool knows it (extra_info.tools_kwargs), so
                                          the policy must call the tool, then copy its answer
    arith_add    "What is 7 + 5? Answer with just the number." -> "12"   for a real chat model (data/arithmetic.py:
                                          the real-model recipe, configs/smollm2_arith.yaml)

With the tiny tokenizer (`tokenizer.py`) each digit is one token, so an answer of n digits is n tokens plus eos.
The reward (`mcore_rl.reward.rule.synthetic_digits_score`) gives partial credit for emitting digits, for each right
digit and for stopping right after the answer; a uniformly random policy scores ~0.03 and the answer 1.0.

Rows follow verl's parquet schema, so verl's own dataset code (and ours, `dataset.py`) read them:

    data_source   "synthetic/copy_digit"
    prompt        [{"role": "user", "content": "repeat: 7"}]
    ability       "synthetic"
    reward_model  {"style": "rule", "ground_truth": "7"}
    extra_info    {"split": "train", "index": 0, "task": "copy_digit"}

    python -m mcore_rl.data.synthetic /tmp/train.parquet --num-prompts 512 --seed 0 --task copy_digit
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mcore_rl.data.arithmetic import ARITH_TASK, arithmetic_rows

DATA_SOURCE_PREFIX = "synthetic/"
ABILITY = "synthetic"


@dataclass(frozen=True)
class SyntheticTask:
    """One synthetic task: how its prompt is worded and how its answer follows from the sampled digits."""

    name: str
    """Task name; the rows' data_source is `synthetic/<name>`."""
    instruction: str
    """Word before the colon in the prompt; a single token in the tiny tokenizer."""
    num_digits: int
    """How many digits the prompt carries."""
    answer: Callable[[str], str]
    """Maps the prompt's digit string to the ground-truth answer string."""

    @property
    def data_source(self) -> str:
        """The `data_source` column value, which the reward registry dispatches on."""
        return DATA_SOURCE_PREFIX + self.name


def _successor(digits: str) -> str:
    return str((int(digits) + 1) % 10)


TASKS: dict[str, SyntheticTask] = {
    task.name: task
    for task in (
        SyntheticTask("copy_digit", "repeat", 1, lambda digits: digits),
        SyntheticTask("copy_digits", "repeat", 3, lambda digits: digits),
        SyntheticTask("successor", "next", 1, _successor),
    )
}

# verl's column types, spelled out so that an empty dataset or a None in extra_info cannot change them.
MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
SYNTHETIC_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(MESSAGE_TYPE)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("task", pa.string())])),
    ]
)


LOOKUP_TASK = "lookup"
"""The multi-turn tool task: rows carry verl's extra_info.tools_kwargs for the `lookup` tool."""
LOOKUP_SCHEMA = pa.schema(
    [
        *(SYNTHETIC_SCHEMA.field(name) for name in ("data_source", "prompt", "ability", "reward_model")),
        pa.field(
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("task", pa.string()),
                    (
                        "tools_kwargs",
                        pa.struct(
                            [
                                (
                                    "lookup",
                                    pa.struct(
                                        [
                                            (
                                                "create_kwargs",
                                                pa.struct(
                                                    [
                                                        ("key", pa.int64()),
                                                        ("value", pa.string()),
                                                        ("store", pa.list_(pa.string())),
                                                    ]
                                                ),
                                            )
                                        ]
                                    ),
                                )
                            ]
                        ),
                    ),
                ]
            ),
        ),
    ]
)


def get_task(task: str) -> SyntheticTask:
    """Look a task up by name; the error lists the known tasks."""
    if task not in TASKS:
        raise ValueError(
            f"unknown synthetic task {task!r}; expected one of {sorted(TASKS) + [LOOKUP_TASK, ARITH_TASK]}"
        )
    return TASKS[task]


def lookup_rows(num_prompts: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """Rows of the lookup task: key and value digits drawn independently, each balanced over 0-9 (shuffled rounds),
    so neither the prompt nor the value's frequency gives the answer away. The row's store holds a value under every
    key 0-9 (a permutation of the digits with the answer under the prompt's key): a call with another key gets
    another value, never the answer."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    keys: list[int] = []
    values: list[int] = []
    while len(keys) < num_prompts:
        keys.extend(rng.sample(range(10), k=10))
        values.extend(rng.sample(range(10), k=10))
    stores = []
    for key, value in zip(keys[:num_prompts], values[:num_prompts]):
        others = [str(d) for d in rng.sample([d for d in range(10) if d != value], k=9)]
        stores.append(others[:key] + [str(value)] + others[key:])
    return [
        {
            "data_source": DATA_SOURCE_PREFIX + LOOKUP_TASK,
            "prompt": [{"role": "user", "content": f"lookup: {key}"}],
            "ability": ABILITY,
            "reward_model": {"style": "rule", "ground_truth": str(value)},
            "extra_info": {
                "split": split,
                "index": index,
                "task": LOOKUP_TASK,
                "tools_kwargs": {"lookup": {"create_kwargs": {"key": key, "value": str(value), "store": store}}},
            },
        }
        for index, (key, value, store) in enumerate(zip(keys, values, stores))
    ]


def synthetic_rows(num_prompts: int, seed: int, task: str = "copy_digit", split: str = "train") -> list[dict[str, Any]]:
    """Generate `num_prompts` rows of `task` in verl's row layout, deterministically from `seed`.

    Digits are drawn in shuffled rounds over all possible values (0-9 for one digit), so every answer is equally
    frequent: an unbalanced set would let the policy collect reward by always giving the most common answer.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    spec = get_task(task)
    rng = random.Random(seed)
    space = 10**spec.num_digits
    values: list[int] = []
    while len(values) < num_prompts:
        # Sample a round without replacement (all of it for 1 digit; a 10-value slice when the space is large).
        values.extend(rng.sample(range(space), k=min(space, 10)))
    rows = []
    for index, value in enumerate(values[:num_prompts]):
        digits = str(value).zfill(spec.num_digits)
        rows.append(
            {
                "data_source": spec.data_source,
                "prompt": [{"role": "user", "content": f"{spec.instruction}: {digits}"}],
                "ability": ABILITY,
                "reward_model": {"style": "rule", "ground_truth": spec.answer(digits)},
                "extra_info": {"split": split, "index": index, "task": spec.name},
            }
        )
    return rows


def write_parquet_atomically(table: pa.Table, path: str) -> None:
    """Write `table` to `path` via a temporary file in the same directory and `os.replace`, so readers never see a
    half-written file and a crash leaves any previous file intact."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(prefix=".tmp_", suffix=".parquet", dir=directory)
    os.close(fd)
    try:
        pq.write_table(table, tmp_path)
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


def write_synthetic_dataset(
    path: str, num_prompts: int, seed: int, task: str = "copy_digit", split: str = "train"
) -> str:
    """Write `num_prompts` rows of a synthetic task to a parquet file at `path` in verl's schema.

    Args:
        path: output parquet file; written atomically (temporary file, then rename).
        num_prompts: number of rows.
        seed: determines the rows; the same (num_prompts, seed, task, split) always gives the same file content.
        task: one of `TASKS` ("copy_digit", "copy_digits", "successor"), "lookup" (the multi-turn tool task) or
            "arith_add" (addition questions for a real chat model: data/arithmetic.py).
        split: stored in `extra_info.split` ("train", "test", ...). Use a different seed for a test split.

    Returns:
        `path`, for chaining into a config.
    """
    if task == LOOKUP_TASK:
        table = pa.Table.from_pylist(lookup_rows(num_prompts, seed, split), schema=LOOKUP_SCHEMA)
    elif task == ARITH_TASK:  # a real chat model's task (data/arithmetic.py)
        table = pa.Table.from_pylist(arithmetic_rows(num_prompts, seed, split), schema=SYNTHETIC_SCHEMA)
    else:
        table = pa.Table.from_pylist(synthetic_rows(num_prompts, seed, task, split), schema=SYNTHETIC_SCHEMA)
    write_parquet_atomically(table, path)
    return path


PREFERENCE_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(MESSAGE_TYPE)),
        ("chosen", pa.list_(MESSAGE_TYPE)),
        ("rejected", pa.list_(MESSAGE_TYPE)),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("task", pa.string())])),
    ]
)


def write_synthetic_preferences(path: str, num_pairs: int, seed: int, task: str = "copy_digit") -> str:
    """Write DPO pairs derived from `task` (see `data/preference.py`): chosen = the right answer, rejected = a wrong
    one of the same length (each digit shifted by a random non-zero amount); prompts and ground truth as in
    `synthetic_rows`, so the rule reward scores the policy's samples on them. Written atomically; returns `path`."""
    rng = random.Random(f"preferences:{seed}")
    rows = []
    for row in synthetic_rows(num_pairs, seed, task):
        answer = row["reward_model"]["ground_truth"]
        wrong = "".join(str((int(d) + rng.randint(1, 9)) % 10) for d in answer)
        rows.append(
            {
                **row,
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
        )
    write_parquet_atomically(pa.Table.from_pylist(rows, schema=PREFERENCE_SCHEMA), path)
    return path


def main(argv: list[str] | None = None) -> int:
    """CLI: write a synthetic dataset (see the module docstring)."""
    parser = argparse.ArgumentParser(description="Write a synthetic RL prompt dataset (verl parquet schema).")
    parser.add_argument("path", help="output .parquet file")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", default="copy_digit", choices=sorted(TASKS) + [LOOKUP_TASK, ARITH_TASK])
    parser.add_argument("--split", default="train")
    args = parser.parse_args(argv)
    write_synthetic_dataset(args.path, args.num_prompts, args.seed, args.task, args.split)
    print(f"wrote {args.num_prompts} {args.task} prompts to {args.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
