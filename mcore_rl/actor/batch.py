"""The training batch as the actor sees it, and its split into data-parallel shards and micro-batches.

Samples are stored response-aligned, as in verl: `responses`, `response_mask`, `old_logprobs`, `advantages` ... are
[B, R] tensors right-padded to the longest response. The actor rebuilds each sequence as prompt + response, right-padded
(so RoPE positions are 0..len-1 and causal attention never sees padding before a real token), and reads the logprob of
response token j of sample b at position prompt_len[b] + j - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainBatch:
    """Rollout samples plus the per-token quantities the loss needs. Tensor fields are [B] or [B, R]."""

    prompts: list[list[int]]
    responses: torch.Tensor  # [B, R] long, right-padded with 0
    response_mask: torch.Tensor  # [B, R] float
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # old_logprobs, ref_logprobs, advantages ...
    #: [B] response lengths; None = response_mask.sum(1). Needed when the mask has zeros inside a response
    #: (multi-turn: tool tokens are part of the sequence but not trained on)
    lengths: torch.Tensor | None = None

    def response_lengths(self) -> torch.Tensor:
        """[B] tokens of each response (trained on or not)."""
        return self.lengths if self.lengths is not None else self.response_mask.sum(1).long()

    @property
    def size(self) -> int:
        return len(self.prompts)

    def select(self, index: list[int] | torch.Tensor) -> TrainBatch:
        """The samples at `index`, in that order."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return TrainBatch(
            prompts=[self.prompts[i] for i in idx.tolist()],
            responses=self.responses[idx],
            response_mask=self.response_mask[idx],
            tensors={k: v[idx] for k, v in self.tensors.items()},
            lengths=None if self.lengths is None else self.lengths[idx],
        )

    def shard(self, dp_rank: int, dp_size: int) -> TrainBatch:
        """Contiguous data-parallel shard: the controller's batch order is kept, concatenation undoes it."""
        if self.size % dp_size:
            raise ValueError(f"batch of {self.size} samples does not split over dp={dp_size} ranks")
        per = self.size // dp_size
        return self.select(list(range(dp_rank * per, (dp_rank + 1) * per)))

    def chunks(self, num: int) -> list[TrainBatch]:
        """Split into `num` equal consecutive parts (mini-batches)."""
        if self.size % num:
            raise ValueError(f"batch of {self.size} samples does not split into {num} mini-batches")
        per = self.size // num
        return [self.select(list(range(i * per, (i + 1) * per))) for i in range(num)]


@dataclass
class MicroBatch:
    """One model input: sequences [b, T] and where each response token's logprob is read."""

    tokens: torch.Tensor  # [b, T]
    position_ids: torch.Tensor  # [b, T]
    targets: torch.Tensor  # [b, T]: tokens shifted left (the token predicted at each position)
    gather_index: torch.Tensor  # [b, R]: position whose output predicts response token j
    response_mask: torch.Tensor  # [b, R]
    tensors: dict[str, torch.Tensor]
    #: packed (THD) micro-batches only: cu_seqlens, max_seqlen, rows (actor/packing.py)
    packed_seq: dict | None = None

    def to(self, device: torch.device | str) -> MicroBatch:
        """This micro-batch on `device` (the rank's GPU on CUDA runs), every tensor field and loss input moved."""
        return MicroBatch(
            *(t.to(device, non_blocking=True) for t in (self.tokens, self.position_ids, self.targets)),
            self.gather_index.to(device, non_blocking=True),
            self.response_mask.to(device, non_blocking=True),
            {k: v.to(device, non_blocking=True) for k, v in self.tensors.items()},
            None
            if self.packed_seq is None
            else {**self.packed_seq, "cu_seqlens": self.packed_seq["cu_seqlens"].to(device)},
        )


def sequence_length(batch: TrainBatch) -> int:
    """Longest prompt + response of the batch, + 1 (a target for the last real token)."""
    return max(len(p) + int(r) for p, r in zip(batch.prompts, batch.response_lengths().tolist())) + 1


def micro_batches(
    batch: TrainBatch,
    micro_batch_size: int,
    pad_multiple: int = 1,
    max_tokens: int | None = None,
    min_seq_len: int = 0,
    device: torch.device | str | None = None,
) -> tuple[list[MicroBatch], int]:
    """Cut a batch into micro-batches padded to one common length (a multiple of pad_multiple, e.g. tp for SP).

    One length for all micro-batches of a schedule call: pipeline stages exchange fixed-shape activations. With a token
    budget, a micro-batch holds at most max(1, max_tokens // length) samples (and never more than micro_batch_size), so
    long rollouts split into smaller micro-batches instead of running out of memory. `min_seq_len`: pad at least to
    this (the whole batch's `sequence_length` when each data-parallel rank cuts its own shard: expert parallelism's
    all-gather dispatcher needs one shape on every rank, and multi-turn responses vary in length). `device`: where
    the micro-batches go (the rank's GPU on CUDA runs: the batch arrives from the driver in host memory); built on the
    CPU either way, where the index arithmetic is cheap.
    """
    response_lengths = batch.response_lengths().tolist()
    seq_len = max(sequence_length(batch), min_seq_len)
    seq_len = -(-seq_len // pad_multiple) * pad_multiple
    if max_tokens:
        micro_batch_size = max(1, min(micro_batch_size, max_tokens // seq_len))
    R = batch.responses.shape[1]
    steps = torch.arange(R)
    out = []
    for start in range(0, batch.size, micro_batch_size):
        part = batch.select(list(range(start, min(start + micro_batch_size, batch.size))))
        # Whole-tensor ops, not a loop of small ones per sample (64 samples: 2.4 ms -> 0.3 ms per call)
        tokens = torch.tensor([prompt + [0] * (seq_len - len(prompt)) for prompt in part.prompts], dtype=torch.long)
        prompt_len = torch.tensor([len(prompt) for prompt in part.prompts], dtype=torch.long)[:, None]
        lengths = torch.tensor(response_lengths[start : start + part.size], dtype=torch.long)[:, None]
        # response token j of sample i sits at prompt_len + j; past its length nothing is written (index clamped to
        # the last position, which sequence_length leaves as padding, and the value 0)
        at = (prompt_len + steps).clamp(max=seq_len - 1)
        tokens.scatter_(1, at, torch.where(steps < lengths, part.responses.long(), 0))
        gather = (prompt_len - 1 + steps).clamp(max=seq_len - 1)
        targets = torch.roll(tokens, shifts=-1, dims=1)
        targets[:, -1] = 0
        positions = torch.arange(seq_len).expand(part.size, seq_len).contiguous()
        mb = MicroBatch(tokens, positions, targets, gather, part.response_mask, part.tensors)
        out.append(mb if device is None else mb.to(device))
    return out, seq_len


def balanced_shard(batch: TrainBatch, dp_rank: int, dp_size: int) -> TrainBatch:
    """This rank's data-parallel shard with the batch's tokens spread evenly: samples sorted by length (longest first)
    are dealt to the ranks in snake order (0..dp-1, dp-1..0, ...), so the n samples of one prompt, which sit next to
    each other in the controller's order and often have similar lengths, do not all land on one rank. Every rank gets
    the same number of samples (as `shard`). For the update only: its results are sums, not per-sample outputs."""
    if batch.size % dp_size:
        raise ValueError(f"batch of {batch.size} samples does not split over dp={dp_size} ranks")
    lengths = torch.tensor([len(p) for p in batch.prompts]) + batch.response_lengths()
    order = sorted(range(batch.size), key=lambda i: (-int(lengths[i]), i))  # deterministic on every rank
    mine = [i for k, i in enumerate(order) if _snake(k, dp_size) == dp_rank]
    return batch.select(mine)


def _snake(k: int, n: int) -> int:
    lap, pos = divmod(k, n)
    return pos if lap % 2 == 0 else n - 1 - pos


def dynamic_micro_batches(
    batch: TrainBatch, micro_batch_size: int, pad_multiple: int = 1, max_tokens: int | None = None,
    device: torch.device | str | None = None,
) -> list[MicroBatch]:  # fmt: skip
    """Micro-batches by real length: samples sorted by length, each micro-batch padded only to its own longest
    sample (a multiple of pad_multiple) and, with a token budget, holding as many samples as fit in `max_tokens`
    (padded length x samples; at most micro_batch_size, at least one). Needs a schedule that accepts a different
    shape per micro-batch (variable_seq_lengths on CUDA, or no pipeline and no expert parallelism); the order of the
    samples is not kept (for the update, whose results are sums)."""
    lengths = [len(p) + int(r) for p, r in zip(batch.prompts, batch.response_lengths().tolist())]
    order = sorted(range(batch.size), key=lambda i: (lengths[i], i))
    out, start = [], 0
    while start < batch.size:
        count = 1
        while start + count < batch.size and count < micro_batch_size:
            longest = -(-(lengths[order[start + count]] + 1) // pad_multiple) * pad_multiple
            if max_tokens and longest * (count + 1) > max_tokens:
                break
            count += 1
        part = batch.select(order[start : start + count])
        (mb,), _ = micro_batches(part, count, pad_multiple, device=device)
        out.append(mb)
        start += count
    return out
