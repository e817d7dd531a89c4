"""Generation ahead of training: partial rollouts across a weight update, the staleness bound, per-token versions.

A real embedded server on loopback and the real client (no Ray); the async producer runs the single-turn producer
over them while the test plays the loop (bumps the weight version on the server between steps).
Run: `.venv/bin/pytest tests/test_async_rollout.py`
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tiny_models import tiny_qwen3_moe

from mcore_rl.config import RLConfig
from mcore_rl.controller.async_producer import AsyncProducer, StalenessLimitExceeded
from mcore_rl.controller.async_producer import make_producer as make_run_producer
from mcore_rl.controller.producer import RolloutProducer, Rollouts
from mcore_rl.controller.samples import samples_to_batch
from mcore_rl.controller.state import LoopState
from mcore_rl.data.dataset import PromptDataset, PromptLoader
from mcore_rl.data.synthetic import write_synthetic_dataset
from mcore_rl.data.tokenizer import build_tiny_tokenizer
from mcore_rl.metrics.logger import StepTimer
from mcore_rl.reward.loader import build_reward_fn
from mcore_rl.reward.manager import RewardManager
from mcore_rl.rollout.client import RolloutClient
from mcore_rl.rollout.sampling import Sample
from mcore_rl.rollout.server import ServerThread, build_server

TOK = build_tiny_tokenizer(None)


@pytest.fixture(scope="module")
def server():
    model = tiny_qwen3_moe(vocab_size=63, max_position_embeddings=512)
    thread = ServerThread(build_server(model, max_running_requests=64, weight_version="1"))
    client = RolloutClient(thread.url)
    yield thread, client
    client.close()
    thread.stop()


def set_version(client: RolloutClient, url: str, version: int) -> None:
    # committed between two decode steps, as a staged weight update is (no abort: in-flight requests go on)
    client.post(url, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})


def wait_decoding(client: RolloutClient, url: str, rows: int, steps: int = 2) -> None:
    """Until all `rows` sequences run on the server and it has decoded `steps` steps since: every sequence then holds
    tokens of the version now served, whatever the machine's load (a fixed sleep left a loaded machine's sequences
    without a token, their first span on the next version)."""
    state = {}
    for _ in range(60_000):
        _, info = client.get(url, "/server_info")
        state = info["internal_states"][0]
        if state["num_running_reqs"] == rows and state["num_waiting_reqs"] == 0:
            break
        time.sleep(0.001)
    else:
        raise AssertionError(f"the {rows} sequences never ran together: {state}")
    first = state["decode_steps"]
    for _ in range(60_000):
        _, info = client.get(url, "/server_info")
        if info["internal_states"][0]["decode_steps"] >= first + steps:
            return
        time.sleep(0.001)
    raise AssertionError(f"no {steps} decode steps after all {rows} sequences ran")


@pytest.mark.parametrize("groups", [0, 1], ids=["per-prompt", "one-batched-request"])
@pytest.mark.parametrize("pause_mode", ["none", "abort"])
def test_in_flight_samples_continue_on_new_weights_tagged_with_both_versions(server, pause_mode, groups):
    thread, client = server
    set_version(client, thread.url, 1)
    params = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
    out: list[list[Sample]] = []
    prompts = [[1, 5, 6], [2, 7]]
    worker = threading.Thread(target=lambda: out.append(client.generate_samples(prompts, 4, params, 0, groups)))
    continued = client.stats["continued_after_abort"]
    worker.start()
    wait_decoding(client, thread.url, rows=len(prompts) * 4)  # every sequence has tokens on version 1
    if pause_mode == "abort":  # SGLang's way: in-flight requests end as "abort"; the client resubmits them
        client.post(thread.url, "/pause_generation", {"mode": "abort"})
    set_version(client, thread.url, 2)
    if pause_mode == "abort":
        client.post(thread.url, "/continue_generation")
    worker.join(timeout=120)
    (samples,) = out
    assert [s.prompt_ids for s in samples] == [p for p in prompts for _ in range(4)]
    for s in samples:
        assert len(s.response_ids) == 200 and s.finish_reason == "length"
        assert [v for v, _, _ in s.weight_versions][0] == 1 and s.weight_versions[-1][0] == 2
        # spans tile the response: every token is tagged with exactly one version
        assert s.weight_versions[0][1] == 0 and s.weight_versions[-1][2] == 200
        assert all(a[2] == b[1] for a, b in zip(s.weight_versions, s.weight_versions[1:]))
    if pause_mode == "abort":
        assert client.stats["continued_after_abort"] > continued


class ServerEngines:
    """The engine pool's `generate` over one server (the pool itself needs Ray)."""

    def __init__(self, client: RolloutClient, max_new_tokens: int) -> None:
        self.client, self.max_new_tokens = client, max_new_tokens

    def generate(self, prompts, n, seed, stop_token_ids, overrides=None, return_routed_experts=False):
        assert not return_routed_experts  # R3 requests go to the engines directly (EnginePool._generate_direct)
        params = {"max_new_tokens": self.max_new_tokens, "temperature": 1.0, "stop_token_ids": stop_token_ids}
        return self.client.generate_samples(prompts, n, {**params, **(overrides or {})}, seed)


def make_producer(tmp_path, client, max_new_tokens=2) -> RolloutProducer:
    cfg = RLConfig()
    cfg.rollout.n = 4
    path = write_synthetic_dataset(str(tmp_path / "d.parquet"), 64, 0)
    loader = PromptLoader(PromptDataset([path], TOK, 64), 4, seed=0)
    reward = RewardManager(build_reward_fn(None, None))
    return RolloutProducer(cfg, loader, ServerEngines(client, max_new_tokens), reward, TOK)


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_async_producer_keeps_the_staleness_bound_and_marks_stale_samples(server, tmp_path, max_staleness):
    thread, client = server
    state = LoopState()
    set_version(client, thread.url, state.weight_version)
    steps = 5
    producer = AsyncProducer(make_producer(tmp_path, client), state, max_staleness, last_step=steps)
    sync_order = make_producer(tmp_path, client)  # the synchronous loop's data order
    try:
        for step in range(1, steps + 1):
            rollouts = producer.produce(step, StepTimer())
            assert [p["index"] for p in rollouts.prompts] == [p["index"] for p in next(sync_order.loader)]
            versions = [v for s in rollouts.samples for v, _, _ in s.weight_versions]
            assert min(versions) >= state.weight_version - max_staleness
            stale = [any(v < state.weight_version for v, _, _ in s.weight_versions) for s in rollouts.samples]
            assert rollouts.batch.tensors["stale"].amax(dim=1).tolist() == [float(x) for x in stale]
            lag = rollouts.batch.tensors["version_lag"]
            for i, s in enumerate(rollouts.samples):  # the engine's spans, token by token
                for v, a, b in s.weight_versions:
                    assert lag[i, a:b].tolist() == [float(state.weight_version - v)] * (b - a)
            if step == 1:
                assert not any(stale)  # the first batch starts on the weights it trains
            time.sleep(0.05)  # "training": the next batch is generated meanwhile
            state.weight_version += 1
            set_version(client, thread.url, state.weight_version)
        assert rollouts.metrics["async/staleness_max"] <= max_staleness
    finally:
        producer.close()


def spanning(prompt: int, versions: list[tuple[int, int, int]], length: int = 4) -> Sample:
    """A sample whose tokens the engine labelled with `versions` spans ([version, start, end))."""
    return Sample([prompt], list(range(4, 4 + length)), [-1.0] * length, "length", versions[-1][0], versions)


def rollouts_of(samples: list[Sample], n: int) -> Rollouts:
    batch, group_ids = samples_to_batch(samples, n)
    prompts = [{"index": i} for i in range(len(samples) // n)]
    return Rollouts(prompts, samples, torch.arange(len(samples), dtype=torch.float32), batch, group_ids)


def test_a_sample_spanning_a_push_is_labelled_per_token_and_weighted_on_its_old_tokens_only():
    from mcore_rl.actor.step_losses import stale_tis_weights

    state = LoopState(weight_version=5)
    producer = AsyncProducer(None, state, max_staleness=2, last_step=1)
    try:
        # sample 0 was in flight across two pushes (versions 3, 4, 5); sample 1 is fresh
        rollouts = producer.tag(
            rollouts_of([spanning(1, [(3, 0, 1), (4, 1, 3), (5, 3, 4)]), spanning(2, [(5, 0, 4)])], 1)
        )
    finally:
        producer.close()
    tensors = rollouts.batch.tensors
    assert tensors["version_lag"].tolist() == [[2.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert tensors["stale"].tolist() == [[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    m = rollouts.metrics
    assert m["async/partial_requests"] == 1 and m["async/staleness_max"] == 2 and m["async/stale_frac"] == 0.5
    assert m["async/staleness_mean"] == pytest.approx(4 / 8)
    assert [m[f"async/lag_tokens_frac/{d}"] for d in range(3)] == [5 / 8, 2 / 8, 1 / 8]
    assert [m[f"async/lag_samples/{d}"] for d in range(3)] == [1.0, 0.0, 1.0]
    # the correction: TIS on the three old tokens of sample 0, weight 1 on its last token and on sample 1
    mask = rollouts.batch.response_mask
    old = torch.full_like(mask, -1.0)
    weights = stale_tis_weights({**tensors, "old_logprobs": old, "rollout_logprobs": old - 0.5}, mask, cap=1.5)
    assert weights.tolist() == [[1.5, 1.5, 1.5, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_a_group_past_the_limit_is_dropped_and_the_rest_trained():
    state = LoopState(weight_version=5)
    producer = AsyncProducer(None, state, max_staleness=1, last_step=1, action="drop", group_unit=1)
    try:
        samples = [
            spanning(1, [(5, 0, 4)]),
            spanning(1, [(3, 0, 2), (5, 2, 4)]),
            spanning(2, [(4, 0, 4)]),
            spanning(2, [(5, 0, 4)]),
        ]
        rollouts = producer.tag(rollouts_of(samples, 2))
    finally:
        producer.close()
    assert [s.prompt_ids for s in rollouts.samples] == [[2], [2]]  # prompt 1's group held a token 2 versions old
    assert rollouts.scores.tolist() == [2.0, 3.0] and rollouts.group_ids.tolist() == [0, 0]
    assert rollouts.batch.tensors["version_lag"].tolist() == [[1.0] * 4, [0.0] * 4]
    assert rollouts.metrics["async/dropped_samples"] == 2 and rollouts.metrics["async/staleness_max"] == 1


def test_weight_keeps_a_sample_past_the_limit_with_its_old_tokens_weighted():
    state = LoopState(weight_version=5)
    producer = AsyncProducer(None, state, max_staleness=1, last_step=1, action="weight")
    try:
        rollouts = producer.tag(rollouts_of([spanning(1, [(2, 0, 3), (5, 3, 4)])], 1))
    finally:
        producer.close()
    assert rollouts.batch.tensors["stale"].tolist() == [[1.0, 1.0, 1.0, 0.0]]
    assert rollouts.metrics["async/kept_over_limit_samples"] == 1 and rollouts.metrics["async/dropped_samples"] == 0


def test_a_limit_that_drops_every_group_ends_the_step_with_an_error_naming_it():
    state = LoopState(weight_version=5)
    producer = AsyncProducer(None, state, max_staleness=1, last_step=1, group_unit=2)
    try:
        samples = [spanning(1, [(3, 0, 4)]), spanning(2, [(5, 0, 4)])]  # one fresh group: fewer than the unit of 2
        with pytest.raises(StalenessLimitExceeded, match=r"rollout.max_staleness=1: step 7 has no group left to train"):
            producer.tag(rollouts_of(samples, 1), step=7)
    finally:
        producer.close()
    assert issubclass(StalenessLimitExceeded, ValueError)  # a user's setting: exit 2 (lifecycle's user errors)


def test_non_integer_versions_are_refused_by_name():
    producer = AsyncProducer(None, LoopState(), max_staleness=1, last_step=1)
    try:
        with pytest.raises(RuntimeError, match="non-integer weight versions"):
            producer.tag(rollouts_of([spanning(1, [("v1", 0, 4)])], 1))
    finally:
        producer.close()


def test_staleness_zero_is_the_synchronous_producer_itself(tmp_path):
    """k = 0 adds no thread and no wrapper: the run's producer is the one the synchronous loop always used."""
    cfg = RLConfig()
    path = write_synthetic_dataset(str(tmp_path / "d.parquet"), 16, 0)
    loader = PromptLoader(PromptDataset([path], TOK, 64), 4, seed=0)
    reward = RewardManager(build_reward_fn(None, None))
    inner = make_run_producer(cfg, loader, None, reward, TOK, LoopState())
    assert type(inner) is RolloutProducer
    cfg.rollout.max_staleness = 2
    ahead = make_run_producer(cfg, loader, None, reward, TOK, LoopState())
    try:
        assert isinstance(ahead, AsyncProducer) and ahead.max_staleness == 2 and type(ahead.inner) is RolloutProducer
    finally:
        ahead.close()


def test_stale_samples_get_truncated_importance_weights_fresh_ones_weight_one():
    from mcore_rl.actor.step_losses import stale_tis_weights

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    old = torch.tensor([[-1.0, -0.1, -5.0], [-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -3.0, 0.0], [-2.0, -2.0, -2.0]])
    tensors = {"old_logprobs": old, "rollout_logprobs": rollout, "stale": torch.tensor([1.0, 0.0])}
    weights = stale_tis_weights(tensors, mask, cap=2.0)
    expected_row0 = torch.tensor([torch.exp(torch.tensor(0.5)).item(), 2.0, 0.0])  # ratio 1.65, capped 2, masked
    assert torch.allclose(weights[0], expected_row0) and torch.equal(weights[1], mask[1])
    assert stale_tis_weights(tensors, mask, cap=None) is None
    assert stale_tis_weights({**tensors, "stale": torch.zeros(2)}, mask, cap=2.0) is None


def test_without_partial_rollouts_a_push_waits_for_the_batch_and_no_sample_spans_two_versions(server, tmp_path):
    """rollout.partial_rollout=false: the loop's push holds the producer's fence, so it lands between two batches;
    with long responses and pushes issued while the next batch generates, every sample is of one version."""
    thread, client = server
    state = LoopState()
    set_version(client, thread.url, state.weight_version)
    producer = AsyncProducer(make_producer(tmp_path, client, max_new_tokens=40), state, 2, last_step=4, partial=False)
    try:
        for step in range(1, 5):
            rollouts = producer.produce(step, StepTimer())
            for s in rollouts.samples:
                assert len({v for v, _, _ in s.weight_versions}) == 1, s.weight_versions
            assert rollouts.metrics["async/partial_requests"] == 0
            with producer.push_fence():  # as RunSession.push holds it
                state.weight_version += 1
                set_version(client, thread.url, state.weight_version)
        assert rollouts.metrics["async/push_wait_s"] >= 0
    finally:
        producer.close()


class Regenerating:
    """An inner producer's `regenerate`: each prompt's group again, sampled by `version` (the engines' current one)."""

    def __init__(self, version: int, n: int) -> None:
        self.version, self.n, self.asked = version, n, []

    def regenerate(self, prompts, step):
        self.asked.append(([p["index"] for p in prompts], step))
        samples = [spanning(9, [(self.version, 0, 4)]) for _ in prompts for _ in range(self.n)]
        out = rollouts_of(samples, self.n)
        out.prompts, out.scores = prompts, torch.full((len(samples),), 7.0)
        return out


def test_regenerate_generates_the_groups_past_the_limit_again_on_the_current_weights():
    state = LoopState(weight_version=5)
    inner = Regenerating(version=5, n=2)
    producer = AsyncProducer(inner, state, max_staleness=1, last_step=1, action="regenerate")
    try:
        samples = [
            spanning(1, [(5, 0, 4)]),
            spanning(1, [(5, 0, 4)]),
            spanning(2, [(3, 0, 4)]),
            spanning(2, [(4, 0, 4)]),
        ]
        rollouts = producer.tag(rollouts_of(samples, 2), step=3)
    finally:
        producer.close()
    assert inner.asked == [([1], 3)]  # prompt 1's group (index 1) held a token 2 versions old
    assert [s.prompt_ids for s in rollouts.samples] == [[1], [1], [9], [9]]
    assert rollouts.scores.tolist() == [0.0, 1.0, 7.0, 7.0] and len(rollouts.prompts) == 2
    assert rollouts.batch.tensors["version_lag"].sum() == 0  # every token now of the current version
    assert rollouts.metrics["async/regenerated_samples"] == 2 and rollouts.metrics["async/dropped_samples"] == 0


def test_regenerate_is_refused_where_a_group_cannot_be_generated_again_inside_a_step():
    from mcore_rl.config import ConfigError

    for key in ("agent", "filter_groups"):
        cfg = RLConfig()
        cfg.model.hf_config = dict(tiny_qwen3_moe(vocab_size=63, max_position_embeddings=512))
        cfg.rollout.max_staleness, cfg.rollout.staleness_action = 1, "regenerate"
        if key == "agent":
            cfg.agent.enabled, cfg.agent.tools = True, ["calculator"]
        else:
            cfg.algorithm.filter_groups.enable = True
        with pytest.raises(
            ConfigError, match="rollout.staleness_action='regenerate' is invalid: expected drop or weight"
        ):
            cfg.validate()
