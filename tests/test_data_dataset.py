"""Tests for the synthetic parquet writer, the verl-schema PromptDataset and the resumable PromptLoader."""

import os
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mcore_rl.data import synthetic
from mcore_rl.data.dataset import DatasetSchemaError, PromptDataset, PromptLoader
from mcore_rl.data.synthetic import TASKS, synthetic_rows, write_synthetic_dataset
from mcore_rl.data.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(None)


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def _good_row(content="repeat: 1", truth="1"):
    return {
        "data_source": "synthetic/copy_digit",
        "prompt": [{"role": "user", "content": content}],
        "ability": "synthetic",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": 0},
    }


# --- synthetic writer --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", sorted(TASKS))
def test_synthetic_dataset_written_then_read_back_equals(tmp_path, task):
    path = write_synthetic_dataset(str(tmp_path / "train.parquet"), num_prompts=25, seed=3, task=task)
    table = pq.read_table(path)
    assert table.schema.equals(synthetic.SYNTHETIC_SCHEMA)
    assert table.to_pylist() == synthetic_rows(25, seed=3, task=task)
    assert sorted(os.listdir(tmp_path)) == ["train.parquet"], "temporary file left behind"


def test_synthetic_rows_are_deterministic_balanced_and_correct():
    rows = synthetic_rows(40, seed=7, task="copy_digit")
    assert rows == synthetic_rows(40, seed=7, task="copy_digit")
    assert rows != synthetic_rows(40, seed=8, task="copy_digit")
    # Every answer equally frequent: a skewed set would reward always answering the most common digit.
    assert Counter(r["reward_model"]["ground_truth"] for r in rows) == Counter({str(d): 4 for d in range(10)})
    for row in rows:
        assert row["prompt"][0]["content"] == "repeat: " + row["reward_model"]["ground_truth"]
    successor = synthetic_rows(10, seed=0, task="successor")
    assert {(r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in successor} >= {("next: 9", "0")}


def test_synthetic_write_failure_leaves_previous_file_intact(tmp_path, monkeypatch):
    path = write_synthetic_dataset(str(tmp_path / "d.parquet"), 10, seed=0)
    before = pq.read_table(path).to_pylist()

    def broken_write(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(synthetic.pq, "write_table", broken_write)
    with pytest.raises(OSError, match="disk full"):
        write_synthetic_dataset(path, 20, seed=1)
    assert pq.read_table(path).to_pylist() == before
    assert sorted(os.listdir(tmp_path)) == ["d.parquet"]


def test_synthetic_unknown_task_error_lists_known_tasks():
    with pytest.raises(ValueError, match="copy_digit"):
        synthetic_rows(4, seed=0, task="sorting")


# --- PromptDataset -----------------------------------------------------------------------------------------------


def test_dataset_items_match_the_written_rows(tmp_path, tokenizer):
    path = write_synthetic_dataset(str(tmp_path / "d.parquet"), 12, seed=0)
    dataset = PromptDataset(path, tokenizer, max_prompt_length=32)
    rows = synthetic_rows(12, seed=0)
    assert len(dataset) == 12
    for i, (item, row) in enumerate(zip(dataset, rows)):
        assert item["index"] == i
        assert item["raw_prompt"] == row["prompt"]
        assert item["data_source"] == row["data_source"]
        assert item["ground_truth"] == row["reward_model"]["ground_truth"]
        assert item["extra_info"] == row["extra_info"]
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        assert item["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)


def test_dataset_concatenates_files_and_defaults_missing_optional_columns(tmp_path, tokenizer):
    first = write_synthetic_dataset(str(tmp_path / "a.parquet"), 3, seed=0)
    minimal = [{k: v for k, v in _good_row("next: 4", "5").items() if k not in ("ability", "extra_info")}]
    second = _write(tmp_path / "b.parquet", minimal)
    dataset = PromptDataset([first, second], tokenizer, max_prompt_length=32)
    assert len(dataset) == 4
    assert dataset[3]["ground_truth"] == "5" and dataset[3]["extra_info"] == {} and dataset[3]["index"] == 3


def test_dataset_accepts_integer_ground_truth(tmp_path, tokenizer):
    row = _good_row()
    row["reward_model"] = {"style": "rule", "ground_truth": 42}
    dataset = PromptDataset(_write(tmp_path / "d.parquet", [row]), tokenizer, max_prompt_length=32)
    assert dataset[0]["ground_truth"] == "42"


def _without(row, key):
    return {k: v for k, v in row.items() if k != key}


SCHEMA_CASES = {
    "missing_prompt": (lambda r: _without(r, "prompt"), "'prompt'"),
    "prompt_is_string": (lambda r: {**r, "prompt": "repeat: 1"}, "'prompt'"),
    "prompt_list_of_strings": (lambda r: {**r, "prompt": ["repeat: 1"]}, "'prompt'"),
    "message_without_content": (lambda r: {**r, "prompt": [{"role": "user", "text": "hi"}]}, "prompt[].content"),
    "missing_reward_model": (lambda r: _without(r, "reward_model"), "'reward_model'"),
    "missing_ground_truth": (lambda r: {**r, "reward_model": {"style": "rule"}}, "'reward_model'"),
    "float_ground_truth": (lambda r: {**r, "reward_model": {"style": "rule", "ground_truth": 1.5}}, "ground_truth"),
    "missing_data_source": (lambda r: _without(r, "data_source"), "'data_source'"),
    "extra_info_not_struct": (lambda r: {**r, "extra_info": "train"}, "'extra_info'"),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_schema_errors_name_the_file_and_column(tmp_path, tokenizer, case):
    mutate, column = SCHEMA_CASES[case]
    path = _write(tmp_path / f"{case}.parquet", [mutate(_good_row())])
    with pytest.raises(DatasetSchemaError) as info:
        PromptDataset(path, tokenizer, max_prompt_length=32)
    assert path in str(info.value) and column in str(info.value)


def test_null_values_in_a_row_are_reported_with_file_and_row(tmp_path, tokenizer):
    rows = [_good_row(), _good_row()]
    rows[1]["reward_model"] = {"style": "rule", "ground_truth": None}
    path = _write(tmp_path / "nulls.parquet", rows)
    with pytest.raises(DatasetSchemaError, match=r"nulls\.parquet: row 1: column 'reward_model\.ground_truth'"):
        PromptDataset(path, tokenizer, max_prompt_length=32)


def test_unreadable_and_missing_files_are_named(tmp_path, tokenizer):
    bad = tmp_path / "not_parquet.parquet"
    bad.write_text("data_source,prompt\n")
    with pytest.raises(DatasetSchemaError, match="not_parquet.parquet"):
        PromptDataset(str(bad), tokenizer, max_prompt_length=32)
    with pytest.raises(FileNotFoundError, match="nowhere.parquet"):
        PromptDataset(str(tmp_path / "nowhere.parquet"), tokenizer, max_prompt_length=32)


def test_overlong_prompts_raise_or_are_dropped_and_counted(tmp_path, tokenizer):
    rows = [_good_row("repeat: 1", "1"), _good_row("repeat: " + "1" * 30, "1"), _good_row("repeat: 2", "2")]
    path = _write(tmp_path / "long.parquet", rows)
    with pytest.raises(ValueError, match=r"long\.parquet: row 1: prompt is \d+ tokens"):
        PromptDataset(path, tokenizer, max_prompt_length=20, overlong="error")
    dataset = PromptDataset(path, tokenizer, max_prompt_length=20, overlong="drop")
    assert dataset.num_dropped == 1
    assert [item["ground_truth"] for item in dataset] == ["1", "2"]
    assert [item["index"] for item in dataset] == [0, 1]


# --- PromptLoader ------------------------------------------------------------------------------------------------


def _indices(batch):
    return [item["index"] for item in batch]


def test_loader_resumes_at_the_same_position_after_state_dict_round_trip():
    dataset = [{"index": i} for i in range(10)]
    reference = PromptLoader(dataset, batch_size=3, seed=5)
    expected = [_indices(next(reference)) for _ in range(8)]

    first = PromptLoader(dataset, batch_size=3, seed=5)
    seen = [_indices(next(first)) for _ in range(4)]  # stops mid-epoch 1
    state = first.state_dict()
    assert (state["epoch"], state["index"]) == (1, 3)
    resumed = PromptLoader(dataset, batch_size=3, seed=5)
    resumed.load_state_dict(dict(state))
    seen += [_indices(next(resumed)) for _ in range(4)]
    assert seen == expected


def test_epochs_reshuffle_deterministically_and_cover_every_item_once():
    dataset = [{"index": i} for i in range(12)]
    loader = PromptLoader(dataset, batch_size=4, seed=0)
    assert len(loader) == 3
    epochs = [[i for _ in range(3) for i in _indices(next(loader))] for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(12))
    assert epochs[0] != epochs[1] != epochs[2]
    again = PromptLoader(dataset, batch_size=4, seed=0)
    assert [i for _ in range(9) for i in _indices(next(again))] == [i for order in epochs for i in order]
    other_seed = PromptLoader(dataset, batch_size=4, seed=1)
    assert [i for _ in range(3) for i in _indices(next(other_seed))] != epochs[0]


def test_drop_last_controls_the_partial_final_batch():
    dataset = [{"index": i} for i in range(10)]
    dropping = PromptLoader(dataset, batch_size=4, seed=0, drop_last=True)
    assert len(dropping) == 2 and [len(next(dropping)) for _ in range(3)] == [4, 4, 4]
    keeping = PromptLoader(dataset, batch_size=4, seed=0, drop_last=False, shuffle=False)
    assert len(keeping) == 3 and [_indices(next(keeping)) for _ in range(3)][-1] == [8, 9]
    assert keeping.state_dict()["epoch"] == 1


def test_loader_refuses_state_from_a_different_dataset_or_seed():
    loader = PromptLoader([{"index": i} for i in range(10)], batch_size=2, seed=0)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="dataset_size=10"):
        PromptLoader([{"index": i} for i in range(11)], batch_size=2, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0"):
        PromptLoader([{"index": i} for i in range(10)], batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        loader.load_state_dict({"epoch": 0})


# --- another dataset of the same size, and prompts that train on nothing ------------------------------


def test_resume_onto_other_data_files_of_the_same_size_is_refused(tmp_path, tokenizer):
    a = _write(tmp_path / "a.parquet", [_good_row("repeat: 1", "1"), _good_row("repeat: 2", "2")])
    b = _write(tmp_path / "b.parquet", [_good_row("repeat: 3", "3"), _good_row("repeat: 4", "4")])
    moved = tmp_path / "moved.parquet"
    moved.write_bytes(open(a, "rb").read())
    state = PromptLoader(PromptDataset(a, tokenizer, 64), batch_size=1, seed=0).state_dict()
    PromptLoader(PromptDataset(str(moved), tokenizer, 64), batch_size=1, seed=0).load_state_dict(state)  # same bytes
    with pytest.raises(ValueError, match="loader state was saved for other data files"):
        PromptLoader(PromptDataset(b, tokenizer, 64), batch_size=1, seed=0).load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "data_fingerprint"}  # a checkpoint written before the fingerprint
    PromptLoader(PromptDataset(b, tokenizer, 64), batch_size=1, seed=0).load_state_dict(older)


def test_prompts_of_unknown_characters_or_without_a_user_message_warn_with_the_fraction(tmp_path, tokenizer, caplog):
    system_only = dict(_good_row(), prompt=[{"role": "system", "content": "you answer digits"}])
    rows = [_good_row("REPEAT: ÄÖÜ ÄÖÜ ÄÖÜ ÄÖÜ"), _good_row(), _good_row(), system_only]
    with caplog.at_level("WARNING", logger="mcore_rl.data.dataset"):
        PromptDataset(_write(tmp_path / "d.parquet", rows), tokenizer, 64)
    text = caplog.text
    assert "1 of 4 prompts (25%)" in text and "mostly the tokenizer's unknown token '<unk>'" in text
    assert "1 of 4 prompts (25%)" in text and "have no user message" in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mcore_rl.data.dataset"):
        PromptDataset(_write(tmp_path / "good.parquet", [_good_row(), _good_row()]), tokenizer, 64)
    assert not caplog.text
