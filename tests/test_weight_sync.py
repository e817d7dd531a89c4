"""Weight sync, first version: Megatron ranks export HF-named tensors, the rollout engine loads them, logits agree.

EP2 on 2 gloo ranks: each rank emits the experts it owns, rank 0 the dense tensors; the union is the whole model,
each tensor once, under the names of HF safetensors files. Random init with a wide std keeps router top-k margins far
above fp32 rounding, so routing cannot flip between the two implementations.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _parity import DEEPSEEK_TINY
from tiny_models import tiny_qwen3_moe

from mcore_rl.parallel.harness import run_on_ranks

CONFIGS = {
    "qwen3_moe": tiny_qwen3_moe(vocab_size=70, initializer_range=0.5, max_position_embeddings=64),
    # The router's e_score_correction_bias is a buffer in transformers and travels like a weight. Without MTP: the
    # actor's forward with MTP layers needs labels (Megatron 0.16's GPTModel), see test_rollout_engine for MTP names.
    "deepseek_v3": dict(DEEPSEEK_TINY, model_type="deepseek_v3", initializer_range=0.5, num_nextn_predict_layers=0),
}


def _sync_rank(rank: int, world: int, family: str, layout_kwargs: dict, ids: torch.Tensor):
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig
    from mcore_rl.rollout import HFRolloutEngine

    actor = MegatronActor(
        rank,
        world,
        ModelConfig(hf_config=CONFIGS[family]),
        ActorConfig(world_size=world, layout=LayoutConfig(**layout_kwargs), use_ref=False),
    )
    actor.initialize("127.0.0.1", 0)  # the harness already started torch.distributed
    named = actor.export_hf()
    parts = [None] * world
    dist.all_gather_object(parts, named)
    logits = actor.forward_logits(ids)
    held = [None] * world
    dist.all_gather_object(held, (logits.dp_rank, logits.payload) if logits.holds_output else None)
    if rank != 0:
        return None
    all_named = [item for part in parts for item in part]
    megatron = torch.cat([p for _, p in sorted(h for h in held if h is not None)])
    engine = HFRolloutEngine(dict(CONFIGS[family]))
    version = engine.update_weights_from_tensors(all_named)
    with torch.no_grad():
        engine_logits = engine.model(ids).logits
    return [n for n, _ in all_named], version, megatron, engine_logits, sorted(engine.state_dict_hf())


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_engine_logits_equal_megatron_after_sync(family: str):
    ids = torch.randint(0, CONFIGS[family]["vocab_size"], (2, 10))
    names, version, megatron, engine, expected = run_on_ranks(_sync_rank, 2, (family, dict(ep=2), ids))[0]
    assert len(names) == len(set(names)), "a tensor was exported twice"
    assert sorted(names) == expected, "export must cover exactly the engine's HF checkpoint names"
    assert version == 1
    assert megatron.shape == engine.shape
    assert (megatron - engine).abs().max().item() <= 1e-4
