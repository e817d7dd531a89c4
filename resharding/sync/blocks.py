"""A bucket's packing as one block-copy table (kernels/block_copy.py), traced from the transforms themselves.

The gathered buffer of a bucket holds, rank after rank, each rank's shard bytes of the bucket's sharded tensors.
Instead of running each transform (`to_hf`: QKV split per query group, GLU halves, vocab trim, joins along dim 0 or
1) on tensors and copying the results, the plan runs it once on *index* tensors: shards whose elements are their own
byte offsets in the gathered buffer. The outputs then say, element by element, where each HF byte comes from; runs
of consecutive bytes become 2D blocks, rows with the same run pattern and a constant source stride merge into one
block. At sync time one `copy_blocks` call (one Triton launch on GPU) writes every sharded tensor of the bucket
straight into its HF place in the bucket buffer, with no intermediate tensor.

Tracing costs one int64 index tensor per output of the traced tensor, once per plan (not per sync).
"""

from __future__ import annotations

import torch

from mcore_rl.resharding.transforms import Transform


def trace_outputs(
    transform: Transform, shard_shape: tuple[int, ...], itemsize: int, shard_offsets: list[int]
) -> list[torch.Tensor]:
    """The transform's outputs on index shards: element i of output k holds the gathered-buffer byte offset of the
    element it comes from (shard g's bytes start at `shard_offsets[g]`)."""
    numel = 1
    for d in shard_shape:
        numel *= d
    shards = [(torch.arange(numel, dtype=torch.int64) * itemsize + base).view(shard_shape) for base in shard_offsets]
    return [out.contiguous() for out in transform.to_hf(shards)]


def blocks_of(index: torch.Tensor, itemsize: int, dst: int) -> list[tuple[int, int, int, int, int, int]]:
    """Blocks (src_offset, src_stride, dst_offset, dst_stride, rows, cols), in bytes, writing the output traced as
    `index` at byte `dst` of the bucket."""
    return _blocks_of(index, itemsize, dst)


def _blocks_of(index: torch.Tensor, itemsize: int, dst: int) -> list[tuple[int, int, int, int, int, int]]:
    """2D blocks of one output whose element i (row-major) comes from byte `index[i]`."""
    rows = index.shape[0] if index.dim() > 1 else 1
    flat = index.reshape(rows, -1)
    cols = flat.shape[1]
    if cols == 0:
        return []
    # run starts in each row: where the next element is not the next one in the source
    breaks = torch.ones(rows, cols, dtype=torch.bool)
    breaks[:, 1:] = (flat[:, 1:] - flat[:, :-1]) != itemsize
    pattern = breaks[0]
    if bool((breaks == pattern).all()):  # every row has the same runs: merge rows per run
        starts = pattern.nonzero().flatten().tolist() + [cols]
        out = []
        for a, b in zip(starts, starts[1:]):
            out += _merge_rows(flat[:, a], dst + a * itemsize, cols * itemsize, (b - a) * itemsize)
        return out
    out = []  # irregular rows: one block per run
    for r in range(rows):
        starts = breaks[r].nonzero().flatten().tolist() + [cols]
        for a, b in zip(starts, starts[1:]):
            out.append((int(flat[r, a]), 0, dst + (r * cols + a) * itemsize, 0, 1, (b - a) * itemsize))
    return out


def _merge_rows(src_starts: torch.Tensor, dst: int, dst_stride: int, width: int) -> list[tuple[int, ...]]:
    """Consecutive rows whose source starts advance by a constant stride become one block (greedy)."""
    starts = src_starts.tolist()
    n, out, i = len(starts), [], 0
    while i < n:
        j = i
        stride = starts[i + 1] - starts[i] if i + 1 < n else 0
        while j + 1 < n and starts[j + 1] - starts[j] == stride:
            j += 1
        out.append((starts[i], stride if j > i else 0, dst + i * dst_stride, dst_stride, j - i + 1, width))
        i = j + 1
    return out
