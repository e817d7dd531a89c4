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


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_dense_weights_identical_across_dp_after_init():
    from mcore_rl.parallel.harness import run_on_ranks

    a, b = run_on_ranks(_step_rank, 2)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _dispatch_rank(rank, world, stock):
    """Logprobs and one update under EP2, with the CPU runtime's fused all-gather dispatcher or Megatron's own."""
    import megatron.core.transformer.moe.moe_layer as moe_layer
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig

    if stock:  # the harness enabled the runtime: undo its one patch of the dispatcher
        moe_layer.MoEAllGatherTokenDispatcher = token_dispatcher.MoEAllGatherTokenDispatcher
    actor = MegatronActor(
        rank, world, ModelConfig(hf_config=tiny_qwen3_moe(vocab_size=50)),
        ActorConfig(world_size=2, layout=LayoutConfig(ep=2), use_ref=False, mini_batches=1),
    )  # fmt: skip
    actor.initialize(("127.0.0.1", 0))
    layers = [m for m in actor.chunks[0].modules() if hasattr(m, "token_dispatcher")]
    dispatchers = {type(m.token_dispatcher).__name__ for m in layers}
    gen = torch.Generator().manual_seed(rank)
    batch = TrainBatch(
        [torch.randint(3, 50, (5,), generator=gen).tolist() for _ in range(8)],
        torch.randint(3, 50, (8, 3), generator=gen),
        torch.ones(8, 3),
        {"old_logprobs": torch.full((8, 3), -4.0), "advantages": torch.randn(8, 3, generator=gen)},
    )
    logprobs = actor.logprobs(batch).payload
    metrics = actor.update(batch).payload
    return dispatchers, logprobs, metrics, {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters()}


@pytest.mark.slow
def test_the_fused_moe_dispatcher_gives_megatrons_values_bit_for_bit():
    """The CPU runtime gathers routing map, probs and hidden states in one all-gather: logprobs, the update's
    metrics and every parameter after it (experts included) equal those under Megatron's own dispatcher."""
    from mcore_rl.parallel.harness import run_on_ranks

    fused = run_on_ranks(_dispatch_rank, 2, (False,))
    stock = run_on_ranks(_dispatch_rank, 2, (True,))
    assert fused[0][0] == {"FusedAllGatherTokenDispatcher"} and stock[0][0] == {"MoEAllGatherTokenDispatcher"}
    for (_, lp_f, m_f, p_f), (_, lp_s, m_s, p_s) in zip(fused, stock):
        assert torch.equal(lp_f, lp_s)
        assert m_f == m_s
        assert p_f.keys() == p_s.keys() and all(torch.equal(p_f[n], p_s[n]) for n in p_f)


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
