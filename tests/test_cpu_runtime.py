"""The CPU runtime: opt-in patches, refusal to shadow a GPU, RNG stream isolation, a Megatron step on gloo."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tiny_models import tiny_qwen3_moe

from mcore_rl.parallel.cpu_runtime import CpuRNGStatesTracker


def test_rng_fork_isolates_streams_and_restores_default():
    tracker = CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    expected_default = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("model-parallel-rng"):
        a = torch.rand(3)
    after = torch.rand(3)
    assert torch.equal(after, expected_default), "fork leaked into the default generator"
    with tracker.fork("model-parallel-rng"):
        b = torch.rand(3)
    assert not torch.equal(a, b), "a forked stream must advance between forks"
    torch.manual_seed(123)
    assert torch.equal(a, torch.rand(3)), "the forked stream must start from its own seed"


def test_rng_tracker_refuses_duplicate_seed_or_unknown_name():
    tracker = CpuRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1 already exists"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="rng state c is not added"):
        with tracker.fork("c"):
            pass


def test_cpu_runtime_refuses_to_shadow_a_usable_gpu():
    # No GPU exists here, so the GPU is simulated inside a fresh interpreter by answering torch's own query.
    code = (
        "import torch; torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 1\n"
        "from mcore_rl.parallel.cpu_runtime import enable_cpu_runtime, CpuRuntimeRefused\n"
        "try:\n    enable_cpu_runtime()\nexcept CpuRuntimeRefused as e:\n    print('REFUSED', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "REFUSED runtime=cpu refused: this machine has a usable GPU" in out.stdout, out.stderr


def _step_rank(rank, world):
    """A Megatron optimizer step on gloo under EP2 leaves every dense parameter equal across data-parallel ranks."""
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig

    hf = tiny_qwen3_moe(vocab_size=50)
    actor = MegatronActor(
        rank,
        world,
        ModelConfig(hf_config=hf),
        ActorConfig(world_size=2, layout=LayoutConfig(ep=2), use_ref=False, mini_batches=1),
    )
    actor.initialize(("127.0.0.1", 0))  # the harness already started torch.distributed
    return {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters() if "experts" not in n}


def test_dense_weights_identical_across_dp_after_init():
    from mcore_rl.parallel.harness import run_on_ranks

    a, b = run_on_ranks(_step_rank, 2)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_megatron_imports_without_torch_compile_where_there_is_no_cuda():
    """Importing mcore_rl first makes Megatron's jit_fuser the identity (no CUDA here): its fused functions are the
    plain Python ones and torch._dynamo / torch._inductor are never imported (3 s per rank)."""
    code = (
        "import sys, torch; assert not torch.cuda.is_available()\n"
        "import mcore_rl, megatron.core, megatron.core.jit as jit\n"
        "from megatron.core.fusions.fused_bias_geglu import bias_geglu\n"
        "from megatron.core.transformer.moe.router import TopKRouter\n"
        "print(jit.jit_fuser is jit.noop_decorator, type(bias_geglu).__name__,\n"
        "      type(TopKRouter._apply_expert_bias).__name__, 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "function", "function", "False"], out
