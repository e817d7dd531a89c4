"""Pre-flight: every data_source of the run's train and validation files has a scorer, checked before anything starts
(a data source without one would otherwise fail the first step that samples it, or the first validation).

Skipped when reward.path names a user function (it decides what it scores) and for DPO (pairs, no rule reward per
data source in the files). Data sources known to have no scorer here are named with why (pre-flight passes verl's:
compat/verl/shim.py WITHOUT_SCORER).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from mcore_rl.config import ConfigError


def data_sources(path: str) -> set[str]:
    """The distinct values of a parquet file's data_source column (only that column is read)."""
    import pyarrow.parquet as pq

    if "data_source" not in pq.read_schema(path).names:
        return set()  # data/dataset.py refuses the file with its own message
    return set(pq.read_table(path, columns=["data_source"]).column("data_source").to_pylist())


def check_data_sources(cfg: Any, without_scorer: Mapping[str, str] | None = None) -> None:
    """ConfigError listing every data source (and its files) without a built-in scorer, all at once.

    `without_scorer` maps data_source prefixes known to have no scorer here to why (named in the error).
    """
    from mcore_rl.reward.loader import BUILTIN_PREFIXES, BUILTIN_REWARDS, builtin_reward

    if cfg.reward.path or cfg.trainer.mode == "dpo":
        return
    missing: dict[str, list[str]] = {}
    for group in ("train_files", "val_files"):
        for path in getattr(cfg.data, group):
            if not os.path.isfile(path):
                raise ConfigError(f"data.{group}: {path!r} does not exist; expected a parquet file in verl's schema")
            for source in data_sources(path):
                if builtin_reward(source) is None:
                    missing.setdefault(source, []).append(path)
    if not missing:
        return
    lines = []
    for source, paths in sorted(missing.items()):
        why = next((w for k, w in (without_scorer or {}).items() if source.startswith(k)), "no built-in scorer")
        lines.append(f"data_source={source!r} in {paths}: {why}")
    raise ConfigError(
        "no reward for these data sources: " + "; ".join(lines) + f". Expected one of {sorted(BUILTIN_REWARDS)} or "
        f"{[p + '*' for p in BUILTIN_PREFIXES]}, or reward.path (verl's custom_reward_function.path) naming a "
        "function that scores them"
    )
