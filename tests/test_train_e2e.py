"""End to end through Ray: the train entry point with real Megatron ranks, a real rollout engine and parquet data.

Also the CLI's answers to bad input: each names what is wrong and exits non-zero before any Ray process starts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _compose import assert_config_refused

TRAIN = [sys.executable, "-m", "mcore_rl.train"]
#: the default job's API key (MCORE_RL_API_KEY), looked for in every file the run writes
KEY = "k3y-0f-the-short-default-job-9f2c"


def _train(*overrides: str, timeout: int = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAIN, *overrides], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def default_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """The default job cut to 75 of its 150 steps, on a local Ray it starts, validating on two data sources before
    training and every 25 steps, with TensorBoard on and an API key: one run shared by the tests below (each asserts
    its own property of it). Validation changes no training step: the engine seeds each request."""
    from mcore_rl.data.synthetic import write_synthetic_dataset

    root = tmp_path_factory.mktemp("default_job")
    val = [str(root / "copy_digit_val.parquet"), str(root / "successor_val.parquet")]
    write_synthetic_dataset(val[0], 8, seed=7, task="copy_digit", split="test")
    write_synthetic_dataset(val[1], 8, seed=7, task="successor", split="test")
    run_dir = root / "run"
    out = _train(
        "trainer.steps=75", f"trainer.run_dir={run_dir}",
        "trainer.val_before_train=true", "trainer.val_every=25", f"data.val_files=[{val[0]},{val[1]}]",
        "trainer.loggers=[console,jsonl,tensorboard]", env=dict(os.environ, MCORE_RL_API_KEY=KEY),
    )  # fmt: skip
    return out, run_dir


@pytest.mark.slow
def test_the_api_key_reaches_no_file_the_run_writes_nor_its_output(default_job):
    """The key that guards the engines and the router is in no file of the run dir (TensorBoard events, metrics,
    logs, the config it saved) and not on its screen."""
    out, run_dir = default_job
    assert out.returncode == 0, out.stderr[-3000:]
    files = [p for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any("tfevents" in p.name for p in files) and any(p.name == "metrics.jsonl" for p in files)
    assert [str(p) for p in files if KEY.encode() in p.read_bytes()] == []
    assert KEY not in out.stdout + out.stderr


@pytest.mark.slow
def test_the_run_completes_and_writes_metrics(default_job):
    out, run_dir = default_job
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = [r for r in records if "critic/score/mean" in r]  # training steps (step 0: validation only)
    assert [r["step"] for r in lines] == list(range(1, 76))
    for key in (  # verl's names
        "critic/score/mean",
        "response_length/mean",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "timing_s/gen",
        "timing_s/old_log_prob",
        "timing_s/update_actor",
        "timing_s/update_weights",
        "timing_s/step",
        "perf/throughput",
    ):
        assert key in lines[0], key
    # kl_loss_coef is 0 in the default job: no reference model, no reference pass, no KL metrics
    assert "actor/kl_ref" not in lines[0] and "actor/kl_loss" not in lines[0]
    # the engine is synced after every update: one version for the initial load, then one per step
    assert [r["weight_version"] for r in lines] == list(range(2, 77))
    # rollout logprobs come from the engine, old logprobs from Megatron: exact sync makes them agree (fp32)
    assert all(r["rollout/logprob_abs_diff"] < 1e-4 for r in lines)
    assert (run_dir / "copy_digit.parquet").is_file()
    # generation went through sglang-router to the embedded server over HTTP
    assert list((run_dir / "rollout").glob("router-*.log"))
    summary = [line for line in out.stdout.splitlines() if line.startswith("summary:")]
    assert summary and "steps=75" in summary[0]


@pytest.mark.slow
def test_validation_runs_before_training_every_val_every_steps_and_per_data_source(default_job):
    out, run_dir = default_job
    assert out.returncode == 0, out.stderr[-3000:]
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    validated = [s for s, r in records.items() if any(k.startswith("val-core/") for k in r)]
    assert validated == [0, 25, 50, 75]  # before training, then every 25 steps (val_every=25), the last one
    for source in ("synthetic/copy_digit", "synthetic/successor"):
        for metric in ("mean@1", "mean@4", "best@4/mean", "pass@4"):  # greedy; sampled with rollout.val_n=4
            value = records[25][f"val-core/{source}/reward/{metric}"]
            assert 0.0 <= value <= 1.0, (source, metric, value)
        assert f"val-aux/{source}/reward/best@2/mean" in records[25]
    assert records[25]["timing_s/testing"] > 0


@pytest.mark.slow
def test_default_job_prints_only_its_own_lines(default_job):
    # No warning from Megatron, Ray or torch (mcore_rl/_quiet.py), nothing a user must learn to ignore: every line
    # is a metrics line, where the engines are, the broadcast groups per engine GPU, the first weight push, or the
    # summary.
    out, _ = default_job
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    own = ("step=", "summary: ", "weights v1 pushed in ", "rollout engines at ", "weight sync: ", "start-up: ")
    # Ray's raylet says when the disk under its session directory is over 95% full: a true report about the machine
    # (object spilling would fail), which the user must see, not noise from the job. It is the one foreign line let
    # through; it decided a CI run on a machine whose disk had filled.
    machine = re.compile(r"^(\x1b\[\d+m)?\(raylet\)(\x1b\[0m)? .*file_system_monitor\.cc:\d+: \S+ is over \d+% full")
    assert [line for line in lines if not line.startswith(own) and not machine.match(line)] == []
    assert sum(line.startswith("step=") for line in lines) == 76  # validation at step 0, then 75 steps


@pytest.mark.slow
def test_tensorboard_event_files_of_a_run_are_readable(default_job):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, run_dir = default_job
    assert out.returncode == 0, out.stderr[-3000:]
    reader = EventAccumulator(str(run_dir / "tensorboard"))
    reader.Reload()
    assert [e.step for e in reader.Scalars("critic/score/mean")] == list(range(1, 76))
    assert [e.step for e in reader.Scalars("val-core/synthetic/successor/reward/mean@1")] == [0, 25, 50, 75]


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
        (["rollout.router_policy=fastest"], "rollout.router_policy='fastest' is invalid: expected one of"),
        (["rollout.sglang.ep=3", "rollout.sglang.tp=8"], "rollout.sglang.ep=3 is invalid: expected a divisor"),
        (["sync.transport=pigeon"], "sync.transport='pigeon' is invalid: expected one of ('distributed', 'tensor'"),
        (["sync.bucket_bytes=0"], "sync.bucket_bytes=0 is invalid: expected a positive integer"),
        (["trainer.loggers=[console,csv]"], "trainer.loggers=['console', 'csv'] is invalid: expected a list of"),
        (["actor.use_ref=false", "actor.kl_loss_coef=0.1"], "actor.use_ref=false is invalid with actor.kl_loss_coef"),
        (
            ["sync.transport=tensor", "rollout.engine=sglang", "rollout.sglang.nnodes=2", "rollout.sglang.tp=16"],
            "the tensor transport shares memory",
        ),
    ],
)
def test_bad_cli_input_names_the_problem(overrides, message):
    """Each refusal of the config as the command composes it, in this process (tests/_compose.py)."""
    assert_config_refused(overrides, message)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.no_such_key=1"], "no_such_key"),  # the command's keys
        (["actor.world_size=3", "actor.layout.ep=3"], "num_experts=4 is not divisible by ep=3"),  # to_config
        (["rollout.engine=sglang"], "rollout.engine=sglang cannot run here: "),  # the pre-flight
    ],
)
def test_bad_cli_input_exits_2_naming_the_problem(overrides, message):
    """The CLI's answer, a process each, for one refusal of each stage; every other is checked above in-process."""
    out = _train(*overrides, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr + out.stdout


@pytest.mark.slow
def test_default_job_learns(default_job):
    # The default job, cut to 75 of its 150 steps: reward rises from ~0.03 (random tokens) as the policy learns to
    # copy the digit. Seeds are fixed, so the run is deterministic on a given torch build.
    out, run_dir = default_job
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_first"] < 0.1
    assert summary["reward_last"] - summary["reward_first"] >= 0.25
