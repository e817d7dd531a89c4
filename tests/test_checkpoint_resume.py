"""Training checkpoints end to end through the train entry point (real Ray actors, Megatron ranks, rollout engine).

Runs (module fixtures, shared by the tests; the tiny default model at EP2, 4 prompts x 4 samples per step):
    reference    4 steps, a checkpoint after steps 2 and 4
    crashed      4 steps, killed with SIGKILL while the checkpoint of step 4 is being written (a test hook stops the
                 save after the ranks wrote their files, before the checkpoint is complete)
    resumed      the crashed run again with trainer.resume=auto: continues from step 2
    other layout resumes the step-2 checkpoint at TP2 into a small tmpfs, whose second save runs out of space

model.make_vocab_size_divisible_by=32 pads the 63-token vocabulary to 64 under both EP2 (tp=1) and TP2, so the
checkpoint's embedding fits either layout (Megatron pads to a multiple of divisible_by x tp).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ray_cluster import ray_address_override, train_env

from mcore_rl.checkpoint import store
from mcore_rl.checkpoint.manager import PAUSE_ENV

TRAIN = [sys.executable, "-m", "mcore_rl.train"]
#: rollout.max_running_requests=4 (= n): the engine decodes one request's samples at a time. With more, continuous
#: batching mixes requests by their arrival time, and a row's logits change in the last bits with the batch it shares
#: (float summation order): rollout/logprob_abs_diff then differs at ~1e-8 between two runs, resumed or not (seen:
#: 1.04e-7 vs 9.7e-8 at one step; sampled tokens, rewards, losses and weights identical)
TINY = [
    "data.batch_size=4",
    "rollout.n=4",
    "rollout.max_running_requests=4",
    "model.make_vocab_size_divisible_by=32",
    "trainer.steps=4",
    "actor.use_ref=true",
]  # fmt: skip (the reference is saved once and hard-linked)
TP2 = ["actor.layout.tp=2", "actor.layout.ep=1", "actor.layout.sequence_parallel=true"]

pytestmark = [pytest.mark.slow, pytest.mark.long]


def _train(run_dir: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    args = [*TRAIN, *TINY, f"trainer.run_dir={run_dir}", ray_address_override(), *overrides]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=train_env())


_TIMED = ("timing_s/", "timing_per_token_ms/", "perf/")  # wall-clock figures, which differ between any two runs


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(_TIMED)} for line in lines]


def _model_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint directory, whole (read through the converter's chunk reader)."""
    from mcore_rl.resharding.dist_ckpt import ChunkReader, Piece

    out = {}
    with ChunkReader(directory) as reader:
        for key, md in reader.tensors.items():
            piece = Piece(key, tuple(md.size), (0,) * len(md.size), tuple(md.size), view=((), (), 0))
            out[key] = reader.read_region(piece).clone()
    return out


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference")
    out = _train(run_dir, "trainer.save_every=2", "trainer.keep_last=null")
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def _crash(run_dir: Path, pause: str) -> tuple[Path, str]:
    """Run with PAUSE_ENV=`pause` (checkpoint/manager.py: `<step>[:<point>]`) and kill -9 the trainer once the save
    holds there; returns the run dir and the output."""
    args = [*TRAIN, *TINY, f"trainer.run_dir={run_dir}", "trainer.save_every=2"]
    env = dict(os.environ, **{PAUSE_ENV: pause})
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    seen = []
    step = pause.split(":")[0]
    try:
        for line in proc.stdout:  # the hook prints once the save holds at its point
            seen.append(line)
            if f"{PAUSE_ENV}: pausing inside the save of step {step}" in line:
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the trainer started in its session (Ray) goes with it
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-3000:]
    return run_dir, "".join(seen)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A run killed with SIGKILL inside the save of step 4, before the checkpoint is complete."""
    return _crash(tmp_path_factory.mktemp("crashed"), "4")


@pytest.fixture(scope="module")
def resumed(crashed: tuple[Path, str]) -> subprocess.CompletedProcess:
    run_dir, _ = crashed
    out = _train(run_dir, "trainer.save_every=2", "trainer.resume=auto")
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_kill_during_save_leaves_the_previous_checkpoint_intact(crashed: tuple[Path, str]):
    run_dir, _ = crashed
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert store.read_meta(root / "step_00000002")["step"] == 2  # complete: every part is there
    assert not (root / "step_00000004").exists()
    (tmp,) = store.half_written(root)
    assert tmp.name.startswith(".tmp-step_00000004-") and not (tmp / "meta.json").exists()
    # the crashed run had logged step 4 before it died in the save
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2, 3, 4]


def test_resume_after_the_kill_is_exact(reference: Path, crashed: tuple[Path, str], resumed):
    """k steps + (kill) + resume + k steps == 2k steps straight: every metric of every step identical (timings aside),
    and the final checkpoints hold bit-identical weights."""
    run_dir, _ = crashed
    assert "checkpoint: ignoring" in resumed.stdout and ".tmp-step_00000004-" in resumed.stdout
    assert "resumed" in resumed.stdout and "at step 2, weight version 3" in resumed.stdout
    assert "RNG states restored" in resumed.stdout
    got, want = _metrics(run_dir), _metrics(reference)
    assert [m["step"] for m in got] == [1, 2, 3, 4]  # the crashed run's step-4 line was replaced, not duplicated
    assert got == want
    a, b = (
        _model_tensors(reference / "checkpoints/step_00000004/model"),
        _model_tensors(run_dir / "checkpoints/step_00000004/model"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    root = run_dir / "checkpoints"
    assert not store.half_written(root)  # the next successful save removed the leftover
    assert (root / "latest").read_text().strip() == "step_00000004"
    # keep_last=2: both kept; the reference model is stored once (hard links), not copied into each checkpoint
    ref2, ref4 = root / "step_00000002/reference", root / "step_00000004/reference"
    for file in ref2.iterdir():
        assert (ref4 / file.name).stat().st_ino == file.stat().st_ino


# ---------------------------------------------------------------------------------------- another layout, full disk
def _tmpfs(path: Path, size: int) -> bool:
    """Mount a tmpfs of `size` bytes at `path` (root only); False where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return out.returncode == 0


def _disk_bytes(path: Path) -> int:
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in path.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def other_layout(reference: Path, tmp_path_factory: pytest.TempPathFactory):
    """The reference's step-2 checkpoint (saved at EP2) resumed at TP2, saving every step into a tmpfs with room for
    one checkpoint and half of the next: step 3's save fits, step 4's runs out of space."""
    run_dir = tmp_path_factory.mktemp("tp2")
    source = reference / "checkpoints/step_00000002"
    full, without_ref = _disk_bytes(source), _disk_bytes(source) - _disk_bytes(source / "reference")
    root = run_dir / "checkpoints"
    mounted = _tmpfs(root, full + without_ref // 2)
    try:
        out = _train(run_dir, *TP2, f"trainer.resume={source}", "trainer.save_every=1", "trainer.keep_last=1")
        yield run_dir, out, mounted, {p.name: store.read_meta(p) for p in root.glob("step_*")}
    finally:
        if mounted:
            subprocess.run(["umount", str(root)], check=False)


def test_resume_under_another_layout(reference: Path, other_layout):
    """Saved at EP2, resumed at TP2: the engines get the checkpoint's weights (the first resumed step samples exactly
    what the EP2 run sampled), and training continues from the restored optimizer state (TP2 sums in another order,
    so losses agree to float32 rounding, not bit for bit)."""
    run_dir, out, _, _ = other_layout
    assert "at step 2, weight version 3" in out.stdout and "RNG states not restored: saved under" in out.stdout
    got = {m["step"]: m for m in _metrics(run_dir)}
    want = {m["step"]: m for m in _metrics(reference)}
    assert sorted(got) == [3, 4]
    assert got[3]["critic/score/mean"] == want[3]["critic/score/mean"]
    assert got[3]["response_length/mean"] == want[3]["response_length/mean"]
    assert got[3]["weight_version"] == want[3]["weight_version"] == 4
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_ref", "actor/grad_norm"):
        assert got[3][key] == pytest.approx(want[3][key], rel=1e-4, abs=1e-5), key
    assert got[3]["rollout/logprob_abs_diff"] < 1e-4  # the engine serves exactly the actor's (restored) weights


def test_full_disk_save_fails_loudly_and_keeps_the_previous_checkpoint(other_layout):
    run_dir, out, mounted, published = other_layout
    if not mounted:
        pytest.skip("mounting a tmpfs needs root")
    assert out.returncode != 0
    assert "saving the checkpoint of step 4" in out.stderr and "No space left on device" in out.stderr
    assert "the previous checkpoint" in out.stderr and "step_00000003 is intact" in out.stderr
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000003"
    assert list(published) == ["step_00000003"] and published["step_00000003"]["step"] == 3
    assert not store.half_written(root)  # the failed save's temporary directory is gone


# ------------------------------------------------------------------------------- distributed optimizer, critic
def test_the_distributed_optimizer_and_the_critic_resume_exactly(tmp_path: Path):
    """PPO (algorithm.adv_estimator=gae) with a critic group, the actor on Megatron's distributed optimizer (fully
    reshardable state, under the CPU runtime's torch Adam, whose restored step count Megatron 0.16.1 shares between
    parameters: checkpoint/rank_io.py restores one per parameter). The critic's ranks save their model, optimizer and
    RNG under critic/. 2 steps straight vs 1 step + resume from its checkpoint (in another run dir) + 1 step: step 2's
    metrics (critic values, value loss, the actor's losses) equal; a critic restarted from its initial weights would
    give other values at step 2."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ppo = ["actor.optim.distributed=true", "algorithm.adv_estimator=gae", "critic.enable=true", "trainer.steps=2"]
    out = _train(straight, *ppo, "trainer.save_every=1", "trainer.keep_last=null")
    assert out.returncode == 0, out.stderr[-3000:]
    saved = store.read_meta(straight / "checkpoints/step_00000001")
    assert saved["critic"] == {"layout": "tp1 pp1 cp1 ep1 etp1", "world_size": 1}
    out = _train(resumed, *ppo, f"trainer.resume={straight / 'checkpoints/step_00000001'}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed" in out.stdout and "at step 1, weight version" in out.stdout and "RNG states restored" in out.stdout
    got, want = _metrics(resumed), [m for m in _metrics(straight) if m["step"] == 2]
    assert [m["step"] for m in got] == [2]
    assert "critic/vf_loss" in got[0] and "critic/values/mean" in got[0]
    assert got == want


# ----------------------------------------------------------------------------------------------------- export
def test_convert_exports_a_training_checkpoint(reference: Path, tmp_path: Path):
    """mcore-to-hf takes the checkpoints directory (its latest) and writes an HF model holding the trained weights,
    loadable by transformers with its tokenizer."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    cli = [sys.executable, "tools/convert_checkpoint.py", "mcore-to-hf", "--mcore", str(reference / "checkpoints")]
    done = subprocess.run([*cli, "--out", str(out), "--nproc", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    exported = {}
    for file in out.glob("*.safetensors"):
        exported.update(load_file(file))
    trained = _model_tensors(reference / "checkpoints/step_00000004/model")
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    assert torch.equal(exported["model.embed_tokens.weight"], trained["embedding.word_embeddings.weight"][:vocab])
    assert torch.equal(exported["lm_head.weight"], trained["output_layer.weight"][:vocab])
    initial = _model_tensors(reference / "checkpoints/step_00000002/reference")
    assert not torch.equal(initial["output_layer.weight"], trained["output_layer.weight"])  # trained, not initial
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(model.lm_head.weight.detach(), exported["lm_head.weight"])
    assert AutoTokenizer.from_pretrained(out).vocab_size > 0


# -------------------------------------------------------------------------------------------------- bad input
def _half_written(reference: Path) -> Path:
    import shutil

    tmp = reference / "checkpoints/.tmp-step_00000009-deadbeef"
    if not tmp.exists():
        shutil.copytree(reference / "checkpoints/step_00000002", tmp)
        (tmp / "meta.json").unlink()
    return tmp


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.resume={run}"], "meta.json: missing; {run} is not a training checkpoint"),
        (["trainer.resume={half}"], "is a half-written checkpoint (a save that did not finish"),
        (
            ["trainer.resume={ckpt}", "model.hf_config.hidden_size=128"],
            "step_00000002/meta.json: model.hf_config.hidden_size is 64 in the checkpoint, 128 in this run's model",
        ),
        (
            ["trainer.resume={ckpt}", "model.hf_config.vocab_size=100"],
            "model.hf_config.vocab_size is 63 in the checkpoint, 100 in this run's model config (another vocabulary)",
        ),
        (["trainer.resume={ckpt}", "model.dtype=bfloat16"], "meta.json: model.dtype is 'float32' in the checkpoint"),
        (
            ["trainer.resume={ckpt}", *TP2, "model.make_vocab_size_divisible_by=64"],
            "meta.json: padded_vocab_size is 64 in the checkpoint (saved under tp1 pp1 cp1 ep2 etp1), this layout "
            "pads the vocabulary to 128",
        ),
        (
            ["trainer.resume={ckpt}", "algorithm.adv_estimator=gae", "critic.enable=true"],
            "step_00000002/meta.json: the checkpoint holds no critic (saved by a run without critic.enable)",
        ),
        (["trainer.save_every=2"], "holds checkpoints of an earlier run, which this new run"),
        (["trainer.save_every=-1"], "trainer.save_every=-1 is invalid: expected an integer >= 0"),
        (["trainer.keep_last=0"], "trainer.keep_last=0 is invalid: expected a positive integer"),
    ],
    ids=[
        "not-a-checkpoint",
        "half-written",
        "model-shape",
        "vocabulary",
        "dtype",
        "vocab-padding",
        "no-critic",
        "overwrite",
        "save-every",
        "keep-last",
    ],  # fmt: skip
)
def test_bad_resume_is_refused_before_anything_starts(reference: Path, overrides: list[str], message: str):
    names = {"run": str(reference), "ckpt": str(reference / "checkpoints/step_00000002"), "half": ""}
    if any("{half}" in o for o in overrides):
        names["half"] = str(_half_written(reference))
    before = _listing(reference / "checkpoints")
    out = _train(reference, *(o.format(**names) for o in overrides), timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert message.format(**names) in out.stderr
    assert "Traceback" not in out.stderr
    assert _listing(reference / "checkpoints") == before  # nothing written, nothing overwritten


@pytest.mark.parametrize("point", ["published", "latest"])
def test_a_kill_after_the_first_step_dir_is_complete_resumes_from_it(reference: Path, tmp_path: Path, point: str):
    """Killed in the first save (step 2) after step_00000002 was renamed into place: before `latest` was written, or
    with `.tmp-latest-<pid>` written and not yet renamed. resume=auto said "none ...; starting a new run", trained from
    step 0 and saved over step_00000002. It must resume from step 2, with the metrics of the uninterrupted run."""
    run_dir, _ = _crash(tmp_path / "run", f"2:{point}")
    root = run_dir / "checkpoints"
    assert store.read_meta(root / "step_00000002")["step"] == 2 and not (root / "latest").exists()
    assert bool(list(root.glob(".tmp-latest-*"))) == (point == "latest")
    out = _train(run_dir, "trainer.save_every=2", "trainer.resume=auto")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed" in out.stdout and "at step 2, weight version 3" in out.stdout, out.stdout[-3000:]
    assert "starting a new run" not in out.stdout
    assert "FutureWarning" not in out.stderr + out.stdout  # Megatron's checkpoint load through torch's deprecated API
    assert _metrics(run_dir) == _metrics(reference)
    assert (root / "latest").read_text().strip() == "step_00000004" and not list(root.glob(".tmp-*"))
