"""The model-family registry: HF `model_type` -> the family that knows it (models/<family>.py).

A family registers itself with `models.base.register` when its module is imported; this module imports the list of
families and answers lookups. It sits above the families, so no family imports another or the registry.
"""

from __future__ import annotations

from typing import Any

from mcore_rl.models.base import _REGISTRY, HFConfig, ModelFamily, UnsupportedModel


def checkpoint_config(path: str, mtp: str = "auto") -> tuple[dict[str, Any], str | None, tuple[str, ...]]:
    """An HF checkpoint's config.json as the actor builds from it: the family's `resolve_mtp` applied to the tensor
    names its safetensors headers hold (read without loading a tensor). Returns (config, note, unread prefixes)."""
    from mcore_rl.resharding.hf_io import HFCheckpointReader

    with HFCheckpointReader(path) as reader:
        config, names = dict(reader.config), set(reader.names())
    return get_family(HFConfig(config).model_type).resolve_mtp(config, names, mtp)


def supported_model_types() -> list[str]:
    """HF model_type values with a registered family."""
    _import_families()
    return sorted(_REGISTRY)


def get_family(model_type: str) -> ModelFamily:
    """The family for an HF model_type; UnsupportedModel lists the supported ones."""
    _import_families()
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise UnsupportedModel(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(_REGISTRY))}"
        ) from None


def _import_families() -> None:
    # Importing a family module registers it. Listed explicitly: the registry is keyed by model_type, and the set of
    # families is a decision, not a directory scan.
    from mcore_rl.models import deepseek_v3, llama, qwen2, qwen3, qwen3_moe  # noqa: F401
