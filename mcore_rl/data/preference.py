"""Preference pairs for DPO: parquet with `prompt`, `chosen`, `rejected`, tokenized into prompt + two responses.

    parquet -> check columns (file, column, expected type) -> rows -> prompt: chat template + generation prompt
            -> chosen / rejected: the assistant text, tokenized, + eos -> PreferenceDataset (items, see below)

Columns (TRL's and verl's preference layout):

    prompt      string (the user's message) | list<struct<role, content>> (chat messages)
    chosen      string (the preferred answer) | list<struct<role, content>> (one assistant message)
    rejected    same as chosen
    data_source, reward_model.ground_truth   optional: when present, the DPO loop also scores the policy's own
                                             samples on these prompts with the rule reward (its learning curve)

Each item: `index`, `prompt_token_ids`, `chosen_ids`, `rejected_ids` (responses end with eos, as the rollout engine
stops there), `data_source` and `ground_truth` (None when the columns are absent), `extra_info` (dict).
Batches come from `data.dataset.PromptLoader`, which only needs a sequence of items.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerBase

from mcore_rl.data.dataset import DatasetSchemaError

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
_EXPECTED = "a string or a list<struct<role: string, content: string>> (chat messages)"


def _check_column(table: pa.Table, path: str, column: str) -> None:
    if column not in table.column_names:
        raise DatasetSchemaError(
            f"{path}: missing column {column!r} (DPO data needs {list(PAIR_COLUMNS)}; the file has "
            f"{sorted(table.column_names)})"
        )
    dtype = table.schema.field(column).type
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return
    if (pa.types.is_list(dtype) or pa.types.is_large_list(dtype)) and pa.types.is_struct(dtype.value_type):
        names = {dtype.value_type.field(i).name for i in range(dtype.value_type.num_fields)}
        if {"role", "content"} <= names:
            return
    raise DatasetSchemaError(f"{path}: column {column!r}: expected {_EXPECTED}, found {dtype}")


def _response_text(value: Any, path: str, row: int, column: str) -> str:
    """The answer text of a chosen/rejected cell: the string, or the content of its single assistant message."""
    if isinstance(value, str):
        return value
    messages = [m for m in (value or []) if m is not None]
    if len(messages) != 1 or messages[0].get("role") != "assistant" or messages[0].get("content") is None:
        raise DatasetSchemaError(
            f"{path}: row {row}: column {column!r}: expected one assistant message, found {value!r}"
        )
    return messages[0]["content"]


class PreferenceDataset(Sequence[dict[str, Any]]):
    """Preference pairs from parquet files, tokenized up front (errors surface before the first step)."""

    def __init__(
        self, paths: str | Sequence[str], tokenizer: PreTrainedTokenizerBase, max_prompt_length: int, max_length: int
    ) -> None:
        """Args:
        paths: parquet files with the columns above.
        tokenizer: the policy's tokenizer (chat template for the prompt; eos ends each response).
        max_prompt_length: longest prompt in tokens after the chat template (longer: an error naming file and row).
        max_length: longest prompt + response (the model's max_sequence_length - 1).
        """
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        if not self.paths:
            raise ValueError("PreferenceDataset needs at least one parquet file")
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no eos token; DPO responses end with one")
        self._items: list[dict[str, Any]] = []
        for path in self.paths:
            for row, item in enumerate(_read_pairs(path)):
                messages = item["prompt"]
                if isinstance(messages, str):
                    messages = [{"role": "user", "content": messages}]
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                pair = {}
                for column in ("chosen", "rejected"):
                    answer = _response_text(item[column], path, row, column)
                    pair[column] = tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
                longest = len(prompt_ids) + max(len(pair["chosen"]), len(pair["rejected"]))
                if len(prompt_ids) > max_prompt_length or longest > max_length:
                    raise ValueError(
                        f"{path}: row {row}: prompt {len(prompt_ids)} tokens, prompt + longest response {longest}: "
                        f"expected at most data.max_prompt_length={max_prompt_length} and {max_length}"
                    )
                self._items.append(
                    {
                        "index": len(self._items),
                        "prompt_token_ids": prompt_ids,
                        "chosen_ids": pair["chosen"],
                        "rejected_ids": pair["rejected"],
                        "data_source": item["data_source"],
                        "ground_truth": item["ground_truth"],
                        "extra_info": item["extra_info"] or {},
                    }
                )
        if not self._items:
            raise ValueError(f"no preference pairs in {self.paths}")

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        return dict(self._items[index])


def _read_pairs(path: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"DPO dataset file not found: {path}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetSchemaError(f"{path}: not a readable parquet file ({exc})") from exc
    for column in PAIR_COLUMNS:
        _check_column(table, path, column)
    n = table.num_rows
    columns = {c: table.column(c).to_pylist() for c in PAIR_COLUMNS}
    sources = table.column("data_source").to_pylist() if "data_source" in table.column_names else [None] * n
    rewards = table.column("reward_model").to_pylist() if "reward_model" in table.column_names else [None] * n
    extras = table.column("extra_info").to_pylist() if "extra_info" in table.column_names else [None] * n
    rows = []
    for row in range(n):
        for column in PAIR_COLUMNS:
            if columns[column][row] in (None, [], ""):
                raise DatasetSchemaError(f"{path}: row {row}: column {column!r} is empty or null; expected {_EXPECTED}")
        truth = (rewards[row] or {}).get("ground_truth")
        rows.append(
            {
                **{c: columns[c][row] for c in PAIR_COLUMNS},
                "data_source": sources[row],
                "ground_truth": None if truth is None else str(truth),
                "extra_info": extras[row],
            }
        )
    return rows
