"""Tests for the embedded engine's token sampler (`mcore_rl.rollout.sampling`: one uniform per row, inverse CDF in
two levels) and for the shared-prefix prefill of the continuous batcher (`scheduler.ContinuousBatcher._prefill`).

Every draw here is seeded, so the frequency checks are deterministic, not flaky: the bounds hold for these seeds
with a wide margin (about 5 standard deviations).

Run: `.venv/bin/pytest tests/test_rollout_sampling.py`
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from mcore_rl.rollout import sampling
from mcore_rl.rollout.engine import HFRolloutEngine
from mcore_rl.rollout.sampling import CDF_BLOCK, inverse_cdf, sample_rows
from mcore_rl.rollout.scheduler import MIN_SHARED_PREFIX, ContinuousBatcher, GenParams, Sequence


def generators(count: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(count)]


def settings(rows: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0):
    return (
        torch.full((rows,), temperature),
        torch.full((rows,), top_p),
        torch.full((rows,), top_k),
        torch.full((rows,), min_p),
    )


@pytest.mark.parametrize("vocab", [7, CDF_BLOCK * 3, CDF_BLOCK * 3 + 5])
def test_inverse_cdf_draws_each_token_in_proportion_to_its_weight(vocab: int) -> None:
    """Unnormalised weights spread over several blocks (and a padded last block); zero weights are never drawn."""
    weights = torch.rand(vocab, generator=torch.Generator().manual_seed(1)) ** 4
    weights[::3] = 0.0
    draws = 20000
    rows = weights.expand(draws, vocab).contiguous()
    tokens = inverse_cdf(rows, generators(1, seed=2) * draws)  # one generator, consumed once per row in order
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[weights == 0].sum() == 0, "a token of weight 0 was drawn"
    expected = draws * weights.double() / weights.double().sum()
    # coarse bins keep every expected count large: blocks of tokens in vocabulary order
    bins = max(1, vocab // 8)
    observed_bins = counts.split(bins)
    expected_bins = expected.split(bins)
    for seen, want in zip(observed_bins, expected_bins):
        assert abs(seen.sum() - want.sum()) <= 5 * want.sum().sqrt() + 1, (seen.sum(), want.sum())


def test_inverse_cdf_at_the_ends_of_the_unit_interval_stays_on_tokens_with_weight(monkeypatch) -> None:
    """u = 0 takes the first token with weight; u just below 1 (u * total can round up to total) the last one."""
    weights = torch.zeros(2, CDF_BLOCK * 2 + 3)
    weights[:, [5, CDF_BLOCK + 1, CDF_BLOCK + 7]] = torch.tensor([0.1, 0.7, 0.3])
    for u, token in ((0.0, 5), (1.0 - 2.0**-53, CDF_BLOCK + 7)):
        monkeypatch.setattr(sampling.torch, "rand", lambda *a, u=u, **k: torch.full((1,), u, dtype=torch.float64))
        assert inverse_cdf(weights, generators(2)).tolist() == [token, token]


def test_a_rows_token_does_not_depend_on_the_other_rows() -> None:
    logits = torch.randn(5, 3 * CDF_BLOCK, generator=torch.Generator().manual_seed(3)) * 3
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0])
    top_p, top_k, min_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0]), torch.tensor([-1, -1, -1, 20, -1]), torch.zeros(5)
    min_p[4] = 0.05
    batch_tokens, batch_logprobs = sample_rows(logits, temperature, top_p, top_k, min_p, generators(5))
    for row in range(5):
        one = slice(row, row + 1)
        token, logprob = sample_rows(
            logits[one], temperature[one], top_p[one], top_k[one], min_p[one], [generators(5)[row]]
        )
        assert int(token) == int(batch_tokens[row])
        assert float(logprob) == pytest.approx(float(batch_logprobs[row]), abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_recorded_logprob_is_log_softmax_of_the_scaled_logits(temperature: float) -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(4)) * 4
    logits[0, :10] = float("-inf")  # banned tokens (min_new_tokens) take no mass
    tokens, logprobs = sample_rows(logits, *settings(4, temperature), generators(4))
    scale = temperature if temperature > 0 else 1.0
    reference = torch.log_softmax(logits / scale, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(logprobs, reference, atol=1e-5)
    assert bool((tokens[0] >= 10).all())
    if temperature == 0.0:
        assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_filters_keep_their_tokens_only() -> None:
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(5)) * 2
    order = logits[0].argsort(descending=True)
    probs = torch.softmax(logits[0], dim=-1)
    nucleus = int((probs[order].cumsum(0) - probs[order] < 0.5).sum())
    cases = {
        "top_k": (dict(top_k=7), set(order[:7].tolist())),
        "top_p": (dict(top_p=0.5), set(order[:nucleus].tolist())),
    }
    for name, (kwargs, allowed) in cases.items():
        draws = 400
        tokens, _ = sample_rows(logits.expand(draws, -1), *settings(draws, **kwargs), generators(draws))
        assert set(tokens.tolist()) <= allowed, name
        assert len(set(tokens.tolist())) > 1, f"{name}: the draws should spread over the kept tokens"


# ---------------------------------------------------------------- shared-prefix prefill

TINY = Qwen3Config(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    initializer_range=0.5,
)


def run(
    engine: HFRolloutEngine, prompts: list[list[int]], first: int = 0, **params
) -> tuple[list[Sequence], ContinuousBatcher]:
    """Two samples of each prompt; sample j of prompt i (counted from `first`) is seeded 10 * i + j."""
    seqs = [
        Sequence(f"{i}_{j}", prompt, GenParams(max_new_tokens=6, ignore_eos=True, seed=10 * i + j, **params))
        for i, prompt in enumerate(prompts, start=first)
        for j in range(2)
    ]
    batcher = ContinuousBatcher(engine)
    return batcher.run_until_done(seqs), batcher


def test_prompts_with_a_common_prefix_prefill_it_once_and_generate_as_alone() -> None:
    """Four prompts that open with the same 20 tokens (a chat template's system prompt) and end differently, one of
    them shorter (padding between the prefix and its tail): the prefix is computed once, and each sequence's tokens
    and logprobs are what it gets when its prompt is admitted alone (no prefix to share)."""
    engine = HFRolloutEngine(TINY, init_seed=0)
    prefix = [(7 * i) % 60 + 1 for i in range(MIN_SHARED_PREFIX + 4)]
    prompts = [prefix + [3, 4, 5], prefix + [9, 8, 7], prefix + [11], prefix + [12, 13, 14]]
    for params in ({"temperature": 0.0}, {"temperature": 1.0}):
        together, batcher = run(engine, prompts, **params)
        shared = len(prefix)
        assert batcher.stats["prefill_tokens"] == shared + sum(len(p) - shared for p in prompts)
        # the first distinct prompt computed the prefix; the others' first samples reused it, second samples all of it
        assert [s.cached_tokens for s in together] == [0, len(prompts[0])] + [
            c for p in prompts[1:] for c in (shared, len(p))
        ]
        for index, prompt in enumerate(prompts):
            alone, single = run(engine, [prompt], first=index, **params)
            assert single.stats["prefill_tokens"] == len(prompt)
            for a, t in zip(alone, together[2 * index : 2 * index + 2]):
                assert a.output_ids == t.output_ids
                assert a.output_logprobs == pytest.approx(t.output_logprobs, abs=1e-5)


def test_a_short_common_prefix_or_prompt_logprobs_prefill_every_position() -> None:
    engine = HFRolloutEngine(TINY, init_seed=0)
    short = [1, 2, 3]
    _, batcher = run(engine, [short + [4, 5], short + [6, 7]], temperature=0.0)
    assert batcher.stats["prefill_tokens"] == 10
    prefix = list(range(1, MIN_SHARED_PREFIX + 3))
    seqs = [
        Sequence(f"{i}", prefix + [40 + i], GenParams(max_new_tokens=2, temperature=0.0), True, logprob_start_len=0)
        for i in range(2)
    ]
    batcher = ContinuousBatcher(engine)
    batcher.run_until_done(seqs)
    assert batcher.stats["prefill_tokens"] == 2 * len(prefix) + 2
    assert all(len(s.input_logprobs) == len(prefix) + 1 for s in seqs)
