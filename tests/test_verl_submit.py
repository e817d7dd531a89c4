"""launch/submit.py --dry-run composes a command as `python -m mcore_rl.train` does (mcore_rl/compat/verl/cli.py:
compose_command): verl's launch scripts are translated and checked on the cluster they name (trainer.nnodes x
trainer.n_gpus_per_node), and a command of ours naming model.path is composed over the schema's defaults, not the
tiny CPU job's. Also: pre-flight refuses actor.recompute on trainer.runtime=cpu.

.venv/bin/python -m pytest -q tests/test_verl_submit.py     # add -m "not slow" to skip the 30B MoE script
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _verl_scripts import make_world, script_args  # noqa: E402
from test_submit import default_env  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBMIT = os.path.join(REPO, "launch", "submit.py")
SLURM = ["--partition", "gpu", "--time", "1:00:00", "--job-name", "verl"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """A home directory with the scripts' parquet files and an HF cache with the models' config.json."""
    home = str(tmp_path_factory.mktemp("home"))
    env = {**default_env(), **make_world(home), "PYTHONWARNINGS": "ignore"}
    env.pop("HF_HUB_CACHE", None)
    return home, env


def dry_run(
    script: str, world: tuple[str, dict[str, str]], *extra: str, gpu_memory_gb: int = 80
) -> subprocess.CompletedProcess:
    """`launch/submit.py --dry-run` of a verl script on the nodes x GPUs the script names, as the user runs it (with
    `extra` overrides after the script's own)."""
    home, env = world
    args = [*script_args(script, home), *extra]
    given = dict(a.split("=", 1) for a in args if "=" in a)
    cluster = ["--nodes", given["trainer.nnodes"], "--gpus-per-node", given["trainer.n_gpus_per_node"],
               "--gpu-memory-gb", str(gpu_memory_gb)]  # fmt: skip
    return subprocess.run(
        [sys.executable, SUBMIT, *cluster, *SLURM, "--dry-run", "--", *args],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )  # fmt: skip


SGLANG = "actor_rollout_ref.rollout.name=sglang"


def test_verls_vllm_quickstart_passes_the_dry_run_with_vllms_ipc_push(world) -> None:
    """verl's quickstart names vLLM on one GPU (its hybrid engine: colocated): the dry run passes with vLLM engines,
    their push by CUDA IPC (vLLM's ipc backend, the tensor transport) and their memory released while the actor
    trains (vLLM's sleep mode). Was refused while the GPU push into vLLM was not wired."""
    res = dry_run("ppo_quickstart", world)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "actor_rollout_ref.rollout.name='vllm' -> rollout.engine='vllm'" in res.stdout
    assert "placement=colocated" in res.stdout and "transport=tensor" in res.stdout
    assert "released while training" in res.stdout and "fits:" in res.stdout


def test_verls_vllm_quickstart_is_refused_where_vllms_push_cannot_go(world) -> None:
    """vLLM's weight-transfer API has no file path: the quickstart with sync.transport=disk is refused before
    anything starts, naming the key and what vLLM takes."""
    res = dry_run("ppo_quickstart", world, "sync.transport=disk")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "sync.transport='disk' is invalid with rollout.engine=vllm on CUDA" in res.stderr


def test_the_ppo_quickstart_passes_the_dry_run_on_one_gpu(world) -> None:
    res = dry_run("ppo_quickstart", world, SGLANG)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "verl: data.train_batch_size=256 -> data.batch_size=256" in res.stdout  # translated as train translates
    assert "critic 1" in res.stdout and "(1 nodes x 1 GPUs)" in res.stdout  # gae brings its critic, on the same GPU
    assert "transport=tensor" in res.stdout  # verl's hybrid engine: the weights go by CUDA IPC
    assert "fits:" in res.stdout and "#SBATCH --nodes=1" in res.stdout


@pytest.mark.long
@pytest.mark.slow  # builds the 30B MoE's meta model for the sync plan
def test_the_qwen3_30b_megatron_script_passes_with_sglang_engines(world) -> None:
    """verl's Qwen3-30B-A3B script (run_qwen3moe-30b_megatron_96gb.sh: EP 8, dynamic batches of 10240 tokens,
    optimizer state on the host) on 1 x 8 GPUs of 96 GB as its name says, with SGLang engines: its token budget caps a
    micro-batch at one 10240-token sample, and the engines release their memory while the actor trains. At 80 GB it
    does not fit (no recompute: about 50 GiB of activations at 10240 tokens), which the test also checks."""
    res = dry_run("grpo_qwen3moe_30b_megatron", world, SGLANG, gpu_memory_gb=96)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "ep=8" in out and "micro_batch=1, seq=10240" in out and "fits:" in out
    small = dry_run("grpo_qwen3moe_30b_megatron", world, SGLANG, gpu_memory_gb=80)
    assert small.returncode == 2 and "> --gpu-memory-gb 80 GiB" in small.stderr, small.stderr[-2000:]


def test_the_dapo_script_is_refused_for_its_context_parallelism(world) -> None:
    """DAPO's Ulysses SP 8 is actor.layout.cp=8, which the actor does not run: the dry run refuses it as pre-flight
    on the GPU node would, naming the key (not a memory figure computed for a layout that cannot run)."""
    res = dry_run("dapo_qwen2_5_32b", world, SGLANG)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "actor.layout.cp=8 is not supported" in res.stderr and "expected actor.layout.cp=1" in res.stderr


#: a tiny dense Qwen2 config.json
TINY_QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
              "max_position_embeddings": 512, "rope_theta": 10000.0}  # fmt: skip


def cpu_dry_run_of(tmp_path, config: dict) -> subprocess.CompletedProcess:
    """`launch/submit.py --dry-run -- model.path=<config> trainer.runtime=cpu actor.world_size=1`."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    return subprocess.run(
        [sys.executable, SUBMIT, "--nodes", "1", "--gpus-per-node", "0", *SLURM, "--dry-run", "--",
         f"model.path={tmp_path}", "trainer.runtime=cpu", "actor.world_size=1"],
        capture_output=True, text=True, env=default_env(), cwd=REPO, timeout=300,
    )  # fmt: skip


def test_a_command_naming_its_model_is_checked_over_the_schema_defaults(tmp_path) -> None:
    """A dense model named by model.path: configs/default.yaml's tiny job (EP 2) does not leak into the dry run (it
    refused a dense model: 'ep=2 but the model has no experts'), as it does not leak into the run itself."""
    res = cpu_dry_run_of(tmp_path, TINY_QWEN2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "composed over mcore_rl/config/'s defaults" in res.stdout
    assert "ep=1" in res.stdout


def test_a_cpu_dry_run_of_a_model_its_family_refuses_exits_2_naming_the_field(tmp_path) -> None:
    """The CPU dry run estimates each rank's memory from the model's Megatron config: a config.json its family refuses
    (here: no rope_theta) is a user error (exit 2, the field named), not a traceback."""
    res = cpu_dry_run_of(tmp_path, {k: v for k, v in TINY_QWEN2.items() if k != "rope_theta"})
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "rope_theta is missing" in res.stderr


def test_a_verl_command_with_an_unknown_key_is_refused_by_the_dry_run_naming_all(world) -> None:
    home, env = world
    args = [*script_args("ppo_quickstart", home), "trainer.no_such_key=1", "actor_rollout_ref.model.lora_rank=8"]
    res = subprocess.run(
        [sys.executable, SUBMIT, "--nodes", "1", "--gpus-per-node", "1", *SLURM, "--dry-run", "--", *args],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "trainer.no_such_key" in res.stderr and "lora_rank=8" in res.stderr  # every problem at once


def test_recompute_on_cpu_is_refused_by_preflight_naming_the_key() -> None:
    """Megatron's recompute saves the CUDA RNG state: on trainer.runtime=cpu the first update crashed after Ray and
    the ranks had started. Pre-flight refuses it (exit 2) before Ray starts."""
    res = subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", "actor.recompute.granularity=full",
         "actor.recompute.method=uniform", "actor.recompute.num_layers=1", "trainer.steps=1"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "actor.recompute.granularity='full' is invalid with trainer.runtime=cpu" in res.stderr
    assert "Traceback" not in res.stderr and "Started a local Ray instance" not in res.stdout + res.stderr
