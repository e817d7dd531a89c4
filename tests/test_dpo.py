"""DPO: the pair losses against a hand-written reference, the preference data (synthetic pairs, bad files), the config's
refusals, and (slow) the `--config-name dpo` run on real Megatron ranks learning to prefer `chosen`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _compose import assert_config_refused
from _ray_cluster import ray_address_override, train_env

from mcore_rl.algorithms.dpo import DPO_LOSSES, dpo_loss, sequence_logprobs
from mcore_rl.controller.dpo_loop import pairs_to_batch
from mcore_rl.data.dataset import DatasetSchemaError
from mcore_rl.data.preference import PreferenceDataset
from mcore_rl.data.synthetic import write_synthetic_preferences
from mcore_rl.data.tokenizer import build_tiny_tokenizer

TRAIN = [sys.executable, "-m", "mcore_rl.train", "--config-name", "dpo"]

# Two pairs of token logprobs [pairs, R] with masks: pair 0 has 3 and 2 response tokens, pair 1 has 1 and 3.
POLICY_C = [[-0.5, -1.0, -0.2], [-2.0, 0.0, 0.0]]
POLICY_R = [[-1.5, -0.3, 0.0], [-0.7, -0.1, -0.9]]
REF_C = [[-0.6, -1.1, -0.4], [-1.0, 0.0, 0.0]]
REF_R = [[-1.0, -0.2, 0.0], [-0.9, -0.5, -0.4]]
LEN_C, LEN_R = [3, 1], [2, 3]


def _reference(kind: str, beta: float) -> list[float]:
    """The losses written out per pair with Python floats, straight from the DPO and IPO papers."""
    out = []
    for i in range(2):
        agg = (lambda xs, n: sum(xs[:n]) / n) if kind == "ipo" else (lambda xs, n: sum(xs[:n]))
        pc, pr = agg(POLICY_C[i], LEN_C[i]), agg(POLICY_R[i], LEN_R[i])
        rc, rr = agg(REF_C[i], LEN_C[i]), agg(REF_R[i], LEN_R[i])
        h = (pc - rc) - (pr - rr)
        out.append(math.log(1 + math.exp(-beta * h)) if kind == "sigmoid" else (h - 1 / (2 * beta)) ** 2)
    return out


@pytest.mark.parametrize("kind", sorted(DPO_LOSSES))
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_losses_equal_the_hand_written_reference(kind: str, beta: float):
    def mask(lengths: list[int]) -> torch.Tensor:
        return (torch.arange(3)[None, :] < torch.tensor(lengths)[:, None]).float()

    norm = DPO_LOSSES[kind].length_normalized
    seq = {
        name: sequence_logprobs(torch.tensor(values), mask(lengths), norm)
        for name, values, lengths in (
            ("pc", POLICY_C, LEN_C),
            ("pr", POLICY_R, LEN_R),
            ("rc", REF_C, LEN_C),
            ("rr", REF_R, LEN_R),
        )
    }
    out = dpo_loss(kind, seq["pc"], seq["pr"], seq["rc"], seq["rr"], beta)
    torch.testing.assert_close(out.losses, torch.tensor(_reference(kind, beta)), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.chosen_rewards, beta * (seq["pc"] - seq["rc"]))
    margins = out.chosen_rewards - out.rejected_rewards
    assert float(out.metrics()["dpo/rewards_accuracy"]) == float((margins > 0).sum())


def test_dpo_loss_gradient_raises_chosen_and_lowers_rejected():
    chosen = torch.tensor([-2.0], requires_grad=True)
    rejected = torch.tensor([-2.0], requires_grad=True)
    dpo_loss("sigmoid", chosen, rejected, torch.tensor([-2.0]), torch.tensor([-2.0]), 0.1).losses.sum().backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()  # descent raises log pi(chosen), lowers log pi(rejected)


def test_synthetic_pairs_prefer_the_right_answer(tmp_path: Path):
    tokenizer = build_tiny_tokenizer()
    path = write_synthetic_preferences(str(tmp_path / "pairs.parquet"), 20, seed=0)
    data = PreferenceDataset(path, tokenizer, max_prompt_length=64, max_length=511)
    assert len(data) == 20
    for item in data:
        chosen = tokenizer.decode(item["chosen_ids"], skip_special_tokens=True)
        rejected = tokenizer.decode(item["rejected_ids"], skip_special_tokens=True)
        assert chosen == item["ground_truth"] != rejected
        assert item["chosen_ids"][-1] == item["rejected_ids"][-1] == tokenizer.eos_token_id
    batch = pairs_to_batch([data[0], data[1]])
    assert batch.size == 4 and batch.prompts[0] == batch.prompts[1] == data[0]["prompt_token_ids"]
    assert batch.responses[0, :2].tolist() == data[0]["chosen_ids"]
    assert batch.responses[1, :2].tolist() == data[0]["rejected_ids"]


def test_string_columns_are_accepted(tmp_path: Path):
    path = tmp_path / "strings.parquet"
    pq.write_table(pa.table({"prompt": ["repeat: 3"], "chosen": ["3"], "rejected": ["4"]}), path)
    tokenizer = build_tiny_tokenizer()
    item = PreferenceDataset(str(path), tokenizer, 64, 511)[0]
    assert tokenizer.decode(item["prompt_token_ids"]).endswith("repeat: 3<|im_end|>\n<|im_start|>assistant\n")
    assert item["data_source"] is None  # no reward columns: the loop skips scoring


@pytest.mark.parametrize(
    "table, message",
    [
        (pa.table({"prompt": ["a"], "chosen": ["b"]}), "missing column 'rejected'"),
        (pa.table({"prompt": ["a"], "chosen": [1], "rejected": ["c"]}), "column 'chosen': expected a string or"),
        (
            pa.table({"prompt": ["a", "b"], "chosen": ["b", "c"], "rejected": pa.array(["d", None], pa.string())}),
            "row 1: column 'rejected' is empty",
        ),
    ],
)
def test_bad_preference_files_name_file_and_column(tmp_path: Path, table: pa.Table, message: str):
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    with pytest.raises(DatasetSchemaError, match=str(path)) as err:
        PreferenceDataset(str(path), build_tiny_tokenizer(), 64, 511)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dpo.loss_type=kto"], "dpo.loss_type='kto' is invalid: expected one of ['ipo', 'sigmoid']"),
        (["dpo.beta=0"], "dpo.beta=0"),
        (["actor.micro_batch_size=3"], "actor.micro_batch_size=3 is invalid: expected even"),
        (["trainer.mode=sft"], "trainer.mode='sft' is invalid"),
    ],
)
def test_dpo_config_refusals(overrides: list[str], message: str):
    assert_config_refused([*TRAIN[3:], *overrides], message)  # --config-name dpo ...


def test_dpo_refuses_a_reward_model_it_would_not_use(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run([*TRAIN, f"reward.model_path={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"reward.model_path='{tmp_path}' is invalid: expected null for trainer.mode=dpo" in out.stderr


def test_dpo_data_without_rejected_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"prompt": ["repeat: 1"], "chosen": ["1"]}), path)
    out = subprocess.run(
        [*TRAIN, f"dpo.train_files=[{path}]", f"trainer.run_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{path}: missing column 'rejected'" in out.stderr


@pytest.mark.slow
def test_dpo_run_learns_to_prefer_chosen(tmp_path: Path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [*TRAIN, "trainer.steps=30", f"trainer.run_dir={run_dir}", "rollout.n=2", ray_address_override()],
        capture_output=True,
        text=True,
        timeout=600,
        env=train_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Step 1's update starts from policy == reference: every implicit reward is 0 and the loss is exactly log 2,
    # which holds only if the Megatron ranks pair each chosen sequence with its own rejected one and its reference.
    assert rows[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[0]["dpo/rewards_margin"] == pytest.approx(0.0, abs=1e-5)
    first, last = rows[:3], rows[-3:]

    def mean(part: list[dict], key: str) -> float:
        return sum(r[key] for r in part) / len(part)

    assert mean(last, "dpo/rewards_margin") > mean(first, "dpo/rewards_margin") + 0.1
    assert mean(last, "dpo/rewards_accuracy") > mean(first, "dpo/rewards_accuracy")
    assert mean(last, "dpo/loss") < math.log(2)
    assert all("critic/score/mean" in r for r in rows)  # the policy's samples were scored after every sync
    assert any(line.startswith("summary: reward_first=") for line in out.stdout.splitlines())
