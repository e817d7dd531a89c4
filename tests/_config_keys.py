"""Set dotted config keys (`"sync.transport"`) on an RLConfig in place, as a command's overrides would, without the
validation a composed command runs (tests that check what a later stage refuses)."""

from __future__ import annotations

from typing import Any


def set_keys(cfg: Any, given: dict[str, Any]) -> Any:
    """`cfg` with every `dotted.key: value` of `given` set; returns `cfg`."""
    for key, value in given.items():
        *path, leaf = key.split(".")
        target = cfg
        for part in path:
            target = getattr(target, part)
        setattr(target, leaf, value)
    return cfg
