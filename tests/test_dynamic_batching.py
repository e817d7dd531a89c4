"""actor.dynamic_batching: the update's dp shards balanced by tokens, micro-batches by real
length under a token budget; the same update as the padded path, with fewer padded tokens."""

from __future__ import annotations

import torch

from mcore_rl.actor.batch import TrainBatch, balanced_shard, dynamic_micro_batches, micro_batches, sequence_length


def _mixed(n_prompts: int = 4, n: int = 4, seed: int = 0) -> TrainBatch:
    """n samples per prompt, next to each other as the controller orders them; lengths vary by prompt (as a task
    whose answers differ in length does) and a little within a group."""
    gen = torch.Generator().manual_seed(seed)
    prompts, lengths = [], []
    for p in range(n_prompts):
        base = 4 + 14 * p
        for _ in range(n):
            prompts.append(list(range(1, 4 + p)))
            lengths.append(min(64, base + int(torch.randint(0, 4, (1,), generator=gen))))
    R = max(lengths)
    responses = torch.zeros(len(prompts), R, dtype=torch.long)
    mask = torch.zeros(len(prompts), R)
    for i, length in enumerate(lengths):
        responses[i, :length] = torch.randint(1, 90, (length,), generator=gen)
        mask[i, :length] = 1
    return TrainBatch(prompts, responses, mask, {"advantages": torch.randn(len(prompts), R, generator=gen)})


def _tokens(batch: TrainBatch) -> int:
    return sum(len(p) for p in batch.prompts) + int(batch.response_lengths().sum())


def test_balanced_shards_spread_the_tokens_of_one_prompts_samples() -> None:
    batch = _mixed()
    contiguous = [_tokens(batch.shard(r, 4)) for r in range(4)]
    balanced = [balanced_shard(batch, r, 4) for r in range(4)]
    assert sorted(i for s in balanced for i in s.tensors["advantages"][:, 0].tolist()) == sorted(
        batch.tensors["advantages"][:, 0].tolist()
    )  # every sample exactly once
    assert {s.size for s in balanced} == {4}
    spread = [_tokens(s) for s in balanced]
    assert max(spread) - min(spread) < (max(contiguous) - min(contiguous)) / 4


def test_micro_batches_by_real_length_read_the_right_tokens_and_pad_less() -> None:
    batch = _mixed()
    mbs = dynamic_micro_batches(batch, micro_batch_size=4, pad_multiple=2, max_tokens=160)
    assert sum(mb.tokens.shape[0] for mb in mbs) == batch.size
    for mb in mbs:
        assert mb.tokens.shape[1] % 2 == 0
        assert mb.tokens.shape[0] == 1 or mb.tokens.numel() <= 160  # the budget holds (one sample always fits)
        read = mb.targets.gather(1, mb.gather_index)
        mask = mb.response_mask.long()
        assert (read * mask).sum() > 0
    fixed, seq_len = micro_batches(batch, 4, 2, 160, sequence_length(batch))
    padded = lambda parts: sum(mb.tokens.numel() for mb in parts) - _tokens(batch)  # noqa: E731
    assert padded(mbs) < padded(fixed) / 2


def test_dynamic_micro_batches_hold_the_responses_of_the_padded_path() -> None:
    """Same response tokens at the read positions, sample by sample (keyed by the advantages row)."""
    batch = _mixed()
    key = lambda mb: mb.tensors["advantages"][:, 0].tolist()  # noqa: E731
    want = {}
    (whole,), _ = micro_batches(batch, batch.size)
    for row, k in enumerate(key(whole)):
        want[k] = (whole.targets.gather(1, whole.gather_index)[row] * whole.response_mask[row].long()).tolist()
    for mb in dynamic_micro_batches(batch, micro_batch_size=3, max_tokens=100):
        for row, k in enumerate(key(mb)):
            assert (mb.targets.gather(1, mb.gather_index)[row] * mb.response_mask[row].long()).tolist() == want[k]


def _update_rank(rank: int, world: int) -> dict:
    from test_cuda_first_run import QWEN3_MOE_TINY

    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, ModelConfig

    batch = _mixed(seed=1)
    batch.tensors["old_logprobs"] = torch.zeros_like(batch.response_mask) - 4.0
    out = {}
    for dynamic in (False, True):
        cfg = ActorConfig(world_size=1, use_ref=False, mini_batches=1, micro_batch_size=4, dynamic_batching=dynamic,
                          max_tokens_per_microbatch=160)  # fmt: skip
        actor = MegatronActor(rank, world, ModelConfig(hf_config=QWEN3_MOE_TINY), cfg)
        actor.initialize(("127.0.0.1", 0))
        metrics = actor.update(batch).payload
        params = torch.cat([p.detach().flatten() for p in actor.chunks[0].parameters()])
        out[dynamic] = (metrics, params)
    return out


def test_dynamic_batching_update_equals_the_padded_update() -> None:
    """The loss normaliser is the mini-batch's, so regrouping samples changes only the summation order."""
    from mcore_rl.parallel.harness import run_on_ranks

    got = run_on_ranks(_update_rank, 1)[0]
    (m0, p0), (m1, p1) = got[False], got[True]
    assert abs(m0["actor/pg_loss"] - m1["actor/pg_loss"]) < 1e-5
    assert torch.allclose(p0, p1, rtol=0, atol=1e-6)
