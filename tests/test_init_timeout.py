"""A failed rendezvous costs one engine, not the run: an engine whose /init_weights_update_group never answers is
replaced, the push goes on with the others, and the replacement is synced before it serves.

Real controller: Megatron ranks (Ray actors, EP2 on gloo) -> WeightSync -> two embedded engines (Ray actors) behind
sglang-router. Engine 1's init is made to block forever in its process (its group join never returns), as an SGLang
scheduler blocked in a rendezvous that cannot meet. Before, the push failed twice and ended the run (SyncError).

Run: `.venv/bin/pytest tests/test_init_timeout.py`
"""

from __future__ import annotations

import pytest
import ray
from tiny_models import tiny_qwen3_moe

from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig, RolloutConfig, SyncConfig
from mcore_rl.controller.actor_group import ActorGroup
from mcore_rl.controller.engine_pool import EnginePool
from mcore_rl.controller.weight_sync import WeightSync

pytestmark = [pytest.mark.slow, pytest.mark.long]

HF = tiny_qwen3_moe(initializer_range=0.5, max_position_embeddings=64)
TIMEOUT_S = 8.0  # sync.timeout_s: the hung engine is given up after this (+ the grace for an answer to arrive)


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_an_engine_whose_init_never_answers_is_replaced_and_synced_before_it_serves(ray_session, tmp_path) -> None:
    actor = ActorGroup(
        ModelConfig(hf_config=dict(HF)),
        ActorConfig(world_size=2, layout=LayoutConfig(ep=2), use_ref=False, num_cpus_per_rank=1),
        "cpu",
    )
    rollout = RolloutConfig(num_engines=2, num_cpus=1)
    pool = EnginePool(rollout, model=dict(HF), tokenizer=None, dtype="float32", runtime="cpu", log_dir=str(tmp_path))
    try:
        sync = WeightSync(actor, pool, SyncConfig(bucket_bytes=1 << 14, timeout_s=TIMEOUT_S), rollout, "cpu",
                          str(tmp_path), dict(HF))  # fmt: skip
        hung = pool.engines[1]

        def hang_group_joins(self) -> None:  # noqa: ANN001 (runs inside the engine's Ray actor: pickled by value)
            """In this engine's process every update-group join blocks forever (the server imports it per init)."""
            import threading

            import mcore_rl.parallel.update_group as update_group

            update_group.new_update_group = lambda *args, **kwargs: threading.Event().wait()

        ray.get(hung.handle.__ray_call__.remote(hang_group_joins))
        admitted: dict[str, str] = {}  # engine URL -> its weight version when it joined the router
        add_worker = pool.router.add_worker

        def spy(url: str, *args, **kwargs) -> None:
            admitted[url] = pool.client.get(url, "/get_weight_version")[1]["weight_version"]
            add_worker(url, *args, **kwargs)

        pool.router.add_worker = spy
        sync.push(1)  # the step's push completes with the engine that answered
        assert sync.version == 1
        assert pool.client.get(pool.engines[0].url, "/get_weight_version")[1]["weight_version"] == "1"
        pool.wait_for_restarts()
        replacement = pool.engines[1].url
        assert replacement != hung.url and pool.restarts == 1
        assert admitted == {replacement: "1"}, "the replacement joined the router before it was synced"
        assert pool.client.get(replacement, "/get_weight_version")[1]["weight_version"] == "1"
        assert sorted(sync._connected) == sorted(pool.urls)
        sync.push(2)  # and the next push reaches both
        assert [pool.client.get(u, "/get_weight_version")[1]["weight_version"] for u in pool.urls] == ["2", "2"]
    finally:
        pool.shutdown()
        actor.shutdown()
