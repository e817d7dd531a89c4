"""Placement and async generation end to end: the train entry point with real Megatron ranks, engines and the router.

    colocated   engines release weights + KV cache while the actor trains, resume before the push; the refilled
                weights must be the actor's exactly (rollout vs Megatron logprobs agree)
    split+async the next batch generates while the actor trains: the first batch is fresh, later ones one version old
                (stale samples TIS-corrected), the bound holds
    multi-turn  the tool job runs through the loop: tool tokens are in the responses but not in the trained mask
Run: `.venv/bin/pytest -m slow tests/test_placement_e2e.py`
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _compose import assert_config_refused
from _ray_cluster import ray_address_override, train_env

TRAIN = [sys.executable, "-m", "mcore_rl.train"]
SMALL = ["data.batch_size=4", "rollout.n=4"]


def train(run_dir: Path, *overrides: str, config: str = "default", timeout: int = 600) -> list[dict]:
    cmd = [*TRAIN, "--config-name", config, f"trainer.run_dir={run_dir}", ray_address_override(), *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=train_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert any(line.startswith("summary:") for line in out.stdout.splitlines())
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.long
@pytest.mark.slow
def test_colocated_engines_release_memory_and_get_exact_weights_back(tmp_path: Path):
    rows = train(tmp_path / "run", "trainer.placement=colocated", "trainer.steps=2", *SMALL)
    assert [r["weight_version"] for r in rows] == [2, 3]
    assert all(r["placement/engines_released"] == 1.0 for r in rows)
    # released weights are gone (zeros after resume) until the push refills them: only an exact refill agrees
    assert all(r["rollout/logprob_abs_diff"] < 1e-4 for r in rows)


@pytest.mark.long
@pytest.mark.slow
def test_split_async_generates_one_step_ahead_within_the_bound(tmp_path: Path):
    rows = train(tmp_path / "run", "rollout.max_staleness=1", "trainer.steps=4", *SMALL)
    assert [r["weight_version"] for r in rows] == [2, 3, 4, 5]
    assert rows[0]["async/stale_frac"] == 0.0  # generated on the weights it trains
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert any(r["async/stale_frac"] > 0 for r in rows[1:])  # later batches were generated while training


@pytest.mark.long
@pytest.mark.slow
def test_multiturn_tool_job_runs_with_tool_tokens_masked(tmp_path: Path):
    rows = train(tmp_path / "run", "trainer.steps=2", *SMALL, config="multiturn_tool")
    for r in rows:
        assert 0 < r["agent/model_token_frac"] <= 1 and r["agent/turns"] >= 1
        # the trained length counts model tokens only
        assert r["response_length/mean"] <= 2 * 6
        assert 0 <= r["reward/called_mean"] <= 1 and 0 <= r["reward/acc_mean"] <= 1  # the lookup reward's own


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.placement=nowhere"],
            "trainer.placement='nowhere' is invalid: expected one of ('split', 'colocated')",
        ),
        (["trainer.placement=colocated", "rollout.max_staleness=1"], "rollout.max_staleness=1 is invalid"),
        (["rollout.max_staleness=-1"], "rollout.max_staleness=-1 is invalid"),
        (["agent.tools=[weather]"], "agent.tools='weather' is invalid: expected registered tools"),
        (["agent.chat_format=llama"], "agent.chat_format='llama' is invalid"),
    ],
)
def test_bad_placement_and_agent_settings_are_refused(overrides, message):
    assert_config_refused(overrides, message)


@pytest.mark.long
@pytest.mark.slow
def test_multiturn_tool_job_learns_to_open_the_call(tmp_path: Path):
    # The multi-turn job's first 40 steps: from random tokens (about 1 episode in 16 starts a tool call) to an episode
    # that opens every call with <tool_call> and the lookup JSON head (2 of the call's 5 pieces: reward 0.1 of 1).
    # Measured in 11 runs of reward/config variants: 0.093-0.111 at steps 38-40. The whole job (300 steps, ~10 min
    # here) reaches +0.33 by learning valid calls (README); that is too long for the suite, so the first 40 steps are
    # what is asserted. Fixed seeds.
    rows = train(tmp_path / "run", "trainer.steps=40", config="multiturn_tool", timeout=1200)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reward_first"] < 0.02
    assert summary["reward_last"] >= 0.08
    assert rows[0]["agent/tool_calls"] < 0.2 and rows[-1]["agent/tool_calls"] >= 0.9
