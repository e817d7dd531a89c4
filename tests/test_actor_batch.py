"""The actor's batch layout: data-parallel shards, mini-batches, and where each response token's logprob is read."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.actor.batch import TrainBatch, micro_batches


def _batch() -> TrainBatch:
    prompts = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    lengths = [2, 3, 1, 0]
    responses = torch.zeros(4, 3, dtype=torch.long)
    mask = torch.zeros(4, 3)
    for i, n in enumerate(lengths):
        responses[i, :n] = torch.arange(20 + 10 * i, 20 + 10 * i + n)
        mask[i, :n] = 1
    return TrainBatch(prompts, responses, mask, {"advantages": torch.arange(12.0).reshape(4, 3)})


def test_logprob_positions_predict_the_response_tokens():
    batch = _batch()
    mbs, seq_len = micro_batches(batch, micro_batch_size=3)
    assert [mb.tokens.shape[0] for mb in mbs] == [3, 1]
    assert seq_len == max(len(p) + int(m.sum()) for p, m in zip(batch.prompts, batch.response_mask)) + 1
    for start, mb in zip((0, 3), mbs):
        # the output at gather_index[j] predicts targets[gather_index[j]], which must be response token j
        read = mb.targets.gather(1, mb.gather_index)
        part = batch.select(list(range(start, start + mb.tokens.shape[0])))
        assert torch.equal(read * part.response_mask.long(), part.responses * part.response_mask.long())
        # positions are 0..T-1 for right-padded sequences (RoPE sees no gaps)
        assert torch.equal(mb.position_ids[0], torch.arange(seq_len))
        assert torch.equal(mb.tensors["advantages"], part.tensors["advantages"])


def test_token_budget_caps_samples_per_micro_batch():
    batch = _batch()
    mbs, seq_len = micro_batches(batch, micro_batch_size=4, max_tokens=2 * 6)
    assert seq_len == 6 and [mb.tokens.shape[0] for mb in mbs] == [2, 2]
    mbs, _ = micro_batches(batch, micro_batch_size=4, max_tokens=1)  # never fewer than one sample
    assert [mb.tokens.shape[0] for mb in mbs] == [1, 1, 1, 1]


def test_sequence_parallel_pads_to_a_multiple_of_tp():
    _, seq_len = micro_batches(_batch(), micro_batch_size=4, pad_multiple=4)
    assert seq_len % 4 == 0 and seq_len >= 6


def test_dp_shards_and_mini_batches_concatenate_back_in_order():
    batch = _batch()
    shards = [batch.shard(r, 2) for r in range(2)]
    assert sum((s.prompts for s in shards), []) == batch.prompts
    assert torch.equal(torch.cat([s.responses for s in shards]), batch.responses)
    assert [c.prompts for c in batch.chunks(2)] == [batch.prompts[:2], batch.prompts[2:]]
    with pytest.raises(ValueError, match="does not split over dp=3"):
        batch.shard(0, 3)


def test_each_row_is_prompt_then_response_then_padding_for_random_batches():
    """Row i of a micro-batch holds prompt i, then its response up to its length (multi-turn: tool tokens inside the
    response are masked from the loss, not from the sequence; `lengths` says how long it is), then zeros; the
    logprob of response token j is read at prompt length - 1 + j. Random shapes, padding multiples and minimum
    lengths; response padding holds garbage that must not leak into the sequence."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        size, width = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
        prompts = [torch.randint(1, 60, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(size)]  # fmt: skip
        lengths = torch.randint(0, width + 1, (size,), generator=gen)
        responses = torch.randint(1, 60, (size, width), generator=gen)  # garbage past each length
        mask = (torch.arange(width) < lengths[:, None]).float()
        mask[:, 1:2] *= (torch.rand(size, 1, generator=gen) < 0.5).float()  # a masked tool token inside
        batch = TrainBatch(prompts, responses, mask, {"x": torch.randn(size, width, generator=gen)}, lengths=lengths)
        per, multiple = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen))
        mbs, seq_len = micro_batches(batch, per, multiple, min_seq_len=int(torch.randint(0, 16, (1,), generator=gen)))
        assert seq_len % multiple == 0 and seq_len > max(len(p) + int(n) for p, n in zip(prompts, lengths))
        rows = torch.cat([mb.tokens for mb in mbs])
        gathers = torch.cat([mb.gather_index for mb in mbs])
        for i, prompt in enumerate(prompts):
            n = int(lengths[i])
            expected = prompt + responses[i, :n].tolist()
            assert rows[i].tolist() == expected + [0] * (seq_len - len(expected))
            assert gathers[i].tolist() == [min(len(prompt) - 1 + j, seq_len - 1) for j in range(width)]
        assert torch.equal(torch.cat([mb.targets[:, :-1] for mb in mbs]), rows[:, 1:])


def test_micro_batches_land_on_the_given_device():
    """The micro-batcher moves every model input and loss tensor to the rank's device (CUDA runs; here the meta device
    stands in for it): before the fix the batches stayed in host memory and the first CUDA forward failed."""
    mbs, _ = micro_batches(_batch(), micro_batch_size=2, device="meta")
    for mb in mbs:
        fields = [mb.tokens, mb.position_ids, mb.targets, mb.gather_index, mb.response_mask, *mb.tensors.values()]
        assert {t.device.type for t in fields} == {"meta"}
