"""Rollout: the embedded transformers engine, its SGLang-compatible HTTP server, the one client for it and real
SGLang, sglang-router, and the launcher of real SGLang servers on GPUs.

The names below are imported on first use: config validation and the agent's tools import `mcore_rl.rollout.agent`,
and must not pay for transformers (importing the engine takes seconds, in every CLI call that only checks a config).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HFRolloutEngine": "engine",
    "HF_NAME_RULES": "hf_names",
    "FusedExpertRule": "hf_names",
    "HFNameMap": "hf_names",
    "Sample": "sampling",
    "sample_rows": "sampling",
    "top_p_filter": "sampling",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
