"""tools/single_process_grpo.py: the one-process reference run of the default job that `profile_step.py --baseline`
prints beside the real loop. It must be the same job, so it must learn the task as the loop does."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

import single_process_grpo  # noqa: E402


@pytest.mark.slow
def test_one_process_run_learns_the_default_task_and_reports_the_loops_phases() -> None:
    records = single_process_grpo.run(60)
    assert len(records) == 60
    phases = {"gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights", "step"}
    assert {k.removeprefix("timing_s/") for k in records[0] if k.startswith("timing_s/")} == phases
    for r in records:
        assert r["timing_s/update_weights"] == 0.0  # the sampler is the trained model: nothing to sync
        assert r["timing_s/step"] == pytest.approx(sum(r[f"timing_s/{p}"] for p in phases - {"step"}))
    first = sum(r["critic/score/mean"] for r in records[:10]) / 10
    last = sum(r["critic/score/mean"] for r in records[-10:]) / 10
    assert first < 0.1 and last > first + 0.1, (first, last)  # a random policy scores ~0.02 on copy_digit
