"""Placement on a real Ray cluster with fake GPUs (`ray.init(num_gpus=4)`: Ray schedules and hands out GPU ids as on
a GPU node; nothing here touches CUDA).

With `actor.world_size` equal to the cluster's GPUs, the actor's placement group held every GPU and a
real SGLang engine asked Ray for GPUs outside it, so it was never scheduled and its start waited forever. Checked
here: colocated engines share the actor's bundles (each engine node seeing its bundles' GPUs), split engines get
bundles of their own, a placement that cannot fit is refused at once naming the keys, and an engine Ray cannot
schedule is named after a bounded wait.

Run: `.venv/bin/pytest -m slow tests/test_placement_ray.py`
"""

from __future__ import annotations

import os
import time

import pytest

ray = pytest.importorskip("ray")

from mcore_rl.config import RLConfig  # noqa: E402
from mcore_rl.controller import placement as placement_mod  # noqa: E402
from mcore_rl.controller.gpu_plan import PlacementError  # noqa: E402
from mcore_rl.controller.placement import make_placement, wait_scheduled  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.long]
GPUS = 4


class Where:
    """Stands in for an actor rank, a critic rank or an SGLang node actor: reports what Ray gave it."""

    def where(self) -> tuple[list[str], str | None]:
        return [str(g) for g in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="module")
def cluster():
    from mcore_rl._quiet import ray_init_kwargs

    kwargs = ray_init_kwargs()
    # workers import this module to build `Where`
    path = os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))
    kwargs["runtime_env"] = {**kwargs["runtime_env"], "env_vars": {"PYTHONPATH": path}}
    ray.init(address="local", num_cpus=8, num_gpus=GPUS, include_dashboard=False, **kwargs)
    yield
    ray.shutdown()


def _cfg(placement: str, world: int, engines: int, tp: int, transport: str, critic: int = 0) -> RLConfig:
    cfg = RLConfig()
    cfg.trainer.runtime, cfg.trainer.placement, cfg.sync.transport = "cuda", placement, transport
    cfg.actor.world_size = world
    cfg.rollout.engine, cfg.rollout.num_engines = "sglang", engines
    cfg.rollout.sglang.tp = tp
    if critic:
        cfg.critic.enable, cfg.critic.world_size = True, critic
    return cfg


def _start(options: dict, base: dict) -> object:
    """An actor created as the run creates its ranks and engines: base options, the placement's on top."""
    return ray.remote(Where).options(**{**base, **options}).remote()


def _run(cfg: RLConfig):
    """Actor ranks, critic ranks and SGLang node actors placed as train.py / EnginePool place them; what each got."""
    placement = make_placement(cfg)
    try:
        ranks = [
            _start(placement.actor_options(r), {"num_gpus": 1, "num_cpus": 1}) for r in range(cfg.actor.world_size)
        ]
        critic = [_start(placement.critic_options(r), {"num_gpus": 1, "num_cpus": 1})
                  for r in range(cfg.critic.world_size if cfg.critic.enable else 0)]  # fmt: skip
        per_node = cfg.rollout.sglang.tp // cfg.rollout.sglang.nnodes
        engines = [_start(placement.engine_options(e, 0), {"num_gpus": per_node, "num_cpus": 1})
                   for e in range(cfg.rollout.num_engines)]  # fmt: skip
        everyone = ranks + critic + engines
        wait_scheduled(everyone, "the test's actors", timeout_s=60)
        got = ray.get([h.where.remote() for h in everyone])
        for h in everyone:
            ray.kill(h)
        n, c = len(ranks), len(critic)
        return got[:n], got[n : n + c], got[n + c :]
    finally:
        placement.shutdown()


def test_colocated_engines_share_the_actor_bundles_and_see_their_gpus(cluster) -> None:
    # the recipes' shape in miniature: the actor takes every GPU, two tp=2 engines and a critic share them
    ranks, critic, engines = _run(_cfg("colocated", GPUS, engines=2, tp=2, transport="tensor", critic=2))
    actor_gpus = [g for gpus, _ in ranks for g in gpus]
    assert sorted(actor_gpus) == sorted(str(i) for i in range(GPUS)), "one GPU per actor rank"
    assert [gpus for gpus, _ in critic] == [gpus for gpus, _ in ranks[:2]], "critic rank r shares actor rank r's GPU"
    # engine e's server sees the two GPUs of actor ranks 2e, 2e+1 (consecutive bundles of one node)
    for e, (_, visible) in enumerate(engines):
        assert visible == ",".join(ranks[2 * e][0] + ranks[2 * e + 1][0]), (e, visible)


def test_split_engines_get_gpus_of_their_own(cluster) -> None:
    ranks, _, engines = _run(_cfg("split", 2, engines=1, tp=2, transport="distributed"))
    actor_gpus = {g for gpus, _ in ranks for g in gpus}
    ((engine_gpus, visible),) = engines
    assert len(actor_gpus) == 2 and len(engine_gpus) == 2 and not actor_gpus & set(engine_gpus)
    assert visible == ",".join(engine_gpus)  # Ray's own CUDA_VISIBLE_DEVICES for a split engine


@pytest.mark.parametrize(
    "cfg, message",
    [
        (_cfg("split", GPUS, 1, 2, "distributed"),
         "trainer.placement=split needs 6 GPUs (actor.world_size=4 + rollout.num_engines=1 x rollout.sglang.tp=2 = 2)"
         ", but the Ray cluster (1 nodes) has 4"),
        (_cfg("colocated", GPUS, 3, 2, "tensor"), "the engines need rollout.num_engines=3 x rollout.sglang.tp=2 = 6"),
        (_cfg("colocated", 2, 1, 2, "tensor", critic=4), "critic.world_size=4 is more than the actor.world_size=2"),
        (_cfg("colocated", GPUS, 1, 2, "distributed"), "NCCL refuses two ranks of one communicator on one GPU"),
        (_cfg("split", 2, 1, 2, "tensor"), "sync.transport='tensor' is invalid with trainer.placement=split"),
    ],
)  # fmt: skip
def test_a_placement_that_cannot_work_is_refused_at_once(cluster, cfg: RLConfig, message: str) -> None:
    from ray.util import placement_group_table

    groups, t0 = len(placement_group_table()), time.monotonic()
    with pytest.raises(PlacementError) as err:
        make_placement(cfg)
    assert message in str(err.value)
    assert time.monotonic() - t0 < placement_mod.RESERVE_TIMEOUT_S  # refused, not waited out
    assert len(placement_group_table()) == groups  # nothing reserved


def test_an_engine_ray_cannot_schedule_is_named_not_waited_for_forever(cluster) -> None:
    handle = ray.remote(Where).options(num_gpus=GPUS + 1).remote()  # more GPUs than any node has
    with pytest.raises(TimeoutError, match=r"waited 2 s for Ray to schedule rollout engine 0 .*free resources"):
        wait_scheduled([handle], "rollout engine 0 (1 node(s) x 5 GPUs)", timeout_s=2)
    ray.kill(handle)
