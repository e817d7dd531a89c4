"""Bad input is refused before anything starts, with exit code 2 and one message naming what is wrong (no traceback).

Every case runs the real CLI (`python -m mcore_rl.train`, tools/convert_checkpoint.py, launch/submit.py) as a new user
would; the ones that fail before Ray starts take seconds. The Ctrl-C and kill -9 cases start a real run (slow tier).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _compose import assert_config_refused
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_qwen3_moe_checkpoint

REPO = Path(__file__).resolve().parents[1]


def train(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", *overrides], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def assert_user_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    for needle in needles:
        assert needle in res.stderr, (needle, res.stderr[-3000:])
    assert "Started a local Ray instance" not in res.stdout + res.stderr  # refused before Ray


# ------------------------------------------------------------------------------------------------ config keys
@pytest.mark.parametrize(
    "override,needle",
    [
        ("+actor.foo=1", "unknown key 'actor.foo' ('+' adds keys"),
        ("foo=1", "unknown key 'foo'"),
        ("trainer.stepz=3", "trainer has no field 'stepz'"),
        ("trainer.steps=abc", "trainer.steps"),  # Hydra's own type error: exit 2, not 1
    ],
)
def test_unknown_or_mistyped_keys_exit_2(override: str, needle: str, tmp_path) -> None:
    assert_user_error(train(override, f"trainer.run_dir={tmp_path}"), needle)


def test_keys_under_free_form_dicts_may_be_added() -> None:
    from mcore_rl.lifecycle import unknown_override

    assert unknown_override("+model.hf_config.rope_scaling.factor=2") is None
    assert unknown_override("actor.optim.lr=1e-5") is None and unknown_override("--config-name=x") is None


@pytest.mark.parametrize(
    "override,field",
    [
        ("model.make_vocab_size_divisible_by=0", "model.make_vocab_size_divisible_by=0"),
        ("reward.num_threads=0", "reward.num_threads=0"),
        ("reward.timeout_s=-1", "reward.timeout_s=-1"),
        ("data.max_prompt_length=0", "data.max_prompt_length=0"),
        ("data.synthetic_num_prompts=0", "data.synthetic_num_prompts=0"),
    ],
)
def test_values_that_used_to_fail_late_are_refused_by_the_config(override: str, field: str) -> None:
    """Refused where the command is composed (tests/_compose.py), so before anything starts; the CLI's exit 2 for a
    config refusal is the test below's first case."""
    assert_config_refused([override], field)


@pytest.mark.parametrize(
    "override,field",
    [
        ("model.make_vocab_size_divisible_by=0", "model.make_vocab_size_divisible_by=0"),  # the config's refusal
        ("trainer.ray_num_cpus=1", "trainer.ray_num_cpus=1 is too small: the run reserves 3 CPUs"),  # the pre-flight's
        # Ray's connect retried a closed port for minutes without a word
        ("trainer.ray_address=127.0.0.1:1", "trainer.ray_address='127.0.0.1:1': no Ray cluster answers there"),
        ("trainer.ray_address=banana", "trainer.ray_address='banana' is invalid: expected host:port"),
    ],
)
def test_values_that_used_to_fail_late_exit_2(override: str, field: str, tmp_path) -> None:
    assert_user_error(train(override, f"trainer.run_dir={tmp_path}"), field)


def test_ray_cpus_count_every_group_the_run_starts(tmp_path) -> None:
    """The critic's ranks count (a gae run with ray_num_cpus covering only actor + engine would wait forever), and
    colocated engines reserve nothing of their own (they run in their rank's bundle)."""
    from mcore_rl.config import RLConfig
    from mcore_rl.controller.placement import ray_cpus_needed

    res = train(
        "algorithm.adv_estimator=gae", "critic.enable=true", "trainer.ray_num_cpus=3", f"trainer.run_dir={tmp_path}"
    )
    assert_user_error(res, "the run reserves 4 CPUs (actor.world_size=2 x actor.num_cpus_per_rank=1 + ")
    assert "critic.world_size=1 x critic.num_cpus_per_rank=1" in res.stderr
    cfg = RLConfig()
    assert ray_cpus_needed(cfg) == cfg.actor.world_size + cfg.rollout.num_engines
    cfg.trainer.placement = "colocated"
    assert ray_cpus_needed(cfg) == cfg.actor.world_size


def test_the_cheap_refusals_come_before_the_tokenizer(monkeypatch, tmp_path) -> None:
    """trainer.ray_num_cpus, trainer.ray_address and the run's API key are checked before the tokenizer loads (about
    2 s of transformers) and before the checkpoint's check is awaited: a refusal among them answers at once."""
    from mcore_rl import preflight
    from mcore_rl.config import ConfigError, RLConfig

    def tokenizer_loaded(cfg) -> None:
        raise AssertionError("the tokenizer was checked before trainer.ray_num_cpus")

    monkeypatch.setattr(preflight, "check_tokenizer", tokenizer_loaded)
    cfg = RLConfig()
    cfg.trainer.ray_num_cpus = 1
    cfg.trainer.run_dir = str(tmp_path)
    with pytest.raises(ConfigError, match="trainer.ray_num_cpus=1 is too small"):
        preflight.check(cfg)


# ------------------------------------------------------------------------------------------------ files
def test_missing_data_file(tmp_path) -> None:
    missing = tmp_path / "nope.parquet"
    assert_user_error(train(f"data.train_files=[{missing}]", f"trainer.run_dir={tmp_path}/run"), str(missing))


def test_impossible_run_dir(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    assert_user_error(train(f"trainer.run_dir={tmp_path}/file/run"), "trainer.run_dir=", "not a writable directory")


def test_corrupted_config_json_is_named(tmp_path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text('{"model_type": "qwen3_moe", ')
    assert_user_error(train(f"model.path={tmp_path}/ckpt", f"trainer.run_dir={tmp_path}/run"),
                      f"{tmp_path}/ckpt/config.json is not readable JSON")  # fmt: skip


def test_empty_prompt_content_fails_and_marks_the_run_dir(tmp_path) -> None:
    row = {
        "data_source": "synthetic/copy_digit",
        "prompt": [{"role": "user", "content": "  "}],
        "reward_model": {"style": "rule", "ground_truth": "1"},
    }
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "d.parquet")
    res = train(f"data.train_files=[{tmp_path}/d.parquet]", f"trainer.run_dir={tmp_path}/run")
    assert_user_error(res, "row 0", "empty content")
    assert "empty content" in (tmp_path / "run" / "FAILED").read_text()
    assert not (tmp_path / "run" / "summary.json").exists()


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_qwen3_moe_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _variant(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_checkpoint_missing_and_misshapen_tensors_found_before_ray(checkpoint, tmp_path) -> None:
    missing = "model.layers.1.mlp.experts.3.down_proj.weight"
    wrong = "model.layers.0.self_attn.o_proj.weight"

    def edit(t: dict) -> None:
        del t[missing]
        t[wrong] = torch.zeros(3, 5)

    bad = _variant(checkpoint, tmp_path / "bad", edit)
    assert_user_error(train(f"model.path={bad}", f"trainer.run_dir={tmp_path}/run"),
                      f"HF tensor '{missing}' is missing", f"tensor {wrong} has shape [3, 5]")  # fmt: skip


def test_truncated_checkpoint_found_before_ray(checkpoint, tmp_path) -> None:
    bad = _variant(checkpoint, tmp_path / "bad", lambda t: None)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 100])
    assert_user_error(train(f"model.path={bad}", f"trainer.run_dir={tmp_path}/run"), "truncated")


def _overlap_two_tensors(file: Path) -> str:
    """Point one tensor's data_offsets at the bytes of the tensor before it (same size, neither the last one): every
    size and the data region's end still agree, but two tensors share bytes and a range is left unread. Returns the
    moved tensor's name."""
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    spans = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    for (first, _), (second, name) in zip(spans[:-2], spans[1:-1]):
        if second[1] - second[0] == first[1] - first[0]:
            header[name]["data_offsets"] = list(first)
            text = json.dumps(header).encode()
            text += b" " * (-len(text) % 8)
            file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
            return name
    raise AssertionError("no two neighbouring tensors of one size")


def test_overlapping_tensor_offsets_found_before_ray(checkpoint, tmp_path) -> None:
    """The engines' loader (safetensors) refuses a file whose tensors overlap; pre-flight used to pass it, and the run
    died inside Ray about a minute later with exit 1."""
    bad = _variant(checkpoint, tmp_path / "bad", lambda t: None)
    moved = _overlap_two_tensors(bad / "model.safetensors")
    res = train(f"model.path={bad}", f"trainer.run_dir={tmp_path}/run")
    assert_user_error(res, f"{bad / 'model.safetensors'}", "not valid safetensors")
    assert moved and "invalid offset for tensor" in res.stderr, res.stderr[-3000:]


def test_a_quoted_size_in_config_json_is_named_not_a_crash(checkpoint, tmp_path) -> None:
    """`"hidden_size": "64"` crashed the checkpoint pre-flight (exit 1, a traceback of the child)."""
    bad = _variant(checkpoint, tmp_path / "bad", lambda t: None)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_size": str(config["hidden_size"])}))
    expected = f"{bad}/config.json: field hidden_size is '{config['hidden_size']}' (str); expected an integer"
    assert_user_error(train(f"model.path={bad}", f"trainer.run_dir={tmp_path}/run"), expected)


def test_a_quoted_size_in_model_hf_config_is_named(tmp_path) -> None:
    assert_user_error(train("model.hf_config.num_attention_heads='4'", f"trainer.run_dir={tmp_path}"),
                      "model.hf_config.num_attention_heads is '4' (str); expected an integer")  # fmt: skip


def test_checkpoint_child_names_a_config_it_cannot_build(checkpoint, tmp_path) -> None:
    """A value of the right type that the family still cannot build from is a problem of the checkpoint, named."""
    from mcore_rl.config import ConfigError
    from mcore_rl.preflight import check_checkpoint

    bad = _variant(checkpoint, tmp_path / "bad", lambda t: None)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_size": str(config["hidden_size"])}))
    with pytest.raises(ConfigError, match="config.json cannot be built"):
        check_checkpoint(str(bad), 64)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_ray(tmp_path) -> None:
    from mcore_rl.data.tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer(str(tmp_path / "tok"), tools=True)  # ids past the default model's vocab_size of 63
    res = train(f"model.tokenizer={tmp_path}/tok", f"trainer.run_dir={tmp_path}/run")
    assert_user_error(res, f"model.tokenizer='{tmp_path}/tok' has token ids up to", "but the model's vocab_size is 63")


def test_a_tokenizer_that_does_not_load_is_named(tmp_path) -> None:
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"tokenizer_class": ')
    assert_user_error(train(f"model.tokenizer={tmp_path}/tok", f"trainer.run_dir={tmp_path}/run"),
                      f"model.tokenizer='{tmp_path}/tok': cannot load a tokenizer from it")  # fmt: skip


def test_router_timeout_below_a_second_is_rounded_up_not_down() -> None:
    from mcore_rl.rollout.router import Router

    cmd = Router(["http://127.0.0.1:1"], port=1, request_timeout_s=0.001).command()
    assert cmd[cmd.index("--request-timeout-secs") + 1] == "1"
    cmd = Router(["http://127.0.0.1:1"], port=1, request_timeout_s=2.5).command()
    assert cmd[cmd.index("--request-timeout-secs") + 1] == "3"


def test_the_checkpoint_child_runs_beside_the_other_checks_and_never_outlives_them(checkpoint, tmp_path,
                                                                                 monkeypatch) -> None:  # fmt: skip
    """pre-flight starts the checkpoint's child first (it overlaps the tokenizer check), but an earlier failure is
    still the one reported, and the child is stopped with it."""
    from mcore_rl import preflight
    from mcore_rl.config import ConfigError
    from mcore_rl.controller.recipe_check import compose_recipe

    started = []
    real_start = preflight.start_checkpoint_check
    monkeypatch.setattr(preflight, "start_checkpoint_check", lambda *a: started.append(real_start(*a)) or started[-1])
    (tmp_path / "tok").mkdir()
    cfg = compose_recipe("default", [f"model.path={checkpoint}", f"model.tokenizer={tmp_path}/tok",
                                     f"trainer.run_dir={tmp_path}/run"])  # fmt: skip
    with pytest.raises(ConfigError, match="cannot load a tokenizer from it"):
        preflight.check(cfg)
    assert len(started) == 1 and started[0].returncode is not None  # started, then stopped and reaped


def test_preflight_passes_an_intact_checkpoint(checkpoint) -> None:
    from mcore_rl.preflight import check_checkpoint

    check_checkpoint(str(checkpoint), 64)  # raises on any problem


# ------------------------------------------------------------------------------------------------ reward
def test_hanging_reward_fails_at_the_first_timeout_without_a_thread_per_row() -> None:
    from mcore_rl.reward.manager import RewardManager, RewardTimeoutError

    release, calls = threading.Event(), []

    def hang(**_: object) -> float:
        calls.append(1)
        release.wait(60)
        return 0.0

    before = threading.active_count()
    manager = RewardManager(hang, num_threads=2, timeout_s=0.5)
    with pytest.raises(RewardTimeoutError, match="ran past timeout_s=0.5 on row 0"):
        manager.score(["a"] * 16, ["s"] * 16, ["1"] * 16)
    assert len(calls) == 2  # the two running calls; none of the 14 others started
    assert threading.active_count() - before <= 2
    release.set()


# ------------------------------------------------------------------------------------------------ convert, submit
def convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_convert_out_equal_to_input_is_refused_even_with_overwrite(checkpoint, tmp_path) -> None:
    copy = _variant(checkpoint, tmp_path / "hf", lambda t: None)
    before = sorted(p.name for p in copy.iterdir())
    res = convert("hf-to-mcore", "--hf", str(copy), "--out", str(copy), "--overwrite", "--nproc", "1")
    assert res.returncode == 2 and "overlaps the input" in res.stderr and "Traceback" not in res.stderr
    assert sorted(p.name for p in copy.iterdir()) == before


def test_convert_out_where_nothing_can_be_written(checkpoint, tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    res = convert("hf-to-mcore", "--hf", str(checkpoint), "--out", str(tmp_path / "file" / "out"), "--nproc", "1")
    assert res.returncode == 2 and "cannot create the output directory" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_convert_vocab_multiple_zero_is_a_usage_error(checkpoint, tmp_path) -> None:
    res = convert("hf-to-mcore", "--hf", str(checkpoint), "--out", str(tmp_path / "o"),
                  "--make-vocab-size-divisible-by", "0")  # fmt: skip
    assert res.returncode == 2 and "must be a positive integer" in res.stderr


def test_submit_refuses_a_malformed_time() -> None:
    res = subprocess.run([sys.executable, str(REPO / "launch" / "submit.py"), "--nodes", "1", "--gpus-per-node", "0",
                          "--partition", "p", "--time", "banana", "--job-name", "j", "--dry-run"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 2 and "--time 'banana' is not a Slurm time limit" in res.stderr


@pytest.mark.parametrize("name", ["j\n#SBATCH --wrap=id", "../../escape", "a/b", "-x", ""])
def test_submit_refuses_a_job_name_that_injects_lines_or_leaves_the_run_dir(name, tmp_path) -> None:
    res = subprocess.run([sys.executable, str(REPO / "launch" / "submit.py"), "--nodes", "1", "--gpus-per-node", "0",
                          "--partition", "p", "--time", "1:00:00", f"--job-name={name}", "--dry-run", "--",
                          f"trainer.run_dir={tmp_path}/run"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 2, (res.stdout[-2000:], res.stderr[-2000:])
    assert f"--job-name {name!r} is not a job name" in res.stderr and "Traceback" not in res.stderr
    assert "#SBATCH --wrap" not in res.stdout


# ------------------------------------------------------------------------------------------------ endings
def _start_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.train", "trainer.steps=200", f"trainer.run_dir={run_dir}",
         "data.batch_size=2", "rollout.n=2", "actor.mini_batches=1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        # A test run started in the background of a shell without job control (`cmd &` in a script) inherits SIGINT
        # ignored, and Python then installs no KeyboardInterrupt handler: give the driver the default, as a terminal
        # would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.time() + 300
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 1:
            return proc, run_dir
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"the run never wrote a metrics line: {proc.communicate()[1][-3000:]}")


@pytest.mark.long
@pytest.mark.slow
def test_ctrl_c_ends_with_one_line_exit_130_and_a_failed_marker(tmp_path) -> None:
    proc, run_dir = _start_run(tmp_path)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "interrupted after step" in err and "of 200" in err
    assert (run_dir / "FAILED").read_text().startswith("interrupted (Ctrl-C) after step")


@pytest.mark.long
@pytest.mark.slow
def test_sigterm_of_a_real_run_exits_143_with_a_failed_marker(tmp_path) -> None:
    """What Slurm's scancel and time limit send: the run dir must not look like a finished run."""
    import psutil

    proc, run_dir = _start_run(tmp_path)
    started = {p.pid: p.create_time() for p in psutil.Process(proc.pid).children(recursive=True)}
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "terminated (SIGTERM) after step" in err
    assert (run_dir / "FAILED").read_text().startswith("terminated (SIGTERM) after step")
    assert not (run_dir / "summary.json").exists()

    def alive() -> list[int]:
        out = []
        for pid, created in started.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.Error:
                pass
        return out

    deadline = time.time() + 20  # the run's clean-up, then the watchdog's 2 s grace
    while alive() and time.time() < deadline:
        time.sleep(0.5)
    assert not alive()


@pytest.mark.long
@pytest.mark.slow
def test_kill_9_of_the_driver_leaves_no_ray_process(tmp_path) -> None:
    import psutil

    proc, _ = _start_run(tmp_path)
    started = {p.pid: p.create_time() for p in psutil.Process(proc.pid).children(recursive=True)}
    assert any("raylet" in " ".join(psutil.Process(p).cmdline()) for p in started)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)

    def alive() -> list[str]:
        out = []
        for pid, created in started.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{pid} {' '.join(p.cmdline())[:80]}")
            except psutil.Error:
                pass
        return out

    deadline = time.time() + 20  # the watchdog needs its 2 s grace; Ray's agents alone took about a minute
    while alive() and time.time() < deadline:
        time.sleep(0.5)
    assert not alive(), json.dumps(alive(), indent=1)


@pytest.mark.slow
def test_a_cluster_that_refuses_the_token_is_a_user_error(tmp_path) -> None:
    """A running cluster joined without its auth token: exit 2 naming the address and the token, not a traceback."""
    from _ray_cluster import ray_address_override

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    out = subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", ray_address_override(), f"trainer.run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert_user_error(out, "trainer.ray_address='127.0.0.1:")
    assert "RAY_AUTH_TOKEN" in out.stderr  # assert_user_error: exit 2, no traceback
