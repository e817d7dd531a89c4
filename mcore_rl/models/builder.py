"""Build a family's Megatron GPT model for this rank: one chunk per virtual pipeline stage, with shard contexts.

    chunks, contexts = build_gpt_chunks(spec, pg_collection)

Every rank builds only its own stage(s) and shards; `ShardContext`s tell the weight-map machinery where each chunk sits
(TP/ETP/EP ranks, the global index of its first layer, which ranks emit tensors on export).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mcore_rl.models.base import HFConfig, ModelFamily, padded_vocab_size
from mcore_rl.models.registry import get_family
from mcore_rl.models.spec import decoder_block_spec, mtp_block_spec
from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.resharding.weight_map import ShardContext, WeightMap


@dataclass
class ModelSpec:
    """Everything needed to build one Megatron model from an HF config."""

    hf: HFConfig
    layout: ParallelLayout
    runtime: str = "cpu"
    dtype: torch.dtype = torch.float32
    make_vocab_size_divisible_by: int = 128
    max_sequence_length: int = 4096
    config_overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def family(self) -> ModelFamily:
        return get_family(self.hf.model_type)

    @property
    def padded_vocab(self) -> int:
        return padded_vocab_size(self.hf.req("vocab_size"), self.make_vocab_size_divisible_by, self.layout.tp)

    def transformer_config(self) -> Any:
        return self.family.transformer_config(self.hf, self.layout, self.runtime, self.dtype, **self.config_overrides)

    def weight_map(self) -> WeightMap:
        return self.family.weight_map(self.hf, self.padded_vocab)


class _AllOnMeta(TorchFunctionMode):
    """Sends every tensor factory and move to the meta device, whatever device the caller names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if kwargs.get("device") is not None:
            kwargs = dict(kwargs, device="meta")
        if func is torch.Tensor.to and args[1:] and isinstance(args[1], (str, torch.device, int)):
            args = (args[0], "meta", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta_device() -> Iterator[None]:
    """Build modules without memory: shapes, names and sharding metadata only (a 671B model builds in seconds).

    Megatron allocates with explicit devices (`device=torch.cuda.current_device()`, `.cuda()`), which the default-device
    context alone does not catch; the mode rewrites them too.
    """
    with torch.device("meta"), _AllOnMeta():
        yield


def build_gpt_chunks(
    spec: ModelSpec, pg_collection: Any, meta: bool = False
) -> tuple[list[torch.nn.Module], list[ShardContext]]:
    """Build this rank's GPTModel chunk(s) (one per virtual stage) and their shard contexts.

    `meta=True` builds on the meta device (see `on_meta_device`): for planning checkpoints, never for running.
    """
    if meta:
        with on_meta_device():
            return build_gpt_chunks(spec, pg_collection)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = spec.transformer_config()
    rope = spec.family.rope(spec.hf)
    layout = spec.layout
    spec.layout.validate(torch.distributed.get_world_size(), spec.family.shape(spec.hf))
    pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
    vpp = layout.virtual_stages
    tied = bool(spec.hf.get("tie_word_embeddings", False))
    num_experts = config.num_moe_experts or 0
    ep_size = pg_collection.ep.size()
    chunks, contexts = [], []
    for vstage in range(vpp):
        vp_stage = vstage if vpp > 1 else None
        pre = pp_rank == 0 and vstage == 0
        post = pp_rank == pp_size - 1 and vstage == vpp - 1
        block_spec = decoder_block_spec(config, spec.runtime, vp_stage=vp_stage, pp_rank=pp_rank)
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec,
            vocab_size=spec.padded_vocab,
            max_sequence_length=spec.max_sequence_length,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=tied,
            # rope / linear / llama3 / yarn for GQA families; MLA builds its own rotary embedding from the config.
            **rope.gpt_model_arguments(config),
            mtp_block_spec=mtp_block_spec(config, block_spec, spec.runtime, vp_stage=vp_stage, pp_rank=pp_rank),
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
        rope.fit_rotary(model)  # llama3: the checkpoint's four values, which GPTModel's arguments cannot carry
        contexts.append(
            ShardContext(
                tp_rank=pg_collection.tp.rank(),
                tp_size=pg_collection.tp.size(),
                etp_rank=pg_collection.expt_tp.rank(),
                etp_size=pg_collection.expt_tp.size(),
                ep_rank=pg_collection.ep.rank(),
                num_local_experts=num_experts // ep_size if num_experts else 0,
                layer_offset=get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank),
                owns_dense=pg_collection.tp.rank() == 0
                and pg_collection.cp.rank() == 0
                and pg_collection.dp.rank() == 0,
                owns_experts=pg_collection.expt_tp.rank() == 0 and pg_collection.expt_dp.rank() == 0,
            )
        )
        chunks.append(model)
    return chunks, contexts
