"""The values of a model's HF config (model.path's config.json, or model.hf_config): sizes are integers and numbers
are numbers. A pure check of the config layer (config/validate.py's check_model runs it before the layout check): it
reads the one file check_model reads and nothing above the config layer."""

from __future__ import annotations

import json
import os
from typing import Any

from mcore_rl.config.checks import ConfigError

#: HF config fields that are sizes or counts (null allowed: a family's default) and fields that are numbers
_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "n_routed_experts",
    "n_shared_experts",
    "shared_expert_intermediate_size",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "first_k_dense_replace",
    "decoder_sparse_step",
    "n_group",
    "topk_group",
    "num_nextn_predict_layers",
)
_NUMBER_FIELDS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "initializer_range")


def check_hf_config_values(cfg: Any) -> None:
    """The model's HF config (model.path's config.json, else model.hf_config) holds integers where sizes go and
    numbers where floats go: a quoted "64" is refused naming the field and the file, not met as a TypeError later."""
    if cfg.model.path:
        where = os.path.join(cfg.model.path, "config.json")
        try:
            with open(where) as f:
                hf = json.load(f)
        except (OSError, ValueError):
            return  # named by the config's own check and the checkpoint check
        prefix = f"{where}: field"
    else:
        hf, prefix = dict(cfg.model.hf_config), "model.hf_config."
    if not isinstance(hf, dict):
        return
    for key in _INT_FIELDS + _NUMBER_FIELDS:
        value = hf.get(key)
        if value is None:
            continue
        integer = key in _INT_FIELDS
        ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        if not ok or isinstance(value, bool):
            sep = " " if cfg.model.path else ""
            raise ConfigError(
                f"{prefix}{sep}{key} is {value!r} ({type(value).__name__}); expected "
                f"{'an integer' if integer else 'a number'} (without quotes)"
            )
