"""Metrics: verl's names from a step's batch, the backends (jsonl, TensorBoard read back by tensorboard's own reader),
the console line and summary, the loggers' config checks, and the warning list of mcore_rl/_quiet.py."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from mcore_rl.actor.batch import TrainBatch
from mcore_rl.metrics.compute import FlopsModel, peak_flops, step_metrics
from mcore_rl.metrics.logger import MetricsLogger


def _batch() -> TrainBatch:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return TrainBatch(
        prompts=[[5, 6], [5, 6, 7, 8]],
        responses=torch.ones(2, 3, dtype=torch.long),
        response_mask=mask,
        tensors={
            "old_logprobs": torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]]),
            "rollout_logprobs": torch.tensor([[-1.5, -2.0, 9.0], [-1.0, -1.0, -0.5]]),
            "advantages": torch.tensor([[1.0, 1.0, 7.0], [-1.0, -1.0, -1.0]]),
        },
    )


def test_step_metrics_use_verls_names_and_values() -> None:
    laps = {"gen": 0.5, "reward": 0.1, "old_log_prob": 0.2, "update_actor": 1.0, "update_weights": 0.2}
    out = step_metrics(
        _batch(), torch.tensor([0.0, 1.0]), {"actor/pg_loss": 0.25}, laps, max_response_length=3, actor_ranks=2
    )
    assert out["critic/score/mean"] == 0.5 and out["critic/score/max"] == 1.0 and out["critic/score/min"] == 0.0
    assert out["critic/advantages/max"] == 1.0  # the masked-out 7.0 is not a response token
    assert out["response_length/mean"] == 2.5 and out["response_length/clip_ratio"] == 0.5
    assert out["prompt_length/mean"] == 3.0
    assert out["rollout/logprob_abs_diff"] == pytest.approx((0.5 + 0.5) / 5)
    assert out["actor/pg_loss"] == 0.25
    assert out["timing_s/step"] == pytest.approx(2.0) and out["perf/time_per_step"] == pytest.approx(2.0)
    # gen per response token (5), the actor phases per prompt + response token (6 + 5)
    assert out["timing_per_token_ms/gen"] == pytest.approx(100.0)
    assert out["perf/tokens_per_s/update_actor"] == pytest.approx(11.0)
    assert out["perf/throughput"] == pytest.approx(11.0 / (2.0 * 2))
    assert "actor/kl_ref" not in out and not any(k.startswith("perf/mfu") for k in out)  # no reference, no GPU


def test_kl_ref_only_with_reference_logprobs() -> None:
    batch = _batch()
    batch.tensors["ref_logprobs"] = batch.tensors["old_logprobs"].clone()
    out = step_metrics(batch, torch.zeros(2), {}, {"gen": 1.0}, max_response_length=3, actor_ranks=1)
    assert out["actor/kl_ref"] == pytest.approx(0.0)


def test_mfu_from_active_parameters_and_the_gpu_peak() -> None:
    from types import SimpleNamespace

    hf = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 128}  # fmt: skip
    cfg = SimpleNamespace(actor=SimpleNamespace(use_ref=False, ppo_epochs=1, world_size=8))
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops(None) is None
    assert FlopsModel.for_run(cfg, hf, None) is None  # CPU: no MFU
    model = FlopsModel.for_run(cfg, hf, "NVIDIA H100 80GB HBM3")
    from mcore_rl.models.estimate import count_params

    counts = count_params(hf)
    assert model.active_params == counts.dense + counts.expert / 2  # 2 of 4 experts per token
    assert model.mfu("update_actor", 1000, 1.0) == pytest.approx(6 * model.active_params * 1000 / (989e12 * 8))


def test_tensorboard_event_files_are_readable_by_tensorboards_reader(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(str(tmp_path / "metrics.jsonl"), loggers=["jsonl", "tensorboard"])
    for step in (1, 2, 3):
        log.write(step, {"critic/score/mean": step / 10, "timing_s/gen": 0.5, "weight_version": step + 1})
    log.close()
    reader = EventAccumulator(str(tmp_path / "tensorboard"))
    reader.Reload()
    assert {"critic/score/mean", "timing_s/gen", "weight_version"} <= set(reader.Tags()["scalars"])
    assert [(e.step, round(e.value, 6)) for e in reader.Scalars("critic/score/mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]


def test_console_line_and_summary_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = MetricsLogger(str(tmp_path / "metrics.jsonl"), loggers=["console"])
    log.write(0, {"val-core/s/reward/mean@1": 0.5})  # validation before training: not a training step
    for step, score in ((1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)):
        log.write(step, {"critic/score/mean": score, "critic/score/max": 1.0, "timing_s/gen": 0.5})
    log.summary(seconds=12.34)
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "step=1 critic/score/mean=0.1 timing_s/gen=0.5"  # extremes stay in the files
    assert out[-1] == "summary: reward_first=0.200 reward_last=0.300 steps=4 seconds=12.3"
    assert not (tmp_path / "metrics.jsonl").exists()  # jsonl not asked for


@pytest.mark.parametrize(
    "loggers, message",
    [
        (["console", "csv"], "trainer.loggers=['console', 'csv'] is invalid: expected a list of ('console', 'jsonl'"),
        (["console", "wandb"], "the wandb logger needs the 'wandb' package, which is not installed"),
    ],
    ids=["unknown", "package-missing"],
)
def test_loggers_are_checked_against_the_backends(loggers: list[str], message: str) -> None:
    import importlib.util
    import re

    from mcore_rl.config import ConfigError, TrainerConfig
    from mcore_rl.preflight import check_loggers

    if "wandb" in loggers and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here: nothing is missing")
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainerConfig(loggers=loggers).validate()  # the names: the config; the packages: pre-flight (this machine)
        check_loggers(loggers)


def test_quiet_process_hides_exactly_the_listed_warnings() -> None:
    from mcore_rl._quiet import quiet_process

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_process()
        warnings.warn_explicit(
            "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
            UserWarning, "optimizer.py", 1, module="megatron.core.optimizer",
        )  # fmt: skip
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Use ...", FutureWarning, stacklevel=1)
        warnings.warn(
            "Transformer Engine and Apex are not installed", UserWarning, stacklevel=1
        )  # not from megatron: shown
        warnings.warn("something new from megatron", UserWarning, stacklevel=1)  # unknown: shown
    assert [str(w.message) for w in caught] == [
        "Transformer Engine and Apex are not installed",
        "something new from megatron",
    ]


def test_wandb_offline_run_holds_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline mode needs no network or account; the run file names each logged metric (wandb's own binary log)."""
    pytest.importorskip("wandb", reason="wandb is optional (pip install wandb / the `wandb` extra)")
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = {"project": "mcore_rl_test", "name": "offline", "mode": "offline", "config": {"actor": {"lr": 1e-3}}}
    log = MetricsLogger(str(tmp_path / "metrics.jsonl"), loggers=["wandb"], wandb=settings)
    for step in (1, 2):
        log.write(step, {"critic/score/mean": step / 10, "timing_s/gen": 0.5})
    log.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    assert b"critic/score/mean" in data and b"timing_s/gen" in data


def test_the_reference_pass_time_is_logged_per_token_under_verls_name() -> None:
    laps = {"gen": 0.5, "old_log_prob": 0.2, "update_actor": 1.0}
    out = step_metrics(
        _batch(), torch.tensor([0.0, 1.0]), {"timing_s/ref": 0.12}, laps, max_response_length=3, actor_ranks=2
    )
    assert out["timing_s/ref"] == 0.12  # from the ranks, not a lap: the step's time does not count it twice
    assert out["timing_per_token_ms/ref"] == pytest.approx(1000 * 0.12 / 11)  # 5 response + 6 prompt tokens
    assert out["timing_s/step"] == pytest.approx(1.7)
    plain = step_metrics(_batch(), torch.tensor([0.0, 1.0]), {}, laps, max_response_length=3, actor_ranks=2)
    assert "timing_s/ref" not in plain and "timing_per_token_ms/ref" not in plain


def test_rank_stats_report_the_reference_time_and_no_device_memory_on_cpu() -> None:
    from mcore_rl.actor.rank_stats import step_rank_metrics, timed

    value, seconds = timed(lambda: 7, torch.device("cpu"))
    assert value == 7 and seconds >= 0
    assert step_rank_metrics(torch.device("cpu"), 0.25) == {"timing_s/ref": 0.25}
    assert step_rank_metrics(torch.device("cpu"), None) == {}  # no reference pass, no CUDA: nothing to report


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device memory peaks exist on CUDA only")
def test_rank_stats_report_the_cuda_peaks_in_gib() -> None:
    from mcore_rl.actor.rank_stats import step_rank_metrics

    device = torch.device("cuda", torch.cuda.current_device())
    held = torch.empty(2**28, dtype=torch.uint8, device=device)  # 0.25 GiB
    out = step_rank_metrics(device, None)
    del held
    assert out["perf/max_memory_allocated_gb"] >= 0.25
    assert out["perf/max_memory_reserved_gb"] >= out["perf/max_memory_allocated_gb"]


def test_startup_clock_laps_add_up_from_the_process_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The start-up clock's origin is the process's own start (before this test ran), its laps add up to the total,
    and finish() writes startup.json and says the same total on the console."""
    import time

    from mcore_rl.metrics.startup import StartupClock, process_start

    began = process_start()
    assert began < time.time() - 0.5  # the interpreter and pytest's imports came first
    clock = StartupClock()
    assert clock.origin == began
    clock.lap("a")
    time.sleep(0.02)
    clock.lap("b")
    clock.lap("a")
    clock.detail("rank 0", {"model build": 1.23456})
    clock.finish(str(tmp_path))
    record = json.loads((tmp_path / "startup.json").read_text())
    assert list(record["laps_s"]) == ["a", "b"] and record["laps_s"]["b"] >= 0.02
    assert abs(sum(record["laps_s"].values()) - record["total_s"]) < 0.01
    assert record["details_s"] == {"rank 0": {"model build": 1.235}}
    assert capsys.readouterr().out.startswith(f"start-up: {record['total_s']:.1f} s to the first step (a ")
