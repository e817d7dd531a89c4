"""The critic's scalar value head: what makes the role-agnostic Megatron worker a critic.

    chunks = build_gpt_chunks(spec, pg)          # the policy's family and shape (so the policy checkpoint loads)
    load_hf_weights(chunks, ...)                 # trunk from the policy's (or critic.path's) HF checkpoint
    attach_value_heads(chunks, pg, seed)         # last stage: output_layer [vocab/tp, h] -> ValueHead [1, h]
    values = value_outputs[..., 0].gather(1, gather_index)   # V(s_t) at the position that predicts response token t

Why a head on the final hidden states rather than a GPTModel with a 1-wide output layer: Megatron's GPTModel uses one
`vocab_size` for the input embedding and the output layer, so a 1-wide vocabulary would also shrink the embedding; and
a ColumnParallelLinear of width 1 cannot be split over tp > 1 (it would be padded to tp columns, tp - 1 of them dead,
with vocabulary padding rules to keep out of the loss). The head here is one [1, hidden] weight, replicated on every TP
rank: the final hidden states are identical on all TP ranks (gathered first under sequence parallelism), so every
rank computes the same value and gets the same gradient, with no vocabulary padding anywhere. It takes the place of
`GPTModel.output_layer` (same call signature), so Megatron's forward, pipeline schedule and DDP run unchanged (verl's
Megatron critic makes the same substitution).
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_rl.algorithms import value_loss


class ValueHead(torch.nn.Module):
    """hidden [s, b, h] (sequence-sharded under SP) -> values [s, b, 1]; replaces `GPTModel.output_layer`."""

    def __init__(
        self, hidden_size: int, dtype: torch.dtype, std: float, seed: int, sequence_parallel: bool, tp_group: Any
    ) -> None:
        super().__init__()
        # Seeded on CPU so every TP and DP rank starts from the same head (DDP broadcasts DP anyway; TP replicas
        # must agree by construction).
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=generator, dtype=torch.float32) * std
        self.weight = torch.nn.Parameter(weight.to(dtype))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(
        self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, None]:
        """`weight` (the tied embedding GPTModel passes to its output layer) is ignored: the head has its own."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Every TP rank computes the full-sequence values from the gathered states, so the backward only takes
            # this rank's slice (tensor_parallel_output_grad=False), instead of summing tp identical gradients.
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return torch.nn.functional.linear(hidden_states, self.weight), None


def attach_value_heads(chunks: list[torch.nn.Module], pg: Any, seed: int) -> None:
    """Replace the output layer of the chunk(s) that hold one (the last pipeline stage) with a ValueHead.

    Embedding tying is switched off: the head is not the embedding, and Megatron would otherwise all-reduce the
    embedding's gradient with the head's across the first and last stages.
    """
    for chunk in chunks:
        chunk.share_embeddings_and_output_weights = False
        if not getattr(chunk, "post_process", False):
            continue
        config = chunk.config
        chunk.output_layer = ValueHead(
            config.hidden_size,
            config.params_dtype,
            std=config.init_method_std,
            seed=seed,
            sequence_parallel=config.sequence_parallel,
            tp_group=pg.tp,
        )


def response_values(output: torch.Tensor, gather_index: torch.Tensor) -> torch.Tensor:
    """Values [b, R] of the response tokens from the head's output [b, T, 1]: V(prompt + response[:t]) is read at
    the position whose output predicts response token t, the same position as its logprob."""
    return output[..., 0].float().gather(1, gather_index)


def critic_loss(
    cfg: Any, values: torch.Tensor, tensors: dict[str, torch.Tensor], mask: torch.Tensor, denominator: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss of one micro-batch (algorithms/losses.py's value_loss) against `returns`, around the
    `values` the advantages were computed with; metrics are token-weighted sums (divided by `_tokens` later)."""
    out = value_loss(
        values,
        tensors["values"],
        tensors["returns"],
        mask,
        clip_range_value=cfg.cliprange_value,
        loss_agg_mode=cfg.loss_agg_mode,
        max_response_len=mask.shape[1],
        agg_denominator=denominator,
    )
    weight = float(mask.sum())
    metrics = {f"critic/{k}": float(v) * weight for k, v in out.metrics.items()}
    metrics["critic/vf_loss"] = float(out.loss.detach()) * denominator
    metrics["_tokens"] = weight
    return out.loss, metrics
