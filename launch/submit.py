"""Submit an RL job to Slurm with a Ray cluster spanning its nodes, check it first, or run it locally.

    python launch/submit.py --nodes 32 --gpus-per-node 8 --partition gpu --time 24:00:00 --job-name qwen3 \
        [--account A] [--cpus-per-node C] [--ray-num-cpus R] [--dry-run] [--local] [--run-dir DIR] \
        [--nccl-socket-ifname ib0] [--nccl-ib-hca mlx5] [--env KEY=VAL ...] \
        -- --config-name qwen3_235b_a22b_32n model.path=/ckpt/Qwen3-235B-A22B

Everything after `--` is passed to `python -m mcore_rl.train` (Hydra overrides; `--config-name X` picks a recipe
from configs/). First, before any heavy import, a submission needs sbatch on PATH and the partition must be one sinfo
lists (a dry run notes a failing sinfo and goes on). Then, before anything is written, the config is composed
in-process and checked against N x G:

- Placement (mcore_rl/controller/gpu_plan.py, the check the run itself makes against Ray): every actor, critic and
  engine rank on the N*G GPUs. trainer.placement=split: actor.world_size + critic.world_size + the engines' GPUs
  (rollout.num_engines x rollout.sglang.tp, or x rollout.vllm.tp x rollout.vllm.dp); colocated: actor.world_size,
  which the critic and the engines share. An
  engine's tp / nnodes GPUs per node must fit (and, colocated, divide) a node. The sync transport must suit it:
  colocated engines on CUDA take sync.transport=tensor (NCCL refuses an actor and an engine rank of one broadcast
  group on one GPU), split engines distributed or disk. (trainer.runtime=cpu jobs skip the GPU checks.)
- GPU packages (mcore_rl/gpu_extra.py): where SGLang is installed, its tested set (constraints-gpu.txt).
- Weight sync (mcore_rl/controller/recipe_check.py): the real plan for the run's engines, from the meta-device model:
  the engine layout divides the model, every byte reaches every engine rank once, tensors an engine must receive
  together share a bucket, the buckets (any larger than sync.bucket_bytes: one tensor each), the NCCL groups per
  engine GPU (bounded), the sender's extra memory and the predicted sync time (resharding/sync/forecast.py).
- Memory per GPU (mcore_rl/models/estimate.py): parameters of the fullest rank from the meta-device model at the
  actor's layout; bytes per parameter from the optimizer plan the ranks build (mcore_rl/actor/optimizer.py:
  weights, fp32 main grads, fp32 masters + Adam state sharded by `actor.optim.distributed`, partly on the host with
  `actor.optim.offload_fraction`) + a reference copy when actor.use_ref + activations under actor.recompute +
  4 GiB CUDA context/NCCL; the critic's the same way at its own layout. Colocated, per phase of a shared GPU:
  training (engines released; vLLM's cannot release here, so its share stays), the weight push (the engines' weights
  resumed + the sender's sync buffers) and generation (the actor offloaded: its CUDA context + the engine's share
  of the GPU: rollout.sglang.mem_fraction_static or rollout.vllm.gpu_memory_utilization). The largest
  more than --gpu-memory-gb is refused.

The sbatch script (written to <run_dir>/<job-name>.sbatch, via a temp file + rename):
- `srun --overlap --nodes=1 --ntasks=1 -w <head>` runs `ray start --head --block` on the first node; once its GCS
  answers, one `srun --overlap` step runs `ray start --address=<head>:<port> --block` on each other node (never
  before the head: workers that start first give up). `--overlap` lets these steps share the allocation with the
  driver and with each other (without it Slurm queues the second step behind the first).
- It waits until N nodes with N*G GPUs are registered (ray.nodes()), or fails after RAY_WAIT_TIMEOUT s (default 600)
  naming the counts it saw; the node list is written to <run_dir>/ray_nodes.json.
- It exports the NCCL/Gloo settings, runs `python -m mcore_rl.train trainer.ray_address=<head:port> <overrides>` on
  the batch host (Slurm runs the batch script on the first node, which is the Ray head), and stops Ray on exit, on
  failure and on scancel (trap EXIT, TERM, INT: the srun steps are signalled; each `ray start --block` then stops the
  Ray processes it started, at once: RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 turns off Ray's drain wait of up to
  30 s; Slurm reaps what is left of the steps).

Port scheme (two jobs sharing nodes never collide unless their job ids are equal modulo 100):
    slot = SLURM_JOB_ID % 100;  base = 10000 + 220 * slot         (10000 .. 31999)
    base+0 GCS, +1 node manager, +2 object manager, +3 ray client server, +4 dashboard agent grpc,
    +5 dashboard agent http, +6 metrics export, +7 runtime-env agent; workers bind base+20 .. base+219.
    Each job also gets its own Ray auth token (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN in the job's environment).
    The dashboard is off. All ports stay below Linux's default ephemeral range (32768-60999), so outgoing
    connections cannot take them. Each job also gets its own Ray temp dir, /tmp/ray_j<SLURM_JOB_ID>.

Exit codes: 0 ok; 2 bad input (usage, zero nodes, unknown partition, a config or layout that does not fit); 1 the
environment (sbatch missing or failing) or, with --local, the training run's own non-zero code.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import unicodedata
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script from a checkout: import the package beside launch/
    sys.path.insert(0, REPO)

PORT_SLOTS = 100
PORT_BLOCK = 220
PORT_FLOOR = 10000
WORKER_PORT_OFFSET = 20
GIB = 1024**3


class SubmitError(Exception):
    """Bad input or environment; `code` is the process exit status."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def ray_ports(job_id: int) -> dict[str, int]:
    """The Ray ports of one Slurm job (the scheme in the module docstring; the sbatch script computes the same)."""
    base = PORT_FLOOR + PORT_BLOCK * (job_id % PORT_SLOTS)
    return {
        "GCS_PORT": base,
        "NODE_MANAGER_PORT": base + 1,
        "OBJECT_MANAGER_PORT": base + 2,
        "CLIENT_SERVER_PORT": base + 3,
        "AGENT_GRPC_PORT": base + 4,
        "AGENT_HTTP_PORT": base + 5,
        "METRICS_PORT": base + 6,
        "RUNTIME_ENV_PORT": base + 7,
        "MIN_WORKER_PORT": base + WORKER_PORT_OFFSET,
        "MAX_WORKER_PORT": base + PORT_BLOCK - 1,
    }


def port_block() -> str:
    """The bash lines that derive the ports from SLURM_JOB_ID (mirrors `ray_ports`)."""
    lines = [
        f"PORT_BASE=$(( {PORT_FLOOR} + {PORT_BLOCK} * (SLURM_JOB_ID % {PORT_SLOTS}) ))",
    ]
    for name, port in ray_ports(0).items():
        lines.append(f"{name}=$(( PORT_BASE + {port - PORT_FLOOR} ))")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- the config check


@dataclass
class CheckReport:
    """What the dry-run check found: printable lines, and the run dir of the composed config."""

    lines: list[str] = field(default_factory=list)
    run_dir: str = "runs/latest"


def compose_config(overrides: list[str]) -> Any:
    """The run's validated config, composed by the function `python -m mcore_rl.train <overrides>` composes it with
    (mcore_rl/compat/verl/cli.py: compose_command): verl's keys translated over verl's defaults (each translated key
    printed, as train prints it), ours over configs/<recipe>, or over the schema's defaults when the command names
    model.path without a recipe. Every problem of the command in one SubmitError (exit 2)."""
    from mcore_rl.compat.verl.cli import SCHEMA_BASE_NOTE, compose_command, resolve

    t = resolve(overrides)
    for line in t.lines:
        print(f"verl: {line}")
    if not t.verl and len(t.hydra_args) > len(overrides):
        print(SCHEMA_BASE_NOTE)
    try:
        return compose_command(overrides, t)
    except ValueError as err:  # ConfigError (every problem, one per line) and models' LayoutError
        raise SubmitError("config error: " + str(err).replace("\n", "\nconfig error: ")) from None


def _hf_dict(cfg: Any) -> dict[str, Any]:
    if cfg.model.path:
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            return json.load(f)
    return dict(cfg.model.hf_config)


def _count(n: float) -> str:
    """A parameter count in B (>= 0.1 B) or M, so tiny test models do not print as 0.0 B."""
    return f"{n / 1e9:.1f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def check_config(cfg: Any, nodes: int, gpus_per_node: int, gpu_memory_gb: float) -> CheckReport:
    """Placement, GPU packages, the weight-sync plan and per-GPU memory against N x G (the module docstring);
    SubmitError (exit 2) naming the key and the figures when the run would fail."""
    from mcore_rl.models.estimate import EngineShare, count_params
    from mcore_rl.models.spec import te_in_use

    report = CheckReport(run_dir=cfg.trainer.run_dir)
    gpus = nodes * gpus_per_node
    world = cfg.actor.world_size
    lay = cfg.actor.layout
    hf = _hf_dict(cfg)
    counts = count_params(hf)
    report.lines.append(
        f"model: {hf.get('model_type')} {_count(counts.total)} params "
        f"(dense {_count(counts.dense)}, routed experts {_count(counts.expert)})"
    )
    report.lines.append(
        f"actor: world_size={world} layout tp={lay.tp} pp={lay.pp} cp={lay.cp} ep={lay.ep} "
        f"etp={lay.etp if lay.etp is not None else lay.tp} vpp={lay.vpp} sp={lay.sequence_parallel}"
        + (
            f" first_stage_layers={lay.first_stage_layers} last_stage_layers={lay.last_stage_layers}"
            if lay.first_stage_layers or lay.last_stage_layers
            else ""
        )
    )
    if cfg.trainer.runtime != "cuda":
        report.lines.append(
            f"trainer.runtime={cfg.trainer.runtime}: GPU world-size and memory checks skipped "
            f"({nodes} node(s) x {gpus_per_node} GPU(s))"
        )
        # what each rank's process will hold in host memory (tools/bench_memory_estimate.py measures it)
        report.lines.append(
            f"memory per rank (estimate, host memory; micro_batch={_micro_batch(cfg, cfg.actor)}, "
            f"seq={cfg.model.max_sequence_length}, the local spec's attention):"
        )
        try:
            report.lines.append(actor_estimate(cfg).describe())
        except ValueError as err:  # the model's config.json refused by its family (UnsupportedModel, LayoutError)
            raise SubmitError(f"model error: {err}") from None
        return report
    if gpus == 0:
        raise SubmitError(f"trainer.runtime=cuda needs GPUs, but --nodes {nodes} x --gpus-per-node 0 gives none")
    from mcore_rl.controller.gpu_plan import PlacementError, check_fits, check_transport, engine_shape
    from mcore_rl.controller.recipe_check import RecipeError, check_sync
    from mcore_rl.gpu_extra import gpu_extra_problems

    try:  # every actor, critic and engine rank on the allocation's GPUs; the transport the placement can use
        count = check_fits(cfg, gpus, gpus_per_node, f"--nodes {nodes} x --gpus-per-node {gpus_per_node}")
        check_transport(cfg)
    except PlacementError as err:
        raise SubmitError(str(err)) from None
    report.lines.append(f"placement: {count.describe()} ({nodes} nodes x {gpus_per_node} GPUs)")
    from mcore_rl.actor.runtime import layout_problem

    for name, group in [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.critic.enable else []):
        # what pre-flight refuses on the GPU node (with Transformer Engine there): a layout the workers cannot run
        problem = layout_problem(name, group.layout.cp, "cuda", te=True)
        if problem:
            raise SubmitError(problem)
    problems, note = gpu_extra_problems()  # the GPU packages, where this machine has them
    if problems:
        raise SubmitError("the GPU extra is not the tested set: " + "; ".join(problems))
    report.lines.append(f"GPU packages: {note}")
    try:  # the real sync plan for the engines this run starts
        sync = check_sync(cfg, hf, gpus_per_node)
    except RecipeError as err:
        raise SubmitError(str(err)) from None
    report.lines += sync.lines
    limit = gpu_memory_gb * GIB
    colocated = count.placement == "colocated"
    engine = None
    shape = engine_shape(cfg.rollout, cfg.trainer.runtime)
    if colocated and shape.memory_key:
        # engine weights: the whole model over the engine's GPUs at its tensor parallelism, bf16 (fp8 when the sync
        # sends FP8 weights); vLLM's dp replicas each hold the whole model at tp
        weights = counts.total * (1 if cfg.sync.fp8 else 2) / shape.tp
        engine = EngineShare(weights=weights, static=shape.memory_fraction * limit, releases=shape.releases)
        if weights >= engine.static:
            raise SubmitError(
                f"the colocated rollout engine's weights ({weights / GIB:.1f} GiB per GPU at "
                f"{shape.key}.tp={shape.tp}) "
                f"leave no KV cache in {shape.memory_key}={shape.memory_fraction} x "
                f"{gpu_memory_gb:g} GiB: raise {shape.key}.tp or {shape.memory_key.rsplit('.', 1)[1]}, or sync.fp8=true"
            )
    # the actor's own figures (no engine): the phases of a shared GPU are added below, with the actor offloaded
    # while the engines generate, which the estimate alone does not model
    est = _estimate(cfg, cfg.actor, hf, None if colocated else engine, use_ref=cfg.actor.use_ref)
    report.lines.append(
        f"memory per GPU (estimate; micro_batch={_micro_batch(cfg, cfg.actor)}, seq={cfg.model.max_sequence_length}, "
        f"recompute={cfg.actor.recompute.granularity or 'off'}, attention fused: Transformer Engine's spec):"
    )
    report.lines.append(est.describe())
    if not te_in_use(cfg.trainer.runtime):  # the GPU set brings TE; where it is missing the ranks build the local spec
        local = _estimate(cfg, cfg.actor, hf, None if colocated else engine, cfg.actor.use_ref, fused_attention=False)
        report.lines.append(
            f"  without Transformer Engine (not importable here; the local spec keeps each layer's s^2 attention "
            f"probabilities): activations {local.activations / GIB:.1f} GiB, training peak {local.total / GIB:.1f} GiB"
        )
    critic = _estimate(cfg, cfg.critic, hf, None, use_ref=False) if cfg.critic.enable else None
    total = est.total
    if colocated:  # the phases of one shared GPU (controller/placement.py)
        shared = critic.resident if critic is not None else 0.0  # the critic keeps its state on the GPU
        engine_static = engine.static if engine is not None else 0.0
        phases = {
            "training (engines released)" if engine is None or engine.releases else "training (engines kept)":
            est.training + shared + (max(0.0, critic.activations - est.activations) if critic is not None else 0.0)
            + (engine.static if engine is not None and not engine.releases else 0.0),
            "weight push (engine weights resumed, the actor's sync buffers)": est.resident + shared
            + (engine.weights if engine is not None else 0.0) + sync.sender_extra_bytes,
            "generating (the actor offloaded)": est.overhead + shared + engine_static,
        }  # fmt: skip
        if engine is not None:
            report.lines.append(
                f"  colocated engine:    {engine.static / GIB:.1f} GiB (weights {engine.weights / GIB:.1f} GiB + KV "
                f"cache {(engine.static - engine.weights) / GIB:.1f} GiB; "
                + ("released while training)" if engine.releases else "kept while training: vLLM cannot release it)")
            )
        if critic is not None:
            report.lines.append(f"  critic on the same GPUs: {critic.resident / GIB:.1f} GiB resident")
        report.lines += [f"  {name}: {value / GIB:.1f} GiB" for name, value in phases.items()]
        total = max(phases.values())
    elif critic is not None:
        report.lines.append(f"critic per GPU (its own GPUs): {critic.total / GIB:.1f} GiB")
        total = max(total, critic.total)
    if total > limit:
        raise SubmitError(
            "layout does not fit in GPU memory: estimated "
            f"{total / GIB:.1f} GiB per GPU > --gpu-memory-gb {gpu_memory_gb:g} GiB\n"
            + "\n".join(report.lines)
            + "\nraise tp/pp/ep (or etp), set actor.optim.distributed=true or actor.optim.offload_fraction, "
            f"lower {shape.memory_key or 'rollout.sglang.mem_fraction_static'} or sync.bucket_bytes, or use more nodes"
        )
    report.lines.append(f"fits: {total / GIB:.1f} GiB of {limit / GIB:.1f} GiB per GPU")
    return report


def _micro_batch(cfg: Any, group: Any) -> int:
    """Samples of full length in one micro-batch of a worker group (controller/memory_estimate.py)."""
    from mcore_rl.controller.memory_estimate import micro_batch_samples

    return micro_batch_samples(cfg, group)


def actor_estimate(cfg: Any) -> Any:
    """The actor's per-rank estimate as the dry run prints it for a CPU recipe (controller/memory_estimate.py; what
    tools/bench_memory_estimate.py compares with the ranks)."""
    from mcore_rl.controller.memory_estimate import actor_estimate as estimate

    return estimate(cfg, _hf_dict(cfg))


def _estimate(
    cfg: Any, group: Any, hf: dict[str, Any], engine: Any, use_ref: bool, fused_attention: bool = True
) -> Any:
    """The per-GPU figures of one worker group (the actor, or the critic): controller/memory_estimate.py's
    group_estimate, parameters per rank from the meta-device model."""
    from mcore_rl.controller.memory_estimate import group_estimate

    return group_estimate(cfg, group, hf, engine, use_ref, fused_attention=fused_attention)


# ------------------------------------------------------------------------------------------------- the sbatch script


#: Environment of GPU runs (defaults: a value already in the environment or given with --env wins):
#: - CUDA_DEVICE_MAX_CONNECTIONS=1: Megatron's TP/SP overlap orders its communication kernels by launch order, which
#:   needs one hardware queue (Megatron-LM, slime and verl all set it).
#: - PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: RL batches change length every step; expandable segments keep
#:   the allocator from fragmenting across them (and colocated offload/onload).
#: - NCCL_CUMEM_ENABLE=0: what SGLang and vLLM set in their processes; the weight-sync groups join the trainer's NCCL to
#:   theirs, and both sides must agree on the memory NCCL registers.
#: - TORCH_NCCL_AVOID_RECORD_STREAMS=1: frees collective buffers at once instead of at the next stream sync.
#: - MCORE_RL_DIST_TIMEOUT_S / TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: a collective may wait for a peer reading its part of a
#:   1.3 TB checkpoint (DeepSeek-V3 FP8 dequantised on load): an hour, not torch's 10 minutes.
GPU_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "NCCL_CUMEM_ENABLE": "0",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "MCORE_RL_DIST_TIMEOUT_S": "3600",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "3600",
}


def comm_env(args: argparse.Namespace) -> dict[str, str]:
    """NCCL/Gloo settings from the flags, then --env KEY=VAL (later wins)."""
    env: dict[str, str] = {}
    for key, value in (
        ("NCCL_SOCKET_IFNAME", args.nccl_socket_ifname),
        ("GLOO_SOCKET_IFNAME", args.gloo_socket_ifname or args.nccl_socket_ifname),
        ("NCCL_IB_HCA", args.nccl_ib_hca),
        ("NCCL_NET_GDR_LEVEL", args.nccl_net_gdr_level),
    ):
        if value:
            env[key] = value
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise SubmitError(f"--env {item!r}: expected KEY=VALUE")
        env[key] = value
    return env


# Run inside the job by wait_for_ray: poll ray.nodes() until the expected nodes and GPUs are alive, or time out; fail
# at once when one of the `ray start` srun steps (pids after the 5 fixed arguments) has already exited, e.g. a head that
# timed out during its own start-up, instead of waiting out RAY_WAIT_TIMEOUT.
WAIT_SNIPPET = r"""import json, os, sys, time
import ray
addr, out = sys.argv[1], sys.argv[5]
want_nodes, want_gpus, timeout = int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
steps = [int(p) for p in sys.argv[6:] if p]
def exited(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
deadline, seen = time.time() + timeout, (0, 0.0, 0.0)
while time.time() < deadline:
    dead = [p for p in steps if exited(p)]
    if dead:
        print(f"submit: error: the `ray start` srun step(s) {dead} exited before Ray had {want_nodes} nodes "
              f"(seen {seen[0]}); see the Ray logs under /tmp/ray_j* on each node", file=sys.stderr)
        sys.exit(1)
    try:  # ray.init fails until the head's GCS answers
        if not ray.is_initialized():
            ray.init(address=addr, log_to_driver=False, logging_level="ERROR")
        alive = [n for n in ray.nodes() if n["Alive"]]
        res = [n["Resources"] for n in alive]
        seen = (len(alive), sum(r.get("GPU", 0) for r in res), sum(r.get("CPU", 0) for r in res))
        if seen[0] >= want_nodes and seen[1] >= want_gpus:
            print(f"submit: Ray has {seen[0]} nodes, {seen[1]:g} GPUs, {seen[2]:g} CPUs", flush=True)
            nodes = [{"node": n["NodeManagerHostname"], "ip": n["NodeManagerAddress"], "resources": n["Resources"]}
                     for n in alive]
            with open(out, "w") as f:
                json.dump(nodes, f)
            sys.exit(0)
    except Exception:
        pass
    time.sleep(2)
print(f"submit: error: Ray at {addr} registered {seen[0]}/{want_nodes} nodes, {seen[1]:g}/{want_gpus:g} GPUs, "
      f"{seen[2]:g} CPUs after {timeout:g} s (RAY_WAIT_TIMEOUT); see the Ray logs under /tmp/ray_j* on each node",
      file=sys.stderr)
sys.exit(1)
"""


def render_script(args: argparse.Namespace, overrides: list[str], run_dir: str) -> str:
    """The sbatch script text."""
    q = shlex.quote
    directives = [
        f"#SBATCH --job-name={args.job_name}",
        f"#SBATCH --nodes={args.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --partition={args.partition}",
        f"#SBATCH --time={args.time}",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        f"#SBATCH --chdir={REPO}",
    ]
    if args.gpus_per_node:
        directives.append(f"#SBATCH --gpus-per-node={args.gpus_per_node}")
    if args.cpus_per_node:
        directives.append(f"#SBATCH --cpus-per-task={args.cpus_per_node}")
    if args.account:
        directives.append(f"#SBATCH --account={args.account}")
    exports = "\n".join(f"export {k}={q(v)}" for k, v in comm_env(args).items()) or "# (no NCCL/Gloo settings given)"
    exports += "\n# GPU run defaults (launch/submit.py: GPU_ENV)\n" + "\n".join(
        f"export {k}=${{{k}:-{v}}}" for k, v in GPU_ENV.items() if k not in comm_env(args)
    )
    python = sys.executable
    ray_bin = os.path.join(os.path.dirname(python), "ray")
    train = " ".join(q(a) for a in [python, "-m", "mcore_rl.train", *overrides])
    # Ray's CPUs are logical (they only gate scheduling): --ray-num-cpus may exceed the cores Slurm gives
    cpus = str(args.ray_num_cpus or args.cpus_per_node or "${SLURM_CPUS_ON_NODE:-1}")
    return f"""#!/bin/bash
# Written by launch/submit.py: Ray head + workers over this allocation, then the RL driver on the head.
{chr(10).join(directives)}
set -euo pipefail

PYTHON={q(python)}
RAY={q(ray_bin)}
RUN_DIR={q(run_dir)}
NNODES={args.nodes}
GPUS_PER_NODE={args.gpus_per_node}
CPUS_PER_NODE={cpus}
RAY_WAIT_TIMEOUT=${{RAY_WAIT_TIMEOUT:-600}}
mkdir -p "$RUN_DIR"

# NCCL / Gloo settings (exported before srun, which propagates the environment to every step)
{exports}

# Ports from SLURM_JOB_ID: jobs sharing nodes get disjoint blocks (see launch/submit.py)
{port_block()}
RAY_TMP=/tmp/ray_j${{SLURM_JOB_ID}}
# Ray >= 2.5x enables token authentication. A per-job token in the environment (srun passes it to every step and the
# driver inherits it) needs no shared ~/.ray/auth_token and keeps jobs sharing nodes out of each other's clusters.
export RAY_AUTH_MODE=${{RAY_AUTH_MODE:-token}}
export RAY_AUTH_TOKEN=${{RAY_AUTH_TOKEN:-$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')}}
# On SIGTERM, `ray start --block` (Ray >= 2.5x) first marks its node as draining and waits up to 30 s for its workers
# to hand their leases back (meant for Ray Serve on Kubernetes). When the job ends the driver is gone or going, so
# the wait only delays the teardown, by about 30 s after a scancel early in a run, i.e. Slurm's whole default KillWait,
# after which Slurm SIGKILLs what is left. 0 stops the Ray processes at once.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${{RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}}
RAY_PORT_ARGS=(--node-manager-port=$NODE_MANAGER_PORT --object-manager-port=$OBJECT_MANAGER_PORT \\
  --ray-client-server-port=$CLIENT_SERVER_PORT --dashboard-agent-grpc-port=$AGENT_GRPC_PORT \\
  --dashboard-agent-listen-port=$AGENT_HTTP_PORT --metrics-export-port=$METRICS_PORT \\
  --runtime-env-agent-port=$RUNTIME_ENV_PORT --min-worker-port=$MIN_WORKER_PORT --max-worker-port=$MAX_WORKER_PORT \\
  --num-cpus=$CPUS_PER_NODE --num-gpus=$GPUS_PER_NODE --temp-dir=$RAY_TMP --disable-usage-stats)

HEAD_PID=""; WORKERS_PID=""; TRAIN_PID=""
cleanup() {{
  local rc=$?
  trap - EXIT TERM INT
  echo "submit: stopping Ray (exit code $rc)"
  [ -n "$TRAIN_PID" ] && kill -TERM "$TRAIN_PID" 2>/dev/null || true
  # The driver's SIGTERM handling (write FAILED, stop its engines and ranks, exit 143) takes up to
  # mcore_rl.lifecycle.TERM_CLEANUP_S (15 s): wait for it, under Slurm's KillWait (30 s). Once this script exits,
  # slurmstepd SIGKILLs every process left in the batch step, and a driver killed there left no FAILED marker (its
  # handler runs in the main thread, which may be inside a blocking Ray call until Ray's processes go).
  for _ in $(seq 25); do [ -n "$TRAIN_PID" ] && kill -0 "$TRAIN_PID" 2>/dev/null || break; sleep 1; done
  # srun forwards SIGTERM to its `ray start --block` tasks, which stop the Ray processes they started. No `ray stop`:
  # it would kill every Ray of this user on the node, including other jobs sharing it.
  for pid in $WORKERS_PID $HEAD_PID; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 30); do
    alive=0; for pid in $WORKERS_PID $HEAD_PID; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break; sleep 1
  done
  exit $rc
}}
trap cleanup EXIT
trap 'exit 143' TERM   # scancel
trap 'exit 130' INT

wait_for_ray() {{  # wait_for_ray NODES GPUS: until Ray at $RAY_ADDRESS has them, or fail naming what it saw
  "$PYTHON" - "$RAY_ADDRESS" "$1" "$2" "$RAY_WAIT_TIMEOUT" "$RUN_DIR/ray_nodes.json" $HEAD_PID $WORKERS_PID <<'PY'
{WAIT_SNIPPET}PY
}}

NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
HEAD=${{NODES[0]}}
HEAD_IP=$(srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" hostname -I | awk '{{print $1}}')
export RAY_ADDRESS=$HEAD_IP:$GCS_PORT
echo "submit: job $SLURM_JOB_ID head $HEAD ($RAY_ADDRESS), ${{#NODES[@]}} nodes, ports $PORT_BASE..$MAX_WORKER_PORT"

srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" \\
  "$RAY" start --head --block --node-ip-address="$HEAD_IP" --port=$GCS_PORT --include-dashboard=false \\
  "${{RAY_PORT_ARGS[@]}}" &
HEAD_PID=$!
wait_for_ray 1 0   # workers that start before the head's GCS answers give up, so start them after

if [ "$NNODES" -gt 1 ]; then
  srun --overlap --nodes=$((NNODES - 1)) --ntasks=$((NNODES - 1)) --ntasks-per-node=1 --exclude="$HEAD" \\
    "$RAY" start --block --address="$RAY_ADDRESS" "${{RAY_PORT_ARGS[@]}}" &
  WORKERS_PID=$!
fi
wait_for_ray "$NNODES" $((NNODES * GPUS_PER_NODE))

# The batch script runs on the first node of the allocation, i.e. on the Ray head. Run the driver in the background
# and `wait` for it, so that scancel's SIGTERM reaches the trap at once instead of after the driver exits.
{train} trainer.ray_address="$RAY_ADDRESS" &
TRAIN_PID=$!
wait $TRAIN_PID
"""


def write_script(run_dir: str, job_name: str, text: str) -> str:
    """Write the script atomically (temp file in the same dir + rename) and return its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, f"{job_name}.sbatch")
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{job_name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path


SINFO_TIMEOUT_S = 15.0  # sinfo's own retries against a controller that does not answer take ~50 s


def check_partition(partition: str, dry_run: bool = False) -> None:
    """Refuse a partition sinfo does not list (skipped when sinfo is absent). When sinfo itself fails (no controller
    answers), a dry run says so and goes on, since it submits nothing; a submission is refused."""
    sinfo = shutil.which("sinfo")
    if not sinfo:
        return
    try:
        res = subprocess.run([sinfo, "-h", "-o", "%P"], capture_output=True, text=True, timeout=SINFO_TIMEOUT_S)
        failure = f"sinfo failed ({res.returncode}): {res.stderr.strip()}" if res.returncode != 0 else ""
    except subprocess.TimeoutExpired:  # a controller that does not answer (munge down: ~50 s of retries)
        failure = f"sinfo did not answer in {SINFO_TIMEOUT_S:g} s"
    if failure:
        if dry_run:
            print(f"submit: partition {partition!r} not checked: {failure}")
            return
        raise SubmitError(failure, code=1)
    known = sorted({p.strip().rstrip("*") for p in res.stdout.split() if p.strip()})
    if partition not in known:
        raise SubmitError(f"unknown partition {partition!r}; sinfo lists: {', '.join(known) or '(none)'}")


NO_SBATCH = "sbatch not found on PATH: run on a Slurm login node or use --local/--dry-run"


def submit(script: str) -> int:
    """sbatch the script; returns the job id."""
    sbatch = shutil.which("sbatch")
    if not sbatch:
        raise SubmitError(NO_SBATCH, code=1)
    res = subprocess.run([sbatch, "--parsable", script], capture_output=True, text=True)
    if res.returncode != 0:
        raise SubmitError(f"sbatch failed ({res.returncode}): {res.stderr.strip()}", code=1)
    match = re.match(r"\s*(\d+)", res.stdout)
    if not match:
        raise SubmitError(f"could not read a job id from sbatch's output: {res.stdout!r}", code=1)
    return int(match.group(1))


def run_local(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run the driver here without Slurm (it starts its own local Ray), with the same NCCL/Gloo environment."""
    env = dict(os.environ, **comm_env(args))
    for key, value in GPU_ENV.items():
        env.setdefault(key, value)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "mcore_rl.train", *overrides]
    print("submit: local run:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    return subprocess.run(cmd, env=env, cwd=REPO).returncode


# --------------------------------------------------------------------------------------------------------------- CLI
#: sbatch --time formats (man sbatch): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, and UNLIMITED / infinite
SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|unlimited|infinite", re.ASCII)


#: Slurm partition and account names (sbatch -p takes a comma-separated list of partitions)
SLURM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", re.ASCII)
SLURM_NAMES = re.compile(rf"{SLURM_NAME.pattern}(,{SLURM_NAME.pattern})*", re.ASCII)
#: NCCL/Gloo interface and HCA lists: names, '^' (exclude), '=' (exact match), ':' (port), ',' separated
COMM_VALUE = re.compile(r"[A-Za-z0-9_.:,^=@/+-]{1,256}", re.ASCII)


def line_break(value: str) -> str | None:
    """The first character of `value` that ends or breaks a line for some reader (bash: \n; Slurm, editors and
    Python's splitlines: \r, \x0b, \x0c, \x1c-\x1e, \x85, U+2028, U+2029) or is another control character
    (NUL ends the value in C), as its repr; None when there is none."""
    for char in value:
        if unicodedata.category(char) in ("Cc", "Zl", "Zp"):
            return repr(char)
    return None


def check_script_values(args: argparse.Namespace, overrides: list[str], run_dir: str) -> None:
    """Every value the sbatch script holds stays on its own line: SubmitError (exit 2) naming the flag otherwise.

    Slurm reads `#SBATCH` lines up to the first line that is not one, so a line break in a value would add a directive
    (`--uid=0`) or a shell command, and drop the directives after it (--time, --output, --chdir)."""
    if not SLURM_NAMES.fullmatch(args.partition):
        raise SubmitError(
            f"--partition {args.partition!r} is not a Slurm partition name; expected letters, digits, '_', '.' or "
            "'-' (a comma-separated list for several)"
        )
    if args.account is not None and not SLURM_NAME.fullmatch(args.account):
        raise SubmitError(
            f"--account {args.account!r} is not a Slurm account name; expected letters, digits, '_', '.' or '-'"
        )
    for flag, value in (
        ("--nccl-socket-ifname", args.nccl_socket_ifname),
        ("--gloo-socket-ifname", args.gloo_socket_ifname),
        ("--nccl-ib-hca", args.nccl_ib_hca),
        ("--nccl-net-gdr-level", args.nccl_net_gdr_level),
    ):
        if value is not None and not COMM_VALUE.fullmatch(value):
            raise SubmitError(
                f"{flag} {value!r} is not an interface, HCA list or level; expected letters, digits and "
                "'_.:,^=@/+-' (e.g. ib0, ^docker,lo, mlx5_0:1,mlx5_1:1, PHB)"
            )
    for item in args.env:
        bad = line_break(item)
        if bad:
            raise SubmitError(f"--env {item!r} holds {bad}: a value of the script must stay on one line")
    # the run dir is the #SBATCH --output directive's value: Slurm ends it at whitespace and expands '%' patterns
    bad = line_break(run_dir) or next((repr(c) for c in run_dir if c.isspace() or c == "%"), None)
    if bad:
        flag = "--run-dir" if args.run_dir else "trainer.run_dir"
        raise SubmitError(
            f"{flag} {run_dir!r} holds {bad}: the run dir goes into #SBATCH --output; expected a path without "
            "whitespace, control characters or '%'"
        )
    bad = line_break(REPO) or next((repr(c) for c in REPO if c.isspace() or c == "%"), None)
    if bad:
        raise SubmitError(f"the checkout's path {REPO!r} holds {bad}: it goes into #SBATCH --chdir; move it")
    for override in overrides:
        bad = line_break(override)
        if bad:
            raise SubmitError(
                f"the training override {override!r} holds {bad}: the script runs it on one line; expected a value "
                "without control characters (put a multi-line value in a config file under configs/)"
            )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch/submit.py",
        description="Submit an mcore_rl job to Slurm with Ray across its nodes (or --dry-run / --local).",
        epilog="Everything after `--` goes to `python -m mcore_rl.train` (Hydra overrides; `--config-name X`).",
    )
    p.add_argument("--nodes", type=int, required=True, help="number of nodes N (> 0)")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node G (>= 0; 0 for CPU jobs)")
    p.add_argument("--partition", required=True, help="Slurm partition (checked with sinfo when present)")
    p.add_argument("--time", required=True, help="Slurm time limit, e.g. 24:00:00")
    p.add_argument("--job-name", required=True, help="Slurm job name; the script is <run_dir>/<job-name>.sbatch")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--cpus-per-node", type=int, help="CPUs per node given to Slurm and Ray (default: Slurm's)")
    p.add_argument(
        "--ray-num-cpus", type=int, help="logical CPUs each Ray node advertises (default: --cpus-per-node or Slurm's)"
    )
    p.add_argument("--run-dir", help="where the script and slurm-<id>.out go (default: the config's trainer.run_dir)")
    p.add_argument("--dry-run", action="store_true", help="check the config against N x G and print the script")
    p.add_argument("--local", action="store_true", help="run here without Slurm (the driver starts a local Ray)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="GPU memory in GiB (default 80)")
    p.add_argument("--nccl-socket-ifname", help="NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME unless given)")
    p.add_argument("--gloo-socket-ifname", help="GLOO_SOCKET_IFNAME")
    p.add_argument("--nccl-ib-hca", help="NCCL_IB_HCA, e.g. mlx5_0,mlx5_1 or ^mlx5_4")
    p.add_argument("--nccl-net-gdr-level", help="NCCL_NET_GDR_LEVEL, e.g. PHB or SYS")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VAL", help="extra exported variable (repeat)")
    return p


def script_run_dir(args: argparse.Namespace, config_run_dir: str) -> str:
    """The absolute directory of the script and the Slurm log: --run-dir, else the config's trainer.run_dir (a relative
    one under the checkout)."""
    run_dir = args.run_dir or config_run_dir
    return run_dir if os.path.isabs(run_dir) else os.path.abspath(os.path.join(REPO, run_dir))


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The flags and the training overrides (after `--`), every flag's value checked; SubmitError (exit 2) naming the
    flag otherwise (argparse's own usage errors exit 2 too)."""
    overrides: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    if args.nodes < 1:
        raise SubmitError(f"--nodes must be a positive integer, got {args.nodes}")
    if args.gpus_per_node < 0:
        raise SubmitError(f"--gpus-per-node must be >= 0, got {args.gpus_per_node}")
    for flag in ("cpus_per_node", "ray_num_cpus"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise SubmitError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if not SLURM_TIME.fullmatch(args.time):
        raise SubmitError(
            f"--time {args.time!r} is not a Slurm time limit; expected minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
            "D-HH:MM:SS or UNLIMITED (e.g. 24:00:00)"
        )
    # a newline in the name wrote lines into the sbatch script; a '../' put the script outside the run dir
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", args.job_name, re.ASCII):
        raise SubmitError(
            f"--job-name {args.job_name!r} is not a job name; expected up to 128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it names <run_dir>/<job-name>.sbatch and its #SBATCH --job-name)"
        )
    if args.dry_run and args.local:
        raise SubmitError("--dry-run and --local exclude each other")
    comm_env(args)  # refuse a malformed --env early
    if not args.local:  # what goes into the script, before the (slower) config check; the run dir once it is known
        check_script_values(args, overrides, script_run_dir(args, "runs/latest"))
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    """Parse, check, then print (--dry-run), run (--local) or submit; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, overrides = parse(argv)
        if not args.local:
            # what the cluster can refuse, before the config check's seconds of imports and meta-model build
            if not args.dry_run and not shutil.which("sbatch"):
                raise SubmitError(NO_SBATCH, code=1)
            check_partition(args.partition, dry_run=args.dry_run)
        from mcore_rl._quiet import quiet_process

        quiet_process()  # the check builds a meta model: Megatron's known CPU warnings stay off the screen, as in a run
        cfg = compose_config(overrides)
        report = check_config(cfg, args.nodes, args.gpus_per_node, args.gpu_memory_gb)
        for line in report.lines:
            print(line)
        if args.local:
            return run_local(args, overrides)
        run_dir = script_run_dir(args, report.run_dir)
        check_script_values(args, overrides, run_dir)
        text = render_script(args, overrides, run_dir)
        if args.dry_run:
            print(f"--- sbatch script (dry run: not written, not submitted; would go to {run_dir}) ---")
            print(text)
            return 0
        script = write_script(run_dir, args.job_name, text)
        job_id = submit(script)
        print(f"submitted job {job_id}: {script}; log {run_dir}/slurm-{job_id}.out; ports {ray_ports(job_id)}")
        return 0
    except SubmitError as err:
        print(f"submit: error: {err}", file=sys.stderr)
        return err.code


if __name__ == "__main__":
    sys.exit(main())
