"""Layout transforms between HF tensors and Megatron shards.

Each transform converts in both directions:

    to_megatron(hf_tensors, shard, num_shards) -> the Megatron shard held by one rank
    to_hf(shards)                              -> the HF tensors, from every rank's shard (in shard order)

`shard`/`num_shards` are the rank and size of the axis the weight is split along (tp for dense weights, etp for
expert weights, 1 when replicated). Working on the list of shards rather than a concatenation matters: a GLU fc1
shard is [gate_i; up_i], so the gathered tensor is [g0; u0; g1; u1], not [gate; up].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class Transform:
    """Base class: a pure function pair between HF tensors and Megatron shards."""

    #: which mesh axis the Megatron tensor is split along: "tp", "etp" or None (replicated)
    axis: str | None = None
    #: how many HF tensors this Megatron tensor is made of
    num_hf: int = 1

    def axis_for(self, local_shape: torch.Size) -> str | None:
        """The axis a Megatron tensor of `local_shape` is split along on this rank (most transforms: `axis`).

        A transform whose layout depends on the module class (e.g. MLA's down projections: column-parallel in the
        local spec, replicated in Transformer Engine's) decides from the local shape.
        """
        return self.axis

    def to_megatron(self, hf: list[torch.Tensor], shard: int, num_shards: int) -> torch.Tensor:
        raise NotImplementedError

    def to_hf(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError


def _chunk(t: torch.Tensor, dim: int, shard: int, num_shards: int) -> torch.Tensor:
    if t.shape[dim] % num_shards:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} is not divisible by {num_shards} shards")
    return t.chunk(num_shards, dim=dim)[shard]


def _join(shards: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Shards joined along `dim`; one shard is returned as it is (a converter exporting whole tensors would otherwise
    copy every tensor once more, and on meta tensors torch.cat runs a Python decomposition of ~100 us)."""
    return shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)


@dataclass
class Replicated(Transform):
    """The same tensor on every rank (norms, router, biases of row-parallel layers)."""

    axis: str | None = None

    def to_megatron(self, hf, shard, num_shards):
        return hf[0]

    def to_hf(self, shards):
        return [shards[0]]


@dataclass
class Split(Transform):
    """Split along `dim`: 0 for column-parallel (output features), 1 for row-parallel (input features)."""

    dim: int = 0
    axis: str | None = "tp"

    def to_megatron(self, hf, shard, num_shards):
        return _chunk(hf[0], self.dim, shard, num_shards)

    def to_hf(self, shards):
        return [_join(shards, self.dim)]


@dataclass
class VocabSplit(Transform):
    """Embedding or output layer: rows padded to `padded_vocab` (zeros), split along dim 0, trimmed on export.

    Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x tp. Padded rows are zero; logprob
    code masks their logits (see actor/logprobs.py), because a zero logit still enters the softmax.
    """

    vocab_size: int = 0
    padded_vocab: int = 0
    axis: str | None = "tp"

    def to_megatron(self, hf, shard, num_shards):
        full = hf[0]
        if full.shape[0] != self.vocab_size:
            raise ValueError(f"vocabulary tensor has {full.shape[0]} rows, config says vocab_size={self.vocab_size}")
        if self.padded_vocab > self.vocab_size:
            pad = full.new_zeros(self.padded_vocab - self.vocab_size, *full.shape[1:])
            full = torch.cat([full, pad], dim=0)
        return _chunk(full, 0, shard, num_shards)

    def to_hf(self, shards):
        return [_join(shards)[: self.vocab_size]]


@dataclass
class FusedColumns(Transform):
    """Several HF column-parallel weights fused along dim 0 per shard: GLU [gate; up] or an unfused-KV pair.

    Each HF tensor is split into `num_shards` pieces; shard i is cat(piece_i of each). `sizes` are the HF row counts.
    """

    num_hf: int = 2
    axis: str | None = "tp"

    def to_megatron(self, hf, shard, num_shards):
        if len(hf) != self.num_hf:
            raise ValueError(f"expected {self.num_hf} tensors to fuse, got {len(hf)}")
        return torch.cat([_chunk(t, 0, shard, num_shards) for t in hf], dim=0)

    def to_hf(self, shards):
        parts: list[list[torch.Tensor]] = [[] for _ in range(self.num_hf)]
        for piece in shards:
            for i, sub in enumerate(piece.chunk(self.num_hf, dim=0)):
                parts[i].append(sub)
        return [_join(p) for p in parts]


@dataclass
class QKV(Transform):
    """Megatron's fused QKV: per query group [q heads of the group; k; v], groups split across TP.

    HF holds q_proj [heads*d, h], k_proj and v_proj [groups*d, h] (or 1-D biases). Megatron's linear_qkv has, for each
    of the `num_query_groups` groups, the group's heads/groups query heads, then its key head, then its value head.
    """

    num_heads: int = 0
    num_query_groups: int = 0
    head_dim: int = 0
    num_hf: int = 3
    axis: str | None = "tp"

    def _interleave(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups, per_group, d = self.num_query_groups, self.num_heads // self.num_query_groups, self.head_dim
        rest = q.shape[1:]
        q = q.reshape(groups, per_group * d, *rest)
        k = k.reshape(groups, d, *rest)
        v = v.reshape(groups, d, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    def to_megatron(self, hf, shard, num_shards):
        q, k, v = hf
        expect_q, expect_kv = self.num_heads * self.head_dim, self.num_query_groups * self.head_dim
        if q.shape[0] != expect_q or k.shape[0] != expect_kv or v.shape[0] != expect_kv:
            raise ValueError(
                f"QKV shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} disagree with heads="
                f"{self.num_heads}, query groups={self.num_query_groups}, head_dim={self.head_dim}"
            )
        # Groups are contiguous in the interleaved tensor, so a TP shard is a contiguous block of whole groups.
        return _chunk(self._interleave(q, k, v), 0, shard, num_shards)

    def to_hf(self, shards):
        full = _join(shards)
        groups, per_group, d = self.num_query_groups, self.num_heads // self.num_query_groups, self.head_dim
        rest = full.shape[1:]
        grouped = full.reshape(groups, (per_group + 2) * d, *rest)
        q, k, v = grouped.split([per_group * d, d, d], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
