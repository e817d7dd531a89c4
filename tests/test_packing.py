"""Sequence packing (THD, actor/packing.py) against the padded path on CPU: the packed row, cu_seqlens, targets and
the logprob gather read the same response logprobs as the padded micro-batches, with a causal stand-in model whose
output at a position depends on the token and its position within its own sequence (what TE's THD attention
guarantees on GPUs: no sequence sees another)."""

from __future__ import annotations

import pytest
import torch
from test_dynamic_batching import _mixed

from mcore_rl.actor.batch import micro_batches
from mcore_rl.actor.logprobs import response_logprobs
from mcore_rl.actor.packing import pack_micro_batch, packed_micro_batches, unpack_rows

VOCAB = 100


def _model(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    by_token, by_position = torch.randn(128, VOCAB, generator=gen), torch.randn(256, VOCAB, generator=gen)
    return by_token[tokens] + by_position[positions]


def _padded_logprobs(batch) -> torch.Tensor:  # noqa: ANN001
    (mb,), _ = micro_batches(batch, batch.size)
    logits = _model(mb.tokens, mb.position_ids)
    return response_logprobs(logits, mb.targets, mb.gather_index, VOCAB) * mb.response_mask


def test_packed_logprobs_equal_the_padded_path() -> None:
    batch = _mixed(seed=3)
    want = _padded_logprobs(batch)
    got = []
    for mb in packed_micro_batches(batch, micro_batch_size=5, pad_multiple=4, max_tokens=200):
        logits = _model(mb.tokens, mb.position_ids)
        got.append(unpack_rows(mb, response_logprobs(logits, mb.targets, mb.gather_index, VOCAB)) * mb.response_mask)
    assert torch.equal(torch.cat(got), want)


def test_packed_row_layout() -> None:
    batch = _mixed(seed=4).select([0, 5, 9])
    mb = pack_micro_batch(batch, pad_multiple=8)
    lengths = [len(p) + int(r) for p, r in zip(batch.prompts, batch.response_lengths().tolist())]
    cu = mb.packed_seq["cu_seqlens"].tolist()
    assert cu[:4] == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert cu[-1] == mb.tokens.shape[1] and mb.tokens.shape[1] % 8 == 0 and mb.tokens.shape[1] - sum(lengths) < 8
    assert mb.packed_seq["max_seqlen"] == max(lengths + [cu[-1] - cu[-2]])
    for start, end in zip(cu[:-1], cu[1:]):  # positions restart, a sequence's last target is 0
        assert mb.position_ids[0, start:end].tolist() == list(range(end - start)) and mb.targets[0, end - 1] == 0
    assert mb.to("meta").packed_seq["cu_seqlens"].device.type == "meta"


def test_packing_respects_the_token_budget_and_keeps_the_order() -> None:
    batch = _mixed(seed=5)
    mbs = packed_micro_batches(batch, micro_batch_size=16, max_tokens=120)
    assert sum(mb.packed_seq["rows"] for mb in mbs) == batch.size
    assert all(
        mb.packed_seq["rows"] == 1 or int(mb.packed_seq["cu_seqlens"][mb.packed_seq["rows"]]) <= 120 for mb in mbs
    )
    assert torch.equal(torch.cat([mb.tensors["advantages"] for mb in mbs]), batch.tensors["advantages"])


def test_packing_without_transformer_engine_is_refused_before_any_rank() -> None:

    from mcore_rl.actor.runtime import check_runtime
    from mcore_rl.config import ConfigError, RLConfig

    cfg = RLConfig()
    cfg.actor.packing = True
    with pytest.raises(ConfigError, match="actor.packing=true needs Transformer Engine's attention"):
        check_runtime(cfg)  # trainer.runtime=cpu
    cfg.trainer.runtime = "cuda"
    with pytest.raises(ConfigError, match=r"\(not importable here\)"):
        check_runtime(cfg, visible_gpus=1, te=False)
    cfg.actor.router_replay_mode = "R3"
    with pytest.raises(ConfigError, match="routing replay"):
        check_runtime(cfg, visible_gpus=1, te=True)


@pytest.mark.gpu
def test_packed_actor_logprobs_equal_padded_on_cuda_with_te() -> None:
    """GPU with Transformer Engine: the actor's logprobs with actor.packing equal (to bf16 noise) the padded path's."""

    from mcore_rl.models.spec import transformer_engine_available

    if not torch.cuda.is_available() or not transformer_engine_available():
        pytest.skip("needs CUDA and Transformer Engine (THD attention)")
    from test_gpu_runtime import _cuda_actor

    from mcore_rl.parallel.groups import destroy_model_parallel

    try:
        actor = _cuda_actor()
        batch = _mixed(seed=6)
        padded = actor.logprobs(batch).payload
        actor.cfg.packing = True
        packed = actor.logprobs(batch).payload
        assert (packed - padded).abs().max() < 0.05
    finally:
        destroy_model_parallel()
