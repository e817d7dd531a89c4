"""Sequence packing without padding (THD): a micro-batch's sequences end to end in one row, with `cu_seqlens`.

    packed = pack_micro_batch(batch_part, pad_multiple)     # MicroBatch with tokens [1, total] and packed_seq set
    output = model(input_ids=packed.tokens, position_ids=packed.position_ids, attention_mask=None,
                   packed_seq_params=packed_seq_params(packed))          # TE attention keeps sequences apart
    logp   = response_logprobs(logits, packed.targets, packed.gather_index, ...).view(rows, R)

Layout of a micro-batch of n sequences with lengths L_i = prompt_i + response_i:
    tokens      seq 0 | seq 1 | ... | seq n-1 | pad            total = sum L_i + pad (a multiple of pad_multiple)
    cu_seqlens  [0, L_0, L_0 + L_1, ..., sum L_i, total]       int32; the pad is a sequence of its own
    targets     the next token within the same sequence; 0 at each sequence's last position
    gather      response token j of sequence i is predicted at off_i + prompt_i + j - 1, clamped to the sequence's
                last position past its length (masked by response_mask), flattened to [1, n x R]
Position ids restart at 0 in every sequence (Megatron's RoPE reads cu_seqlens for THD; the ids keep the layout honest
for anything that reads them).

Only Transformer Engine's attention separates packed sequences (`qkv_format="thd"`): pre-flight refuses
actor.packing without TE. On CPU the packing, offsets and gather are tested against the padded path
(tests/test_packing.py) with a causal stand-in model.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_rl.actor.batch import MicroBatch, TrainBatch


def pack_micro_batch(part: TrainBatch, pad_multiple: int = 1, device: torch.device | str | None = None) -> MicroBatch:
    """The samples of `part` packed into one row (see the module docstring); `packed_seq` holds cu_seqlens, the
    longest sequence and the number of rows the gathered values reshape to."""
    response_lengths = part.response_lengths().tolist()
    R = part.responses.shape[1]
    rows, targets, positions, gathers, bounds = [], [], [], [], [0]
    for i, (prompt, length) in enumerate(zip(part.prompts, response_lengths)):
        seq = list(prompt) + part.responses[i, : int(length)].tolist()
        offset = bounds[-1]
        rows.extend(seq)
        targets.extend(seq[1:] + [0])
        positions.extend(range(len(seq)))
        last = offset + len(seq) - 1
        gathers.append((offset + len(prompt) - 1 + torch.arange(R)).clamp(max=last))
        bounds.append(offset + len(seq))
    total = -(-bounds[-1] // pad_multiple) * pad_multiple
    if total > bounds[-1]:  # padding as one more sequence, so no real sequence attends to it
        rows.extend([0] * (total - bounds[-1]))
        targets.extend([0] * (total - bounds[-1]))
        positions.extend(range(total - bounds[-1]))
        bounds.append(total)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    mb = MicroBatch(
        tokens=torch.tensor([rows], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        targets=torch.tensor([targets], dtype=torch.long),
        gather_index=torch.cat(gathers).view(1, -1),
        response_mask=part.response_mask,
        tensors=part.tensors,
    )
    mb.packed_seq = {"cu_seqlens": cu_seqlens, "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
                     "rows": part.size}  # fmt: skip
    return mb if device is None else mb.to(device)


def packed_micro_batches(
    batch: TrainBatch, micro_batch_size: int, pad_multiple: int = 1, max_tokens: int | None = None,
    device: torch.device | str | None = None,
) -> list[MicroBatch]:  # fmt: skip
    """Consecutive samples packed `micro_batch_size` at a time, or fewer where `max_tokens` (real tokens of a packed
    row) is reached first; the batch order is kept (logprobs come back per sample in order)."""
    lengths = [len(p) + int(r) for p, r in zip(batch.prompts, batch.response_lengths().tolist())]
    out, start = [], 0
    while start < batch.size:
        count, tokens = 1, lengths[start]
        while start + count < batch.size and count < micro_batch_size:
            if max_tokens and tokens + lengths[start + count] > max_tokens:
                break
            tokens += lengths[start + count]
            count += 1
        out.append(pack_micro_batch(batch.select(list(range(start, start + count))), pad_multiple, device))
        start += count
    return out


def packed_seq_params(mb: MicroBatch) -> Any:
    """Megatron's PackedSeqParams (THD) for a packed micro-batch."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, longest = mb.packed_seq["cu_seqlens"], mb.packed_seq["max_seqlen"]
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def unpack_rows(mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
    """Values gathered at `mb.gather_index` ([1, n x R] when packed) as [n, R]; unpacked micro-batches as they are."""
    return values.view(mb.packed_seq["rows"], -1) if mb.packed_seq else values
