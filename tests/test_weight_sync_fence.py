"""The version fence through the real controller: Megatron ranks (Ray actors) -> WeightSync -> an embedded engine.

A push moves the engine to the new version and only then; a sending rank SIGKILLed mid-sync fails the push and the
engine keeps its old weights and version (it never serves a mix), marked dirty; an engine serving another model is
refused before anything moves.

Run: `.venv/bin/pytest tests/test_weight_sync_fence.py`
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
import torch
from tiny_models import tiny_qwen3_moe

from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig, RolloutConfig, SyncConfig
from mcore_rl.controller.actor_group import ActorGroup
from mcore_rl.controller.engine_pool import EnginePool
from mcore_rl.controller.weight_sync import SyncError, WeightSync

pytestmark = [pytest.mark.slow, pytest.mark.long]

HF = tiny_qwen3_moe(initializer_range=0.5, max_position_embeddings=64)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _setup(tmp_path, model: dict | None = None, num_engines: int = 1):
    actor = ActorGroup(
        ModelConfig(hf_config=dict(HF)),
        ActorConfig(world_size=2, layout=LayoutConfig(ep=2), use_ref=False, num_cpus_per_rank=1),
        "cpu",
    )
    rollout = RolloutConfig(num_engines=num_engines, num_cpus=1)
    pool = EnginePool(rollout, model=dict(HF), tokenizer=None, dtype="float32", runtime="cpu", log_dir=str(tmp_path))
    sync_cfg = SyncConfig(bucket_bytes=1 << 14, timeout_s=20)
    try:
        sync = WeightSync(actor, pool, sync_cfg, rollout, "cpu", str(tmp_path), model or dict(HF))
    except Exception:
        pool.shutdown()
        actor.shutdown()
        raise
    return actor, pool, sync


def _greedy(pool: EnginePool) -> list[list[int]]:
    return [s.response_ids for s in pool.client.generate_samples(PROMPTS, 1, GREEDY)]


def _engine_weights(pool: EnginePool) -> dict[str, list]:
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"]
    return {n: pool.client.post(pool.urls[0], "/get_weights_by_name", {"name": n, "truncate_size": 4}) for n in names}


def _perturb(actor: ActorGroup) -> None:
    """Change the actor's weights (what an update does), so a push has something new to move."""

    def scale(self) -> None:
        with torch.no_grad():
            for chunk in self.chunks:
                for p in chunk.parameters():
                    p.mul_(1.5)

    ray.get([h.__ray_call__.remote(scale) for h in actor.handles])


def test_push_moves_the_engine_to_the_new_version(ray_session, tmp_path) -> None:
    actor, pool, sync = _setup(tmp_path)
    try:
        sync.push(1)
        first = _greedy(pool)
        assert pool.client.get(pool.urls[0], "/get_weight_version")[1]["weight_version"] == "1"
        _perturb(actor)
        assert _greedy(pool) == first, "nothing reaches the engine before a push"
        sync.push(2)
        assert pool.client.get(pool.urls[0], "/get_weight_version")[1]["weight_version"] == "2"
        assert _greedy(pool) != first
        samples = pool.client.generate_samples(PROMPTS, 1, GREEDY)
        assert all(s.weight_version == 2 for s in samples)
    finally:
        pool.shutdown()
        actor.shutdown()


@pytest.mark.long
def test_sender_killed_mid_sync_keeps_old_weights(ray_session, tmp_path) -> None:
    actor, pool, sync = _setup(tmp_path)
    try:
        sync.push(1)
        before, weights = _greedy(pool), _engine_weights(pool)
        _perturb(actor)
        # Rank 1 (the leader of the EP-rank-1 stream) is kept busy, so its sync_send waits in its queue while rank 0
        # streams its buckets; it is killed once the engine has staged some of them: a sender dead mid-sync.
        victim = actor.handles[1]
        pid = ray.get(victim.pid.remote())
        victim.__ray_call__.remote(lambda self: time.sleep(60))
        result: dict = {}
        push = threading.Thread(target=lambda: result.update(error=_push_error(sync, 2)))
        push.start()
        deadline = time.monotonic() + 60
        while pool.client.get(pool.urls[0], "/server_info")[1]["internal_states"][0]["staged_tensors"] == 0:
            assert time.monotonic() < deadline, "rank 0 never staged a bucket"
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        push.join(timeout=120)
        assert isinstance(result["error"], SyncError)
        state = pool.client.get(pool.urls[0], "/server_info")[1]["internal_states"][0]
        assert state["staged_tensors"] == 0, "the refused session was dropped"
        assert pool.client.get(pool.urls[0], "/get_weight_version")[1]["weight_version"] == "1"
        assert _engine_weights(pool) == weights and _greedy(pool) == before, "the engine kept its old weights"
        assert pool.urls[0] in sync.dirty and sync.version == 1
    finally:
        pool.shutdown()
        actor.shutdown()


def _push_error(sync: WeightSync, version: int) -> BaseException | None:
    try:
        sync.push(version)
    except BaseException as err:  # noqa: BLE001 (the test inspects it)
        return err
    return None


def test_engine_of_another_model_is_refused(ray_session, tmp_path) -> None:
    with pytest.raises(SyncError, match="serves another model: its num_hidden_layers is 2, the actor's is 3"):
        _setup(tmp_path, dict(HF, num_hidden_layers=3))


@pytest.mark.long
def test_hung_engine_is_replaced_and_resynced_by_the_push(ray_session, tmp_path) -> None:
    """An engine SIGSTOPped between two pushes does not answer /begin_weight_update. The push goes on with
    the other engine, the hung one is replaced, and the replacement serves the pushed version once it is up."""
    actor, pool, sync = _setup(tmp_path, num_engines=2)
    try:
        sync.push(1)
        hung_url = pool.urls[1]
        hung_pid = pool.engine_pids()[1]
        _perturb(actor)
        os.kill(hung_pid, signal.SIGSTOP)
        try:
            sync.push(2)  # before: a raw ClientOSError / timeout from /begin_weight_update killed the run
        finally:
            try:
                os.kill(hung_pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # replaced: killed
        pool.wait_for_restarts()
        assert hung_url not in pool.urls and pool.restarts == 1 and not pool.pending
        for url in pool.urls:
            assert pool.client.get(url, "/get_weight_version")[1]["weight_version"] == "2"
        samples = pool.client.generate_samples(PROMPTS * 4, 1, GREEDY)
        assert all(s.weight_version == 2 for s in samples)
    finally:
        pool.shutdown()
        actor.shutdown()
