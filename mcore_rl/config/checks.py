"""What every config group validates with: ConfigError, whose message names the field and the expected value, and
the small checks that raise it."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and what was expected."""


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: expected {expected}")


def _positive(name: str, value: Any) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, value, "a positive integer")
