"""Logprobs and entropy on response positions only: the same numbers, bit for bit, as the
full-sequence computation followed by a gather, with the fp32 working set limited to the response rows (chunked in
forward-only passes)."""

from __future__ import annotations

import torch

from mcore_rl.actor.logprobs import (
    response_logprobs,
    response_positions,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)

VOCAB, PADDED = 100, 128


def _inputs(seed: int = 0):  # noqa: ANN202
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 40, PADDED, generator=gen).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (3, 40), generator=gen)
    prompt = torch.tensor([[5], [12], [1]])
    gather = (prompt - 1 + torch.arange(30)).clamp(max=39)  # response token j is predicted at prompt + j - 1
    return logits, targets, gather


def test_response_logprobs_equal_the_full_path_bit_for_bit() -> None:
    logits, targets, gather = _inputs()
    full = vocab_parallel_logprobs(logits, targets, VOCAB).gather(1, gather)
    with torch.no_grad():
        assert torch.equal(response_logprobs(logits, targets, gather, VOCAB), full)
        assert torch.equal(response_logprobs(logits, targets, gather, VOCAB, chunk=7), full)  # chunked


def test_response_logprobs_gradients_equal_the_full_path() -> None:
    logits, targets, gather = _inputs(1)
    weights = torch.randn(3, 30, generator=torch.Generator().manual_seed(11))  # seeded: a fixed case
    a = logits.clone().float().requires_grad_()
    (vocab_parallel_logprobs(a, targets, VOCAB).gather(1, gather) * weights).sum().backward()
    b = logits.clone().float().requires_grad_()
    (response_logprobs(b, targets, gather, VOCAB) * weights).sum().backward()
    assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-6)  # fp32 sums in another order: ulps of values ~1
    assert b.grad[1, 39].abs().sum() > 0 and b.grad[2, 30:].abs().sum() == 0  # rows past the responses get none


def test_entropy_on_response_positions_equals_the_gathered_full_entropy() -> None:
    logits, _, gather = _inputs(2)
    full = vocab_parallel_entropy(logits, VOCAB).gather(1, gather)
    assert torch.equal(vocab_parallel_entropy(response_positions(logits, gather), VOCAB), full)


def test_the_entropy_metric_in_chunks_equals_one_pass_and_keeps_no_graph() -> None:
    """The metric runs `chunk` positions at a time (its fp32 temporaries bounded; models/estimate.py counts one chunk
    of them, METRIC_CHUNK, which must be the actor's LOGPROB_CHUNK) and without autograd (a graph would keep every
    chunk's temporaries alive until the loss is freed)."""
    from mcore_rl.actor.logprobs import LOGPROB_CHUNK
    from mcore_rl.models.estimate import METRIC_CHUNK

    logits, _, _ = _inputs(3)
    rows = logits.float().requires_grad_()
    whole = vocab_parallel_entropy(rows, VOCAB, chunk=10**9)
    for chunk in (1, 7, 40, 119):  # 120 positions: uneven last chunks, one row, and one chunk short of all
        parts = vocab_parallel_entropy(rows, VOCAB, chunk=chunk)
        assert parts.shape == (3, 40) and torch.equal(parts, whole)
    assert not whole.requires_grad and whole.grad_fn is None
    assert vocab_parallel_entropy(rows[:, :0], VOCAB).shape == (3, 0)
    assert METRIC_CHUNK == LOGPROB_CHUNK
