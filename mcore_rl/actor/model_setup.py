"""How a Megatron worker's model is set up from the run's config: the HF config it builds from, the TransformerConfig
fields the worker's settings add, and the HF checkpoint it loads.

    config, unread = hf_config_dict(model_cfg)          # the HF config dict; checkpoint prefixes left unread (MTP)
    overrides = megatron_overrides(actor_cfg, routing)   # TransformerConfig fields on top of the family's translation
    load_hf(actor, path)                                 # the checkpoint into the rank's chunks (FP8 dequantised)
"""

from __future__ import annotations

import logging
from typing import Any

from mcore_rl.config import ModelConfig
from mcore_rl.resharding.weight_map import WeightMapError, load_hf_weights

log = logging.getLogger(__name__)


def megatron_overrides(cfg: Any, routing_mode: str) -> dict[str, Any]:
    """TransformerConfig fields the worker's config sets on top of the family's translation: routing replay, the expert
    bias update rate (DeepSeek-V3's aux-loss-free balancing; frozen by default in RL), activation recompute, the MoE
    dispatcher and permute fusion."""
    out: dict[str, Any] = {"moe_enable_routing_replay": True} if routing_mode != "disabled" else {}
    rate = getattr(cfg, "router_bias_update_rate", 0.0)
    if rate:
        out["moe_router_bias_update_rate"] = rate
    recompute = getattr(cfg, "recompute", None)
    if recompute is not None:
        out.update(recompute.megatron_fields())
    dispatcher = getattr(cfg, "moe_dispatcher", None)
    if dispatcher == "flex":  # DeepEP's kernels behind Megatron's flex dispatcher
        out.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    elif dispatcher:
        out["moe_token_dispatcher_type"] = dispatcher
    if getattr(cfg, "moe_permute_fusion", False):
        out["moe_permute_fusion"] = True
    return out


def hf_config_dict(model_cfg: ModelConfig, announce: bool = False) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(HF config the worker builds from, HF name prefixes of the checkpoint it does not read).

    Multi-token-prediction layers are off in RL: Megatron 0.16.1 computes MTP's loss inside the forward from `labels`
    (it clones them) and returns a loss instead of logits when given labels, so a logprob forward cannot run with MTP
    built; its tensors are left unread, and the engines keep the MTP weights they loaded (SGLang's speculative draft).
    """
    from mcore_rl.models.registry import checkpoint_config, get_family

    if model_cfg.path:
        config, note, unread = checkpoint_config(model_cfg.path, "off")
    else:
        raw = dict(model_cfg.hf_config)
        config, note, unread = get_family(raw.get("model_type", "<missing>")).resolve_mtp(raw, set(), "off")
    if note and announce:
        log.warning("%s; the RL workers do not train MTP layers (the engines keep theirs as loaded)", note)
    return config, unread


def load_hf(actor: Any, path: str) -> None:
    """Load the HF checkpoint at `path` into `actor`'s chunks (this rank's shards); WeightMapError naming the tensors
    the family's weight map does not know."""
    from mcore_rl.resharding.hf_io import HFCheckpointReader, fp8_aware_reader, fp8_block_size

    reader = HFCheckpointReader(path)
    # FP8 releases (DeepSeek-V3) are dequantised on load with their weight_scale_inv, never copied raw.
    fp8 = fp8_block_size(reader.config) is not None
    load_hf_weights(actor.chunks, actor.contexts, actor.weight_map, fp8_aware_reader(reader))
    shape = actor.spec.family.shape(actor.spec.hf)
    unread = actor._unread  # MTP layers: held by the checkpoint, not built for RL (see hf_config_dict)
    unexpected = [
        n
        for n in reader.names()
        if not (fp8 and n.endswith("_scale_inv"))
        and not (unread and n.startswith(unread))
        and not actor.weight_map.is_known_hf(n, shape.num_layers, shape.num_experts)
    ]
    if unexpected:
        raise WeightMapError(
            f"{path}: unexpected tensors not in the {actor.spec.hf.model_type} weight map: "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
