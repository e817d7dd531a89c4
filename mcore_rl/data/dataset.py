"""Prompt datasets in verl's parquet schema, and a resumable, deterministically shuffled batch loader.

    parquet files -> validate schema (file, column, expected type) -> rows -> chat template -> token ids
                  -> drop or refuse prompts over max_prompt_length -> PromptDataset
    PromptDataset -> PromptLoader(batch_size, seed) -> list of items per step; state_dict() holds (epoch, index)

verl's schema, which `synthetic.py` writes and verl's GSM8K/MATH preprocessing scripts produce:

    data_source   string                                  picks the reward function
    prompt        list<struct<role: string, content: string>>   chat messages (column name configurable)
    ability       string                                  optional
    reward_model  struct<style: string, ground_truth: string>   ground_truth may also be an integer
    extra_info    struct<...>                             optional, passed through to the reward function

Every item is a dict: `index` (position in the dataset), `prompt_token_ids`, `raw_prompt` (the messages),
`data_source`, `ground_truth` (str), `ability`, `extra_info` (dict, {} when absent).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import random
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

OverlongPolicy = Literal["error", "drop", "left", "right"]


class DatasetSchemaError(ValueError):
    """A dataset file does not follow verl's schema; the message names the file, the column and what was expected."""


def _is_string(dtype: pa.DataType) -> bool:
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype)


def _schema_error(path: str, column: str, expected: str, found: object) -> DatasetSchemaError:
    return DatasetSchemaError(f"{path}: column {column!r}: expected {expected}, found {found}")


def validate_schema(schema: pa.Schema, path: str, prompt_key: str = "prompt") -> None:
    """Check a parquet schema against verl's; raise `DatasetSchemaError` naming the file and column otherwise."""
    names = set(schema.names)
    for column in (prompt_key, "data_source", "reward_model"):
        if column not in names:
            raise DatasetSchemaError(
                f"{path}: missing column {column!r} (verl schema needs {prompt_key!r}, 'data_source', 'reward_model';"
                f" the file has {sorted(names)})"
            )

    prompt_type = schema.field(prompt_key).type
    message_expected = "list<struct<role: string, content: string>> (a list of chat messages)"
    if not (pa.types.is_list(prompt_type) or pa.types.is_large_list(prompt_type)):
        raise _schema_error(path, prompt_key, message_expected, prompt_type)
    message_type = prompt_type.value_type
    if not pa.types.is_struct(message_type):
        raise _schema_error(path, prompt_key, message_expected, prompt_type)
    message_fields = {message_type.field(i).name: message_type.field(i).type for i in range(message_type.num_fields)}
    for key in ("role", "content"):
        if key not in message_fields or not _is_string(message_fields[key]):
            raise _schema_error(path, f"{prompt_key}[].{key}", f"a string field in {message_expected}", prompt_type)

    if not _is_string(schema.field("data_source").type):
        raise _schema_error(path, "data_source", "string", schema.field("data_source").type)

    reward_type = schema.field("reward_model").type
    if not pa.types.is_struct(reward_type) or reward_type.get_field_index("ground_truth") < 0:
        raise _schema_error(path, "reward_model", "struct<style: string, ground_truth: string>", reward_type)
    truth_type = reward_type.field("ground_truth").type
    if not (_is_string(truth_type) or pa.types.is_integer(truth_type)):
        raise _schema_error(path, "reward_model.ground_truth", "string (or integer)", truth_type)

    # An all-null optional column is stored with the null type by pandas; accept it.
    ability_type = schema.field("ability").type if "ability" in names else pa.null()
    if not (_is_string(ability_type) or pa.types.is_null(ability_type)):
        raise _schema_error(path, "ability", "string", ability_type)
    if "extra_info" in names:
        extra_type = schema.field("extra_info").type
        if not (pa.types.is_struct(extra_type) or pa.types.is_null(extra_type)):
            raise _schema_error(path, "extra_info", "struct<...> (a dict per row)", extra_type)


def _read_rows(path: str, prompt_key: str) -> list[dict[str, Any]]:
    """Read one parquet file into rows of plain Python values, validating schema and per-row contents."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetSchemaError(f"{path}: not a readable parquet file ({exc})") from exc
    validate_schema(table.schema, path, prompt_key)

    prompts = table.column(prompt_key).to_pylist()
    data_sources = table.column("data_source").to_pylist()
    reward_models = table.column("reward_model").to_pylist()
    n = table.num_rows
    abilities = table.column("ability").to_pylist() if "ability" in table.column_names else [None] * n
    extra_infos = table.column("extra_info").to_pylist() if "extra_info" in table.column_names else [None] * n

    rows = []
    for row, (messages, source, reward_model) in enumerate(zip(prompts, data_sources, reward_models)):
        # Null checks per row: the schema allows nulls, the trainer does not.
        if not messages:
            raise DatasetSchemaError(f"{path}: row {row}: column {prompt_key!r} is empty or null; expected messages")
        for message in messages:
            if message is None or message.get("role") is None or message.get("content") is None:
                raise DatasetSchemaError(
                    f"{path}: row {row}: column {prompt_key!r} holds a message without role/content: {message!r}"
                )
        blank = [i for i, m in enumerate(messages) if m["role"] == "user" and not str(m["content"]).strip()]
        if blank or not any(str(m["content"]).strip() for m in messages):
            raise DatasetSchemaError(
                f"{path}: row {row}: column {prompt_key!r} has a prompt with empty content "
                f"(message {blank[0] if blank else 0}); expected text to answer"
            )
        if source is None:
            raise DatasetSchemaError(f"{path}: row {row}: column 'data_source' is null")
        if reward_model is None or reward_model.get("ground_truth") is None:
            raise DatasetSchemaError(f"{path}: row {row}: column 'reward_model.ground_truth' is null")
        rows.append(
            {
                "raw_prompt": messages,
                "data_source": source,
                "ground_truth": str(reward_model["ground_truth"]),
                "ability": abilities[row],
                "extra_info": extra_infos[row] or {},
                "_source": (path, row),
            }
        )
    return rows


class PromptDataset(Sequence[dict[str, Any]]):
    """Prompts from one or more verl-schema parquet files, chat-templated and tokenized up front.

    Tokenizing eagerly (as verl's `filter_overlong_prompts` does) makes schema and length errors surface before the
    first rollout rather than hours into a run.
    """

    def __init__(
        self,
        paths: str | Sequence[str],
        tokenizer: PreTrainedTokenizerBase,
        max_prompt_length: int,
        overlong: OverlongPolicy = "error",
        prompt_key: str = "prompt",
    ) -> None:
        """Read, validate and tokenize the files.

        Args:
            paths: one parquet file or several (rows are concatenated in the given order).
            tokenizer: an HF tokenizer with a chat template; the generation prompt is appended to each prompt.
            max_prompt_length: longest prompt, in tokens, after the chat template.
            overlong: "error" raises on the first longer prompt (naming file, row and length); "drop" skips them,
                logs how many, and records the count in `num_dropped`; "left" keeps a longer prompt's last
                max_prompt_length tokens, "right" its first ones (verl's data.truncation).
            prompt_key: name of the messages column (verl's `data.prompt_key`).
        """
        if overlong not in ("error", "drop", "left", "right"):
            raise ValueError(f"overlong must be 'error', 'drop', 'left' or 'right', got {overlong!r}")
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template; prompts need one")
        self.paths: list[str] = [paths] if isinstance(paths, str) else list(paths)
        if not self.paths:
            raise ValueError("PromptDataset needs at least one parquet file")

        rows = [row for path in self.paths for row in _read_rows(path, prompt_key)]
        texts = [
            tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=False) for row in rows
        ]
        # The template already wrote every special token; a second bos/eos from the tokenizer would be wrong.
        token_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

        self.num_dropped = 0
        self._items: list[dict[str, Any]] = []
        for row, ids in zip(rows, token_ids):
            path, row_index = row.pop("_source")
            if len(ids) > max_prompt_length:
                if overlong == "error":
                    raise ValueError(
                        f"{path}: row {row_index}: prompt is {len(ids)} tokens after the chat template, longer than "
                        f"max_prompt_length={max_prompt_length} (raise it, or set overlong='drop')"
                    )
                if overlong in ("left", "right"):  # verl's truncation: the template's tokens are cut as well
                    ids = ids[-max_prompt_length:] if overlong == "left" else ids[:max_prompt_length]
                else:
                    self.num_dropped += 1
                    continue
            self._items.append({"index": len(self._items), "prompt_token_ids": list(ids), **row})
        if self.num_dropped:
            logger.warning(
                "dropped %d of %d prompts longer than max_prompt_length=%d from %s",
                self.num_dropped,
                len(rows),
                max_prompt_length,
                self.paths,
            )
        if not self._items:
            raise ValueError(f"no prompts left in {self.paths} (read {len(rows)}, dropped {self.num_dropped})")

        _warn_suspicious(rows, token_ids, tokenizer, self.paths)

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the data files' bytes, in order (see `data_fingerprint`)."""
        return data_fingerprint(self.paths)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        # A shallow copy, so a caller adding keys to an item does not change the dataset.
        if isinstance(index, slice):
            return [dict(item) for item in self._items[index]]  # type: ignore[return-value]
        return dict(self._items[index])


def data_fingerprint(paths: Sequence[str]) -> str:
    """The identity of a list of data files: sha256 over their bytes in order (not their names, so a moved copy is
    the same data). A resume compares it: another dataset of the same size would give the saved position another
    meaning."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")  # file boundaries count: [ab] is not [a, b]
    return digest.hexdigest()


def _warn_suspicious(rows: list[dict[str, Any]], token_ids: list[list[int]], tokenizer: Any, paths: list[str]) -> None:
    """Warn (once per dataset, with the fraction) about prompts that train on nothing useful: mostly the tokenizer's
    unknown token (a tokenizer that does not match the data), or a chat with no user message (only a system one)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None:
        mostly_unknown = sum(1 for ids in token_ids if ids and 2 * sum(t == unk for t in ids) > len(ids))
        if mostly_unknown:
            logger.warning(
                "%d of %d prompts (%.0f%%) in %s are mostly the tokenizer's unknown token %r: the tokenizer does not "
                "cover their characters (another language or alphabet?); expected a tokenizer that matches the data",
                mostly_unknown, len(token_ids), 100 * mostly_unknown / len(token_ids), paths, tokenizer.unk_token,
            )  # fmt: skip
    no_user = sum(1 for row in rows if not any(m["role"] == "user" for m in row["raw_prompt"]))
    if no_user:
        logger.warning(
            "%d of %d prompts (%.0f%%) in %s have no user message (only system or assistant ones): the model is "
            "asked nothing; expected a chat with a user turn",
            no_user, len(rows), 100 * no_user / len(rows), paths,
        )  # fmt: skip


def check_same_data(saved: str | None, current: str | None) -> None:
    """Refuse a resume onto other data files (ValueError); a side without a fingerprint (an older checkpoint, a
    dataset that is not files) is not compared."""
    if saved is not None and current is not None and saved != current:
        raise ValueError(
            f"loader state was saved for other data files (sha256 {saved[:12]}..., data.train_files now hash to "
            f"{current[:12]}...); resuming would hand out other prompts at the saved position: expected the files "
            "the run started with, or a new run (trainer.resume=null and another trainer.run_dir)"
        )


class PromptLoader(Iterator[list[dict[str, Any]]]):
    """Endless batches over a dataset, reshuffled each epoch from (seed, epoch), resumable mid-epoch.

    The order of epoch e depends only on (seed, epoch), never on how many batches were drawn before, so restoring
    `state_dict()` = {epoch, index} continues exactly where the saved run would have continued, and a different
    batch size after a resume still sees each prompt once per epoch.
    """

    def __init__(
        self,
        dataset: Sequence[dict[str, Any]],
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        """Args:
        dataset: any sequence of items (usually a `PromptDataset`).
        batch_size: prompts per batch (before the rollout's n samples per prompt).
        seed: shuffling seed; epochs use (seed, epoch).
        shuffle: False keeps dataset order every epoch.
        drop_last: drop a final partial batch in each epoch (GRPO steps expect a fixed batch size).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > len(dataset):
            raise ValueError(f"batch_size={batch_size} is larger than the dataset ({len(dataset)} prompts)")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.index = 0  # position in this epoch's order of the next item to hand out
        self._order_cache: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int) -> list[int]:
        """Dataset indices in the order epoch `epoch` visits them (a pure function of seed and epoch)."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        order = list(range(len(self.dataset)))
        if self.shuffle:
            # A str seed is hashed with SHA-512 by `random`, so the order is the same across processes and Python
            # runs (unlike hash()), and seeds (s, e) never collide the way s + e would.
            random.Random(f"mcore_rl.PromptLoader:{self.seed}:{epoch}").shuffle(order)
        self._order_cache = (epoch, order)
        return order

    def _epoch_end(self) -> int:
        """Index in the epoch's order after which the epoch ends (a partial final batch is dropped if asked)."""
        n = len(self.dataset)
        return n - n % self.batch_size if self.drop_last else n

    def __next__(self) -> list[dict[str, Any]]:
        """The next batch; moves into the next epoch (reshuffled) when this one is used up. Never stops."""
        if self.index >= self._epoch_end():
            self.epoch, self.index = self.epoch + 1, 0
        order = self.epoch_order(self.epoch)
        end = min(self.index + self.batch_size, self._epoch_end())
        batch = [self.dataset[i] for i in order[self.index : end]]
        self.index = end
        # Normalise eagerly, so that a state saved right after an epoch's last batch reads (epoch + 1, 0).
        if self.index >= self._epoch_end():
            self.epoch, self.index = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, int | bool]:
        """Position and the settings it depends on; store it in the training checkpoint."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_size": len(self.dataset),
            "data_fingerprint": getattr(self.dataset, "fingerprint", None),  # data_fingerprint; None: not files
        }

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Resume at a saved position. Refuses a state saved for another dataset size, seed or shuffle setting, or
        other data files (when both sides know their fingerprint), because the saved index would then point into a
        different order."""
        missing = {"epoch", "index", "seed", "shuffle", "dataset_size"} - set(state)
        if missing:
            raise ValueError(f"loader state is missing {sorted(missing)}; got keys {sorted(state)}")
        for key, current in (("dataset_size", len(self.dataset)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state[key] != current:
                raise ValueError(
                    f"loader state was saved with {key}={state[key]!r} but this loader has {key}={current!r}; "
                    "resuming would not continue the same order"
                )
        check_same_data(state.get("data_fingerprint"), getattr(self.dataset, "fingerprint", None))
        if not 0 <= int(state["index"]) <= len(self.dataset) or int(state["epoch"]) < 0:
            raise ValueError(f"loader state position out of range: epoch={state['epoch']}, index={state['index']}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
