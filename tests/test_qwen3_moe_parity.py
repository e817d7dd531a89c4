"""Qwen3-MoE: Megatron (local spec, gloo ranks) vs transformers, same weights, fp32.

Forward: logits equal within 1e-4 under TP2 (+SP), PP2 (Megatron's pipeline schedule), EP2 and TP2 x EP2 on 4 ranks.
Backward: one SGD step on the mean token NLL, taken by Megatron (DDP + finalize_model_grads, through the schedule) and
by transformers, leaves logits that still agree within 1e-4; the step is large enough to move logits by far more.

Routing ties: top-k choices must agree between the two implementations, whose router logits differ by fp32 rounding
(~1e-7). The router weights are drawn with std 1.0 (logit gaps of order 1), and the test asserts that the gap between
the k-th and (k+1)-th router logit exceeds 1e-3 for every token of the input, so no tie can flip.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen3_moe_transformers

from mcore_rl.parallel.harness import run_on_ranks
from mcore_rl.parallel.layout import ParallelLayout

LR = 0.5
VOCAB = 100


def tiny_qwen3_moe(path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Save a tiny random Qwen3-MoE to `path`; return input ids, its logits, and its logits after one SGD step."""
    from transformers import Qwen3MoeForCausalLM

    cfg = tiny_qwen3_moe_transformers(vocab_size=VOCAB, initializer_range=0.2)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
    model.save_pretrained(path)
    ids = torch.randint(0, VOCAB, (4, 12))
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    for router_logits in out.router_logits:
        top = router_logits.float().topk(3, dim=-1).values
        assert (top[:, 1] - top[:, 2]).min() > 1e-3, "routing near-tie in the test input"
    loss = _nll(model(ids).logits, ids)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
        after = model(ids).logits
    return ids, out.logits, after


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -logp.gather(-1, ids[:, 1:, None]).mean()


def _megatron_rank(rank: int, world: int, layout: ParallelLayout, path: str, ids: torch.Tensor, step: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from mcore_rl.actor.logprobs import vocab_parallel_logprobs
    from mcore_rl.actor.schedule import run_schedule
    from mcore_rl.models.base import HFConfig
    from mcore_rl.models.builder import ModelSpec, build_gpt_chunks
    from mcore_rl.parallel.groups import initialize_model_parallel
    from mcore_rl.resharding.hf_io import HFCheckpointReader
    from mcore_rl.resharding.weight_map import load_hf_weights

    pg = initialize_model_parallel(layout)
    reader = HFCheckpointReader(path)
    spec = ModelSpec(HFConfig(reader.config), layout, make_vocab_size_divisible_by=64, max_sequence_length=64)
    chunks, contexts = build_gpt_chunks(spec, pg)
    load_hf_weights(chunks, contexts, spec.weight_map(), reader.read)
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), chunks[0], pg_collection=pg
    )
    dp, dp_rank = pg.dp.size(), pg.dp.rank()
    local = ids.chunk(dp)[dp_rank]
    tp = pg.tp.size()

    def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        torch.distributed.all_gather(parts, logits.contiguous(), group=pg.tp)
        return torch.cat(parts, -1)[..., :VOCAB]

    def run(forward_only: bool):
        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            out = model(
                input_ids=batch, position_ids=torch.arange(batch.shape[1]).expand_as(batch), attention_mask=None
            )

            def loss_func(logits):
                logp = vocab_parallel_logprobs(logits[:, :-1], batch[:, 1:], VOCAB, pg.tp)
                return -logp.mean(), {"logits": gather_vocab(logits.detach())}

            return out, loss_func

        return run_schedule([model], forward_step, [local], local.shape[1], local.shape[0], pg, forward_only)

    before = run(forward_only=not step)
    if step:
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.main_grad
        after = run(forward_only=True)
    holds = pg.pp.rank() == pg.pp.size() - 1 and pg.tp.rank() == 0
    if not holds:
        return None
    return dp_rank, before[0]["logits"], (after[0]["logits"] if step else None)


def _gather(results) -> tuple[torch.Tensor, torch.Tensor | None]:
    held = sorted((r for r in results if r is not None), key=lambda r: r[0])
    before = torch.cat([r[1] for r in held])
    after = torch.cat([r[2] for r in held]) if held[0][2] is not None else None
    return before, after


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    return (path, *tiny_qwen3_moe(path))


LAYOUTS = {
    "tp2": (2, ParallelLayout(tp=2, sequence_parallel=True)),
    "pp2": (2, ParallelLayout(pp=2)),
    "ep2": (2, ParallelLayout(ep=2)),
    "tp2_ep2": (4, ParallelLayout(tp=2, ep=2, sequence_parallel=True)),
}


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_forward_and_backward_match_transformers(hf_model, name):
    path, ids, ref_before, ref_after = hf_model
    world, layout = LAYOUTS[name]
    before, after = _gather(run_on_ranks(_megatron_rank, world, (layout, path, ids, True)))
    assert (before - ref_before).abs().max().item() <= 1e-4
    # The SGD step moves logits by far more than the tolerance, so agreement after it checks every gradient.
    assert (ref_after - ref_before).abs().max().item() > 1e-2
    assert (after - ref_after).abs().max().item() <= 1e-4
