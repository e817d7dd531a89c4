"""End to end through Ray: the train entry point with real Megatron ranks, a real rollout engine and parquet data.

Also the CLI's answers to bad input: each names what is wrong and exits non-zero before any Ray process starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TRAIN = [sys.executable, "-m", "mcore_rl.train"]


def _train(*overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAIN, *overrides], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_three_step_run_completes_and_writes_metrics(tmp_path: Path):
    run_dir = tmp_path / "run"
    out = _train("trainer.steps=3", f"trainer.run_dir={run_dir}", "data.batch_size=4", "rollout.n=4")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    for key in (
        "reward/mean",
        "response/length",
        "actor/pg_loss",
        "actor/clip_frac",
        "actor/kl_ref",
        "time/generate",
        "time/logprobs",
        "time/update",
        "time/sync",
    ):
        assert key in lines[0], key
    # the engine is synced after every update: one version for the initial load, then one per step
    assert [r["weight_version"] for r in lines] == [2, 3, 4]
    # rollout logprobs come from the engine, old logprobs from Megatron: exact sync makes them agree (fp32)
    assert all(r["rollout/logprob_abs_diff"] < 1e-4 for r in lines)
    assert (run_dir / "copy_digit.parquet").is_file()
    # generation went through sglang-router to the embedded server over HTTP
    assert list((run_dir / "rollout").glob("router-*.log"))
    summary = [line for line in out.stdout.splitlines() if line.startswith("summary:")]
    assert summary and "steps=3" in summary[0]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.no_such_key=1"], "no_such_key"),
        (["actor.world_size=3", "actor.layout.ep=3"], "num_experts=4 is not divisible by ep=3"),
        (["actor.world_size=3"], "world size 3 is not divisible by etp*ep*pp"),
        (["model.hf_config.model_type=gpt_neox"], "unsupported model_type 'gpt_neox'; supported: "),
        (["rollout.top_p=1.5"], "rollout.top_p=1.5 is invalid: expected in (0, 1]"),
        (["model.path=/nonexistent"], "config.json does not exist"),
        (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator='gae' needs a critic: expected critic.enable=true"),
        (["rollout.engine=sglang"], "rollout.engine=sglang cannot run here: "),
        (["rollout.router_policy=fastest"], "rollout.router_policy='fastest' is invalid: expected one of"),
        (["rollout.sglang.ep=3", "rollout.sglang.tp=8"], "rollout.sglang.ep=3 is invalid: expected a divisor"),
        (["sync.transport=pigeon"], "sync.transport='pigeon' is invalid: expected one of ('distributed', 'tensor'"),
        (["sync.bucket_bytes=0"], "sync.bucket_bytes=0 is invalid: expected a positive integer"),
        (
            ["sync.transport=tensor", "rollout.engine=sglang", "rollout.sglang.nnodes=2", "rollout.sglang.tp=16"],
            "the tensor transport shares memory",
        ),
    ],
)
def test_bad_cli_input_names_the_problem_and_exits_nonzero(overrides, message):
    out = _train(*overrides, timeout=120)
    assert out.returncode != 0
    assert message in out.stderr + out.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.adv_estimator=rloo", "rollout.num_engines=2"],
        ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
        ["algorithm.adv_estimator=reinforce_plus_plus"],
        [
            "actor.policy_loss=gspo",
            "actor.clip_ratio_low=3e-4",
            "actor.clip_ratio_high=4e-4",
            "actor.loss_agg_mode=seq-mean-token-mean",
        ],
    ],
    ids=["rloo", "reinforce_pp_baseline", "reinforce_pp", "gspo"],
)
def test_other_algorithms_run_through_the_loop(tmp_path: Path, overrides: list[str]):
    run_dir = tmp_path / "run"
    out = _train("trainer.steps=2", f"trainer.run_dir={run_dir}", "data.batch_size=4", "rollout.n=4", *overrides)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(abs(r["actor/pg_loss"]) < 1e3 and r["actor/grad_norm"] >= 0 for r in lines)


@pytest.mark.slow
def test_default_job_learns(tmp_path: Path):
    # The default job, cut to 75 of its 150 steps: reward rises from ~0.03 (random tokens) as the policy learns to
    # copy the digit. Seeds are fixed, so the run is deterministic on a given torch build.
    out = _train("trainer.steps=75", f"trainer.run_dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reward_first"] < 0.1
    assert summary["reward_last"] - summary["reward_first"] >= 0.25
