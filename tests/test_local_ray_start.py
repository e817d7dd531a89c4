"""The local Ray a run starts (controller/placement.py init_ray) takes LOCAL_RAY_SYSTEM_CONFIG, which this Ray release
accepts; a run joining a cluster (trainer.ray_address) passes none (ray.init refuses system settings when it connects:
a cluster's are its head's)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from mcore_rl.config import RLConfig  # noqa: E402
from mcore_rl.controller import placement  # noqa: E402


def _init_kwargs(monkeypatch, address: str | None) -> dict:
    seen: dict = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr("mcore_rl.watchdog.reclaim_sigterm", lambda: None)
    cfg = RLConfig()
    cfg.trainer.ray_address = address
    placement.init_ray(cfg)
    return seen


def test_a_local_start_passes_the_local_settings(monkeypatch) -> None:
    kwargs = _init_kwargs(monkeypatch, None)
    assert kwargs["address"] == "local" and kwargs["_system_config"] == placement.LOCAL_RAY_SYSTEM_CONFIG


def test_joining_a_cluster_passes_no_system_settings(monkeypatch) -> None:
    kwargs = _init_kwargs(monkeypatch, "10.0.0.1:6379")
    assert kwargs["address"] == "10.0.0.1:6379" and "_system_config" not in kwargs


def test_ray_starts_with_the_local_settings_and_runs_an_actor() -> None:
    """An unknown or mistyped setting would stop Ray's own processes from starting (this release's names)."""
    cfg = RLConfig()
    cfg.trainer.ray_num_cpus = 2
    placement.init_ray(cfg)
    try:

        @ray.remote(num_cpus=1)
        class Echo:
            def echo(self, x: int) -> int:
                return x

        assert ray.get(Echo.remote().echo.remote(7), timeout=120) == 7
    finally:
        ray.shutdown()
