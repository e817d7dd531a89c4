"""The client against answers shaped as real SGLang 0.5.23 gives them (`weight_version`, and for a request that
lived across a weight update `weight_versions` spans; `sampling_seed` shared by the n samples of a request), from a
small HTTP double that records what it was sent.

Run: `.venv/bin/pytest tests/test_sglang_client.py`
"""

from __future__ import annotations

import pytest
from _http_double import serve
from aiohttp import web

from mcore_rl.rollout.client import RolloutClient


class SGLangGenerate:
    """/generate as SGLang answers it: `n` answers per prompt, `meta_info.weight_version` (and `weight_versions`
    when `spans` is set: the answer a test gives). The first answer of
    the first request ends as an abort after 2 tokens at version "1" when `abort_first` is set; every later answer
    runs at version "2" then (a pause in abort mode, then a weight update, then the client's continuation)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.version = "1"
        self.abort_first = False
        self.spans: list[dict] | None = None

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        ids = body["input_ids"]
        prompts = ids if isinstance(ids[0], list) else [ids]
        params = body["sampling_params"]
        answers = []
        for prompt in prompts:
            for _ in range(params.get("n", 1)):
                budget = params["max_new_tokens"]
                abort = self.abort_first and self.version == "1" and len(self.bodies) == 1 and budget > 2
                count = 2 if abort else budget
                tokens = [(prompt[-1] + k + 1) % 50 for k in range(count)]
                meta = {
                    "finish_reason": {"type": "abort" if abort else "length"},
                    "output_token_logprobs": [[-0.5, t, None] for t in tokens],
                    "weight_version": self.version,
                }
                if self.spans is not None:
                    meta["weight_versions"] = self.spans
                answers.append({"output_ids": tokens, "meta_info": meta})
                if abort:
                    self.version = "2"
        return web.json_response(answers if len(answers) > 1 or isinstance(ids[0], list) else answers[0])


@pytest.fixture
def sglang():
    double = SGLangGenerate()
    app = web.Application()
    app.router.add_post("/generate", double.generate)
    with serve(app) as (url, _):
        client = RolloutClient(url, engine="sglang")
        yield double, client
        client.close()


@pytest.mark.parametrize("groups", [0, 1], ids=["per-prompt", "batched"])
def test_one_seed_is_never_sent_for_n_samples(sglang, groups) -> None:
    double, client = sglang
    client.generate_samples([[1, 2], [3, 4]], 4, {"max_new_tokens": 3}, seed=100, groups=groups)
    seeded = [b for b in double.bodies if "sampling_seed" in b["sampling_params"]]
    assert seeded, "the seeds still go out (SGLang's deterministic inference uses them)"
    for body in seeded:
        ids = body["input_ids"]
        assert body["sampling_params"].get("n", 1) == 1 and not isinstance(ids[0], list), body
    assert sorted(b["sampling_params"]["sampling_seed"] for b in seeded) == list(range(100, 108))


def test_unseeded_samples_stay_one_request(sglang) -> None:
    double, client = sglang
    client.generate_samples([[1, 2]], 4, {"max_new_tokens": 3}, seed=None)
    assert len(double.bodies) == 1 and double.bodies[0]["sampling_params"]["n"] == 4


def test_versions_of_a_sample_continued_after_an_abort(sglang) -> None:
    """SGLang reports one version per answer: the client tags each piece with its own, so the async staleness
    check (`weight_versions`, else `weight_version`) sees the old tokens."""
    double, client = sglang
    double.abort_first = True
    (sample,) = client.generate_samples([[1, 2]], 1, {"max_new_tokens": 5}, seed=None)
    assert sample.finish_reason == "length" and len(sample.response_ids) == 5
    assert sample.weight_versions == [(1, 0, 2), (2, 2, 5)]
    assert sample.weight_version == 2


#: SGLang 0.5.23's meta_info for a request that sampled 3 tokens under version "1", lived through a push to "2"
#: (retracted or paused in place: `record_weight_version_change` recorded the event, managers/scheduler.py:5636-5655)
#: and sampled 2 more: written by its own `compute_weight_version_spans` and `add_weight_versions_to_meta_info`
#: (utils/weight_versions.py:62-107), run on the wheel's file
SPANS_ACROSS_A_PUSH = [{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 3, "end": 5}]


def test_a_sample_that_lived_across_a_push_is_labelled_per_token(sglang) -> None:
    """Before: the SGLang dialect ignored the spans, so the 3 tokens sampled under version 1 were labelled 2 and the
    staleness check saw a fresh sample."""
    double, client = sglang
    double.version, double.spans = "2", SPANS_ACROSS_A_PUSH
    (sample,) = client.generate_samples([[1, 2]], 1, {"max_new_tokens": 5}, seed=None)
    assert sample.weight_versions == [(1, 0, 3), (2, 3, 5)] and sample.weight_version == 2


def test_an_empty_span_is_no_token() -> None:
    """SGLang writes a span [0, 0) for a request that ended before its first token (utils/weight_versions.py:96,
    `span.start == 0` is kept): it labels no token."""
    from mcore_rl.rollout.client import DIALECTS, sample_from_response

    answer = {"meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "abort"}, "weight_version": "2",
                            "weight_versions": [{"version": "2", "start": 0, "end": 0}]}}  # fmt: skip
    sample = sample_from_response([1], answer, dialect=DIALECTS["sglang"])
    assert sample.weight_versions == [] and sample.weight_version == 2


def test_staleness_reads_the_spans_of_an_sglang_sample(sglang) -> None:
    """The async producer's labels: the 3 tokens of version 1 are stale (lag 1) once the engines serve version 2, the
    2 tokens of version 2 are not."""
    import torch

    from mcore_rl.controller.async_producer import AsyncProducer
    from mcore_rl.controller.producer import Rollouts
    from mcore_rl.controller.samples import samples_to_batch
    from mcore_rl.controller.state import LoopState

    double, client = sglang
    double.version, double.spans = "2", SPANS_ACROSS_A_PUSH
    samples = client.generate_samples([[1, 2]], 1, {"max_new_tokens": 5}, seed=None)
    producer = AsyncProducer(None, LoopState(weight_version=2), max_staleness=1, last_step=1)
    rollouts = Rollouts([{}], samples, torch.zeros(1), *samples_to_batch(samples, 1))
    try:
        producer.tag(rollouts)
    finally:
        producer.close()
    assert rollouts.batch.tensors["version_lag"].tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]]
    assert rollouts.batch.tensors["stale"].tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]]
    assert rollouts.metrics["async/two_version_frac"] == 1.0 and rollouts.metrics["async/staleness_max"] == 1.0


def test_retry_back_off_doubles_up_to_its_cap(monkeypatch) -> None:
    # An engine that is down (nothing listens on the port): every retry waits; the waits double from backoff_s and
    # stop growing at max_backoff_s. The waits are recorded, not timed.
    import asyncio

    from mcore_rl.parallel.groups import free_port
    from mcore_rl.rollout.client import RolloutRequestError

    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(seconds: float) -> None:
        waits.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", recording_sleep)
    client = RolloutClient(f"http://127.0.0.1:{free_port()}", max_retries=7, backoff_s=0.5, max_backoff_s=4.0)
    try:
        with pytest.raises(RolloutRequestError, match="failed after 7 retries"):
            client.run(client.agenerate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}))
    finally:
        client.close()
    assert [client.retry_delay_s(k) for k in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    assert len(waits) == 7
    assert all(base <= wait <= base * 1.1 for wait, base in zip(waits, [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]))
