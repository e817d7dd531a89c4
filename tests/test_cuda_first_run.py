"""The first CUDA step, checked on a CPU machine: what a GPU run without Transformer Engine builds (`runtime=cuda` on
a machine where TE is not importable, as the GPU check kit's box is), where micro-batches and results live, and the
refusals a GPU run needs before any rank starts. Each test here failed before the fix it names."""

from __future__ import annotations

import pytest
import torch
from _parity import DEEPSEEK_TINY

from mcore_rl.models.base import HFConfig
from mcore_rl.models.registry import get_family
from mcore_rl.parallel.layout import ParallelLayout

QWEN3_MOE_TINY = dict(
    model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
    num_experts_per_tok=2, norm_topk_prob=True, rope_theta=10000.0, rms_norm_eps=1e-6,
)  # fmt: skip
TE_ONLY = ("apply_rope_fusion", "moe_grouped_gemm", "masked_softmax_fusion", "persist_layer_norm")


def _no_te(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_rl.models import spec

    monkeypatch.setattr(spec, "transformer_engine_available", lambda: False)


@pytest.mark.parametrize(
    "hf", [QWEN3_MOE_TINY, {**DEEPSEEK_TINY, "model_type": "deepseek_v3"}], ids=["qwen3_moe", "dsv3"]
)
def test_cuda_without_te_builds_no_te_only_setting(hf, monkeypatch) -> None:
    """runtime=cuda without TE: Megatron's local spec, so no TE-only fusion, no legacy GroupedMLP (which says "Grouped
    GEMM is not available" without TE) and no masked-softmax CUDA extension; one predicate decides (models/spec.py)."""
    from mcore_rl.models.spec import te_in_use

    _no_te(monkeypatch)
    assert not te_in_use("cuda")
    config = get_family(hf["model_type"]).transformer_config(HFConfig(hf), ParallelLayout(), "cuda", torch.bfloat16)
    assert {name: getattr(config, name) for name in TE_ONLY} == dict.fromkeys(TE_ONLY, False)
    # CUDA without TE still dispatches tokens with alltoall (a CUDA stream is there) and exchanges variable shapes
    assert config.moe_token_dispatcher_type == "alltoall" and config.variable_seq_lengths


def test_cuda_with_te_keeps_te_settings(monkeypatch) -> None:
    from mcore_rl.models import spec

    monkeypatch.setattr(spec, "transformer_engine_available", lambda: True)
    kwargs = dict(apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False)  # CPU can't check
    config = get_family("qwen3_moe").transformer_config(
        HFConfig(QWEN3_MOE_TINY), ParallelLayout(), "cuda", torch.bfloat16, **kwargs
    )
    assert config.moe_grouped_gemm and config.bias_activation_fusion


def test_dsv3_latent_projections_must_divide_tp_on_cuda_without_te(monkeypatch) -> None:
    """The local spec column-splits MLA's latent down projections over tp whatever the device: the check applies to
    runtime=cuda without TE too (it was skipped for every CUDA run)."""
    from mcore_rl.parallel.layout import LayoutError

    _no_te(monkeypatch)
    hf = HFConfig({**DEEPSEEK_TINY, "model_type": "deepseek_v3", "q_lora_rank": 30})
    with pytest.raises(LayoutError, match="q_lora_rank=30 is not divisible by tp=4"):
        get_family("deepseek_v3").transformer_config(hf, ParallelLayout(tp=4), "cuda", torch.bfloat16)


# ------------------------------------------------------------------------------------------ what goes back, threads
def test_results_for_the_driver_are_host_tensors() -> None:
    """A rank's payload (logprobs, values, metrics, nested) reaches the Ray driver as CPU tensors: fake CUDA tensors
    (FakeTensorMode reports device cuda on a CPU-only machine) stand in for the rank's outputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mcore_rl.actor.runtime import to_host

    with FakeTensorMode():
        logprobs = torch.empty(2, 3, device="cuda")
        payload = {"metrics": {"actor/lr": 0.1}, "old_logprobs": logprobs, "pair": (logprobs, None)}
        assert logprobs.device.type == "cuda"
        out = to_host(payload)
        assert out["old_logprobs"].device.type == "cpu" and out["pair"][0].device.type == "cpu"
        assert out["metrics"] == {"actor/lr": 0.1} and out["pair"][1] is None


def test_cpu_adam_gets_the_cores_of_its_gpu_rank() -> None:
    """CPU Adam (offload_fraction > 0) steps on the rank's threads: on CUDA the rank gets its share of the cores, not
    the CPU runtime's one thread per rank; the environment variable still wins."""
    from mcore_rl.actor.runtime import threads_per_rank

    assert threads_per_rank("cuda", env={}, cpus=128, local_ranks=8) == 16
    assert threads_per_rank("cpu", env={}, cpus=128, local_ranks=8) == 1
    assert threads_per_rank("cpu", env={}, reserved=2.0) == 2  # a CPU rank uses the CPUs it reserves in Ray
    assert threads_per_rank("cpu", env={}, reserved=0.5) == 1
    assert threads_per_rank("cuda", env={"MCORE_RL_THREADS_PER_RANK": "3"}, cpus=128, local_ranks=8) == 3
    from mcore_rl.config import ConfigError

    with pytest.raises(ConfigError, match="MCORE_RL_THREADS_PER_RANK='x' is invalid"):
        threads_per_rank("cuda", env={"MCORE_RL_THREADS_PER_RANK": "x"})


# ------------------------------------------------------------------------------------------ refusals
def _cfg(**actor: object):
    from mcore_rl.config import RLConfig

    cfg = RLConfig()
    cfg.trainer.runtime = "cuda"
    for key, value in actor.items():
        setattr(cfg.actor.layout, key, value)
    return cfg


def test_cuda_without_a_visible_gpu_is_refused() -> None:
    from mcore_rl.actor.runtime import check_runtime
    from mcore_rl.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.runtime=cuda: no GPU is visible"):
        check_runtime(_cfg(), visible_gpus=0)
    check_runtime(_cfg(), visible_gpus=1, te=False)


@pytest.mark.parametrize("te", [True, False])
def test_context_parallel_is_refused_naming_the_key(te: bool) -> None:
    """cp > 1 was passed to Megatron while every CP rank saw whole sequences: wrong logprobs, silently."""
    from mcore_rl.actor.runtime import check_runtime
    from mcore_rl.config import ConfigError

    with pytest.raises(ConfigError, match="actor.layout.cp=2 is not supported") as err:
        check_runtime(_cfg(cp=2), visible_gpus=8, te=te)
    assert ("needs Transformer Engine" in str(err.value)) is not te


@pytest.mark.parametrize(
    "recompute,needle",
    [
        (dict(granularity="full"), "recompute_method must be"),
        (dict(granularity="full", method="uniform"), "recompute_num_layers must be"),
        (dict(granularity="everything"), 'must be "full"'),
        (dict(method="block", num_layers=2), "actor.recompute.method='block' is invalid"),
        (dict(granularity="selective", num_layers=1), "actor.recompute.num_layers=1 is invalid"),
    ],
)
def test_recompute_settings_megatron_refuses_are_refused(recompute: dict, needle: str) -> None:
    from mcore_rl.config import ConfigError
    from mcore_rl.config.model import RecomputeConfig

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        RecomputeConfig(**recompute).validate()


def test_recompute_reaches_the_transformer_config() -> None:
    from mcore_rl.actor.megatron_actor import megatron_overrides
    from mcore_rl.config import ActorConfig
    from mcore_rl.config.model import RecomputeConfig

    cfg = ActorConfig(recompute=RecomputeConfig("full", "uniform", 1))
    cfg.recompute.validate()
    overrides = megatron_overrides(cfg, "disabled")
    config = get_family("qwen3_moe").transformer_config(
        HFConfig(QWEN3_MOE_TINY), ParallelLayout(), "cpu", torch.float32, **overrides
    )
    got = (config.recompute_granularity, config.recompute_method, config.recompute_num_layers)
    assert got == ("full", "uniform", 1)


def test_train_cli_refuses_cuda_without_gpu_before_ray() -> None:
    """`python -m mcore_rl.train trainer.runtime=cuda` on this CPU-only machine: exit 2 naming the key, no Ray."""
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    res = subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", "trainer.runtime=cuda"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    assert "trainer.runtime=cuda: no GPU is visible" in res.stderr and "Traceback" not in res.stderr
    assert "Started a local Ray instance" not in res.stdout + res.stderr


# ------------------------------------------------------------------------------------------ DeepSeek-V3 in RL
def _dsv3_rank(rank: int, world: int) -> dict:
    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, ModelConfig

    hf = {**DEEPSEEK_TINY, "model_type": "deepseek_v3", "num_nextn_predict_layers": 1}
    actor = MegatronActor(
        rank, world, ModelConfig(hf_config=hf), ActorConfig(world_size=1, use_ref=False, mini_batches=1)
    )
    actor.initialize(("127.0.0.1", 0))  # the harness started torch.distributed
    torch.manual_seed(0)
    responses = torch.randint(1, 90, (4, 5))
    batch = TrainBatch([[3, 4, 5]] * 4, responses, torch.ones(4, 5))
    logprobs = actor.logprobs(batch).payload  # crashed in Megatron's MTP (labels=None .clone()) before the fix

    def biases() -> list[torch.Tensor]:
        return [b.detach().clone() for n, b in actor.chunks[0].named_buffers() if n.endswith("expert_bias")]

    before = biases()
    batch.tensors.update(old_logprobs=logprobs, advantages=torch.randn(4, 5))
    metrics = actor.update(batch).payload
    return dict(logprobs=logprobs, before=before, after=biases(), ok=metrics["actor/update_ok"],
                mtp=hasattr(actor.chunks[0], "mtp"))  # fmt: skip


@pytest.fixture(scope="module")
def dsv3_run() -> dict:
    from mcore_rl.parallel.harness import run_on_ranks

    return run_on_ranks(_dsv3_rank, 1)[0]


def test_dsv3_with_mtp_layers_computes_logprobs(dsv3_run) -> None:
    assert dsv3_run["logprobs"].shape == (4, 5) and bool(torch.isfinite(dsv3_run["logprobs"]).all())
    assert not dsv3_run["mtp"]  # built without MTP for RL, said once in the log


def test_dsv3_expert_bias_is_frozen_during_rl_updates(dsv3_run) -> None:
    """Megatron moved the expert bias 1e-3 per optimizer step by default; RL keeps the released bias."""
    assert dsv3_run["ok"] == 1.0 and dsv3_run["before"]
    for before, after in zip(dsv3_run["before"], dsv3_run["after"]):
        assert torch.equal(before, after)


# ------------------------------------------------------------------------------------------ the job's environment
def test_sbatch_script_sets_the_gpu_environment_with_overridable_defaults(tmp_path) -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS=1, expandable segments, NCCL's cumem off as the engines set it, an hour for
    collectives (a 1.3 TB checkpoint read); each a default that an exported value or --env overrides."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "launch"))
    import submit

    args = submit.build_parser().parse_args(
        ["--nodes", "1", "--gpus-per-node", "8", "--partition", "p", "--time", "1:00:00", "--job-name", "j",
         "--env", "NCCL_CUMEM_ENABLE=1"]
    )  # fmt: skip
    script = submit.render_script(args, [], str(tmp_path))
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    probe = "echo $CUDA_DEVICE_MAX_CONNECTIONS $PYTORCH_CUDA_ALLOC_CONF $NCCL_CUMEM_ENABLE $MCORE_RL_DIST_TIMEOUT_S"
    env = {k: v for k, v in os.environ.items() if k not in submit.GPU_ENV}
    out = subprocess.run(["bash", "-c", exports + "\n" + probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "expandable_segments:True", "1", "3600"]
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"  # the user's own value wins
    out = subprocess.run(["bash", "-c", exports + "\n" + probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "8"


def test_dist_timeout_comes_from_the_environment(monkeypatch) -> None:
    import torch.distributed as dist

    from mcore_rl.parallel import groups

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr("mcore_rl.parallel.cpu_runtime.enable_cpu_runtime", lambda: None)
    monkeypatch.setenv("MCORE_RL_DIST_TIMEOUT_S", "3600")
    monkeypatch.setenv("MASTER_ADDR", "")  # init_distributed sets both; monkeypatch restores them
    monkeypatch.setenv("MASTER_PORT", "")
    groups.init_distributed("cpu", 0, 1, "127.0.0.1", 1)
    assert seen["timeout"].total_seconds() == 3600


# ------------------------------------------------------------------------------------------ the dry run's estimate
def test_activation_estimate_reads_actor_recompute() -> None:
    """The dry run assumed full recompute whatever the ranks ran; it now reads actor.recompute, the setting the ranks
    pass to Megatron: keeping every activation costs more than block recompute, which costs more than uniform."""
    from mcore_rl.config.model import RecomputeConfig
    from mcore_rl.models.estimate import activation_bytes

    hf = dict(hidden_size=1024, num_hidden_layers=16, vocab_size=1000)
    act = lambda rc: activation_bytes(hf, 1, 1, 1, 1, 4096, recompute=rc)  # noqa: E731
    kept, block, uniform = (
        act(None),
        act(RecomputeConfig("full", "block", 8)),
        act(RecomputeConfig("full", "uniform", 1)),
    )
    assert kept > block > uniform
    tokens, h = 4096, 1024
    # uniform x 1: each layer's bf16 input + one layer's working set + fp32 logits and their grad
    assert uniform == 16 * 2 * tokens * h + 34 * tokens * h + tokens * 1000 * 8
    assert act(RecomputeConfig("selective")) == kept  # flash attention keeps no s^2 scores to save


def test_estimate_is_below_the_workers_layer() -> None:
    """models/estimate.py receives the optimizer plan from its caller; it imports nothing from mcore_rl.actor."""
    import ast
    from pathlib import Path

    import mcore_rl.models.estimate as estimate

    tree = ast.parse(Path(estimate.__file__).read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in modules if m and m.startswith("mcore_rl.actor")]


# ------------------------------------------------------------------------------------------ offload
def _offload_rank(rank: int, world: int) -> dict:
    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.actor.offload import offload_targets, target_bytes
    from mcore_rl.config import ActorConfig, ModelConfig, OptimConfig

    cfg = ActorConfig(world_size=1, use_ref=True, mini_batches=1, optim=OptimConfig(distributed=True))
    actor = MegatronActor(rank, world, ModelConfig(hf_config=QWEN3_MOE_TINY, dtype="bfloat16"), cfg)
    actor.initialize(("127.0.0.1", 0))
    batch = TrainBatch([[3, 4, 5]] * 2, torch.randint(1, 90, (2, 4)), torch.ones(2, 4))
    batch.tensors.update(old_logprobs=torch.zeros(2, 4), advantages=torch.randn(2, 4))
    actor.update(batch)  # Adam's state exists from the first step on
    params = sum(p.numel() for chunk in actor.chunks for p in chunk.parameters())
    return dict(params=params, bytes=target_bytes(offload_targets(actor)))


def test_offload_finds_the_distributed_optimizers_fp32_masters() -> None:
    """Offload looked for Float16Optimizer's fp32_from_float16_groups only: the distributed optimizer's fp32 master
    shards (4 bytes a parameter, its largest single piece of state) stayed on the GPU. Counted on a CPU actor (bf16,
    distributed optimizer, dp=1: the shards are whole); the moves themselves need CUDA (gpu test, tools/gpu_smoke)."""
    from mcore_rl.parallel.harness import run_on_ranks

    got = run_on_ranks(_offload_rank, 1)[0]
    params, moved = got["params"], got["bytes"]
    assert moved["master_params"] == 4 * params
    assert moved["optimizer_state"] == 8 * params  # exp_avg + exp_avg_sq, fp32
    assert moved["reference"] == 2 * params
    assert moved["ddp_buffers"] >= (2 + 4) * params  # bf16 params + fp32 grads (Megatron pads its buckets)


def test_offloaded_optimizer_overlaps_its_host_copies(monkeypatch) -> None:
    """actor.optim.offload_fraction > 0: Megatron's HybridDeviceOptimizer with D2H/H2D overlapped with the CPU step.
    TE's version is what 0.16.1's precision-aware optimizer asks for; a stand-in answers it on this TE-less machine."""
    import megatron.core.utils
    from packaging.version import Version

    from mcore_rl.actor.optimizer import optimizer_plan
    from mcore_rl.config import OptimConfig

    monkeypatch.setattr(megatron.core.utils, "get_te_version", lambda: Version("2.9"))
    optim = OptimConfig(distributed=True, offload_fraction=1.0)
    config = optimizer_plan(optim, "bfloat16", "cuda").optimizer_config(optim)
    assert config.optimizer_cpu_offload and config.overlap_cpu_optimizer_d2h_h2d


def test_optimizer_offload_without_te_is_refused_before_any_rank() -> None:
    """It was refused only inside each rank's optimizer build (after Ray and the model had started)."""
    from mcore_rl.actor.runtime import check_runtime
    from mcore_rl.config import ConfigError

    cfg = _cfg()
    cfg.actor.optim.offload_fraction = 1.0
    with pytest.raises(ConfigError, match="actor.optim.offload_fraction=1.0 needs Transformer Engine"):
        check_runtime(cfg, visible_gpus=8, te=False)
    check_runtime(cfg, visible_gpus=8, te=True)


def test_dynamic_batching_with_expert_parallelism_is_refused() -> None:
    from mcore_rl.actor.runtime import check_runtime
    from mcore_rl.config import ConfigError

    cfg = _cfg(ep=2)
    cfg.actor.dynamic_batching = True
    with pytest.raises(ConfigError, match="actor.dynamic_batching=true is invalid with actor.layout.ep=2"):
        check_runtime(cfg, visible_gpus=8, te=True)
    cfg.actor.layout.ep = 1
    check_runtime(cfg, visible_gpus=8, te=True)


def test_ranks_per_node_come_from_the_driver_not_the_visible_devices(tmp_path) -> None:
    """Ray shows each GPU rank one device; the node's GPU count (the driver's list) divides the cores."""
    from mcore_rl.actor.runtime import node_gpus

    for i in range(8):
        (tmp_path / f"0000:{i:02x}:00.0").mkdir()
    assert node_gpus(str(tmp_path)) == 8
    assert node_gpus(str(tmp_path / "missing")) >= 1


# ------------------------------------------------------------------------------------------ MoE dispatch options
@pytest.mark.parametrize(
    "settings,te,needle",
    [
        (dict(moe_dispatcher="flex"), False, "needs Transformer Engine, the deep_ep package"),
        (dict(moe_dispatcher="flex"), True, "needs the deep_ep package"),
        (dict(moe_permute_fusion=True), False, "moe_permute_fusion=true needs Transformer Engine"),
    ],
)
def test_moe_options_that_need_te_or_deepep_are_refused(settings: dict, te: bool, needle: str) -> None:
    from mcore_rl.actor.runtime import check_runtime
    from mcore_rl.config import ConfigError

    cfg = _cfg()
    for key, value in settings.items():
        setattr(cfg.actor, key, value)
    with pytest.raises(ConfigError, match=needle):
        check_runtime(cfg, visible_gpus=8, te=te)


def test_alltoall_on_cpu_is_refused_and_moe_options_reach_the_config() -> None:
    from mcore_rl.actor.megatron_actor import megatron_overrides
    from mcore_rl.actor.runtime import check_runtime
    from mcore_rl.config import ActorConfig, ConfigError

    cfg = _cfg()
    cfg.trainer.runtime, cfg.actor.moe_dispatcher = "cpu", "alltoall"
    with pytest.raises(ConfigError, match="actor.moe_dispatcher='alltoall' needs trainer.runtime=cuda"):
        check_runtime(cfg)
    overrides = megatron_overrides(ActorConfig(moe_dispatcher="flex", moe_permute_fusion=True), "disabled")
    want = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep", moe_permute_fusion=True)
    assert {k: overrides[k] for k in want} == want
