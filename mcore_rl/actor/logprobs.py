"""Per-token log-probabilities from vocab-parallel logits, with Megatron's padded vocabulary masked out.

Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x tp. The padded rows of the output layer are
real parameters (zero at load), so their logits take part in a plain softmax and shift every logprob by
log(1 + n_pad * exp(0 - lse)): a silent bias against the rollout engine, which has no padding. Here padded columns are
excluded before the softmax.

Math (per token, over the full vocabulary split across the TP group):
    lse     = log sum_v exp(z_v)        (max and sum all-reduced over TP)
    logp    = z_target - lse
    d logp / d z_v = 1[v = target] - softmax(z)_v
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist


def _reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group, tp_size):  # noqa: ANN001
        logits = logits.float()
        local_vocab = logits.shape[-1]
        valid = (torch.arange(local_vocab, device=logits.device) + vocab_start) < vocab_size
        masked = logits.masked_fill(~valid, float("-inf"))
        zmax = _reduce(masked.max(dim=-1).values, dist.ReduceOp.MAX, group, tp_size)
        shifted = masked - zmax.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group, tp_size)
        local_target = target - vocab_start
        in_shard = (local_target >= 0) & (local_target < local_vocab)
        idx = local_target.clamp(0, local_vocab - 1).unsqueeze(-1)
        # where, not a product: a shard whose every column is padding (a vocabulary smaller than tp x the
        # padding multiple) gathers -inf, and -inf x 0 is NaN on every rank after the all-reduce
        target_logit = torch.where(in_shard, shifted.gather(-1, idx).squeeze(-1), 0.0)
        target_logit = _reduce(target_logit, dist.ReduceOp.SUM, group, tp_size)
        logp = target_logit - sum_exp.log()
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), idx, in_shard)
        return logp

    @staticmethod
    def backward(ctx, grad_logp):  # noqa: ANN001
        softmax, idx, in_shard = ctx.saved_tensors
        grad = -softmax
        grad.scatter_add_(-1, idx, in_shard.unsqueeze(-1).to(grad.dtype))
        return grad * grad_logp.unsqueeze(-1), None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """log p(target) from this rank's vocab shard of the logits ([..., V/tp]); differentiable; fp32 result.

    `vocab_size` is the true (unpadded) vocabulary size: columns at or beyond it are excluded.
    """
    tp_size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    tp_rank = dist.get_rank(tp_group) if tp_size > 1 else 0
    vocab_start = tp_rank * logits.shape[-1]
    return _VocabParallelLogprob.apply(logits, target, vocab_start, vocab_size, tp_group, tp_size)


@torch.no_grad()
def vocab_parallel_entropy(
    logits: torch.Tensor, vocab_size: int, tp_group: dist.ProcessGroup | None = None, chunk: int | None = None
) -> torch.Tensor:
    """Entropy of the (unpadded) softmax over the vocabulary split across TP, per position (a metric, no grad).

    Computed `chunk` positions at a time (LOGPROB_CHUNK) without autograd: its fp32 temporaries (the cast, the
    masked and shifted logits, their exp) are chunk x V/tp, not five full [positions, V/tp] copies (about 3.7 GB per
    GPU for Qwen3-235B's recipe). Every TP rank holds the same positions, so the chunks' all-reduces pair up."""
    chunk = chunk or LOGPROB_CHUNK
    with torch.no_grad():
        flat = logits.reshape(-1, logits.shape[-1])
        parts = [_entropy_rows(flat[a : a + chunk], vocab_size, tp_group) for a in range(0, flat.shape[0], chunk)]
        out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])


def _entropy_rows(logits: torch.Tensor, vocab_size: int, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    tp_size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    tp_rank = dist.get_rank(tp_group) if tp_size > 1 else 0
    logits = logits.float()
    valid = (torch.arange(logits.shape[-1], device=logits.device) + tp_rank * logits.shape[-1]) < vocab_size
    masked = logits.masked_fill(~valid, float("-inf"))
    zmax = _reduce(masked.max(dim=-1).values, dist.ReduceOp.MAX, tp_group, tp_size)
    shifted = masked - zmax.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, tp_group, tp_size)
    # H = log Z - sum p z (shifted), with padded columns contributing 0 (exp = 0, and 0 * -inf avoided by where).
    pz = _reduce(torch.where(valid, exp * shifted, 0.0).sum(dim=-1), dist.ReduceOp.SUM, tp_group, tp_size)
    return sum_exp.log() - pz / sum_exp


def vocab_parallel_entropy_grad(
    logits: torch.Tensor, vocab_size: int, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Entropy per position like `vocab_parallel_entropy`, differentiable (the entropy bonus of the policy loss).

    The max shift is detached (the entropy does not depend on it, so the gradient is exact) and padded columns are
    zeroed rather than set to -inf, so the backward never meets 0 * inf. The sums over the TP-split vocabulary are
    all-reduced forward and copied backward (Megatron's reduce_from_tensor_model_parallel_region): every TP rank
    computes the same loss from the reduced sums, so each rank's partial sum gets the loss's gradient once (a
    differentiable all-reduce would sum it over the ranks, tp times too large).
    """
    tp_size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    tp_rank = dist.get_rank(tp_group) if tp_size > 1 else 0
    logits = logits.float()
    valid = (torch.arange(logits.shape[-1], device=logits.device) + tp_rank * logits.shape[-1]) < vocab_size
    with torch.no_grad():
        zmax = _reduce(
            logits.masked_fill(~valid, float("-inf")).max(dim=-1).values, dist.ReduceOp.MAX, tp_group, tp_size
        )
    shifted = logits.masked_fill(~valid, 0.0) - zmax.unsqueeze(-1)
    exp = shifted.exp() * valid
    sums = torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1)])
    if tp_size > 1:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        sums = reduce_from_tensor_model_parallel_region(sums, group=tp_group)
    return sums[0].log() - sums[1] / sums[0]


#: response positions per chunk of a forward-only logprob pass: bounds its fp32 copy to chunk x V/tp per sample
LOGPROB_CHUNK = 1024


def response_positions(logits: torch.Tensor, gather_index: torch.Tensor) -> torch.Tensor:
    """The logits rows [b, R, V/tp] at the positions that predict response tokens (`gather_index` [b, R]), in the
    model dtype: what the loss reads, without the prompt's rows (differentiable: the gradient scatters back)."""
    return logits.gather(1, gather_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))


def response_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    gather_index: torch.Tensor,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    chunk: int = LOGPROB_CHUNK,
) -> torch.Tensor:
    """log p(response token j) [b, R] from the full-sequence logits [b, T, V/tp]; equal, bit for bit, to
    `vocab_parallel_logprobs(logits, targets).gather(1, gather_index)` (each row's softmax is the same arithmetic).

    Only response rows are cast to fp32 (not the prompt's), and without autograd (logprob passes) in chunks of
    `chunk` positions, so the fp32 working set is b x chunk x V/tp instead of b x T x V/tp. With autograd the rows are
    taken at once: the backward keeps each row's softmax either way.
    """
    picked_targets = targets.gather(1, gather_index)
    if torch.is_grad_enabled() or gather_index.shape[1] <= chunk:
        return vocab_parallel_logprobs(response_positions(logits, gather_index), picked_targets, vocab_size, tp_group)
    parts = [
        vocab_parallel_logprobs(
            response_positions(logits, gather_index[:, i : i + chunk]), picked_targets[:, i : i + chunk], vocab_size,
            tp_group,
        )
        for i in range(0, gather_index.shape[1], chunk)
    ]  # fmt: skip
    return torch.cat(parts, dim=1)


def narrowable_output_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output layer of a model chunk whose logits may be computed at chosen positions only: the last pipeline
    stage's, without sequence parallelism (its input would be this rank's slice of the sequence) and without MTP (whose
    layers call the same output layer on their own hidden states); None otherwise."""
    for module in model.modules():
        layer = getattr(module, "output_layer", None)
        if layer is None or not getattr(module, "post_process", False):
            continue
        if getattr(layer, "sequence_parallel", False) or getattr(module, "mtp_process", False):
            return None
        if getattr(getattr(module, "config", None), "mtp_num_layers", None):
            return None
        return layer
    return None


class ResponseHead:
    """Logits at the positions that predict response tokens only, for one forward:

        head = ResponseHead(narrowable_output_layer(model), mb.gather_index)
        with head:
            logits = model(...)                  # [b, R, V/tp] instead of [b, T, V/tp]
        loss_fn(head.micro_batch(mb), logits)    # targets and gather_index re-indexed to those rows

    The output layer's input [T, b, h] is narrowed to the rows `gather_index` [b, R] names (a gather, whose backward
    scatters the gradient back) before the vocabulary projection, so the prompt's positions never reach it. Each row
    is the same dot products as in the full projection; the loss reads exactly these rows either way. On the real-model
    recipe (40 prompt tokens, about 20 response tokens, a 49152-token vocabulary) this removes half of the output
    layer's matmuls and half of its full-vocabulary activations. A `None` layer is a no-op: the full logits, `mb`
    unchanged."""

    def __init__(self, layer: torch.nn.Module | None, gather_index: torch.Tensor) -> None:
        self.layer, self.gather_index, self._handle = layer, gather_index, None

    def __enter__(self) -> ResponseHead:
        if self.layer is not None:
            self._handle = self.layer.register_forward_pre_hook(self._narrow)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _narrow(self, module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]  # [T, b, h], sequence first (Megatron's layout)
        index = self.gather_index.t().unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        return (hidden.gather(0, index).contiguous(), *args[1:])

    def micro_batch(self, mb: Any) -> Any:
        """`mb` as the narrowed logits see it: row j of sample b is response token j's, its target that token."""
        if self.layer is None:
            return mb
        rows = torch.arange(mb.gather_index.shape[1], device=mb.gather_index.device).expand_as(mb.gather_index)
        return dataclasses.replace(mb, targets=mb.targets.gather(1, mb.gather_index), gather_index=rows)
