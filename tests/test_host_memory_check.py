"""Pre-flight refuses a CPU run whose estimated host memory exceeds what the host has available, before Ray or any
engine starts (mcore_rl/preflight.py check_host_memory; the parts: controller/memory_estimate.py host_memory_parts).

The available figure is a parameter of the check, so these tests do not depend on this machine's free memory (other
tests run beside them and change it); the end-to-end test makes the estimate larger than any machine's memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.checkpoint.manager import hf_config_of
from mcore_rl.config import ConfigError
from mcore_rl.controller.memory_estimate import actor_estimate, host_memory_parts
from mcore_rl.controller.recipe_check import compose_recipe
from mcore_rl.preflight import check_host_memory, host_available_bytes

REPO = Path(__file__).resolve().parent.parent
GIB = 1024**3


def _total(cfg) -> float:
    return sum(nbytes for _, nbytes in host_memory_parts(cfg, hf_config_of(cfg)))


def test_a_run_that_does_not_fit_is_refused_naming_each_part_the_total_and_what_is_available() -> None:
    cfg = compose_recipe("default")
    total = _total(cfg)
    check_host_memory(cfg, (int(total) + 1, "a test's figure"))  # fits: nothing raised
    with pytest.raises(ConfigError) as err:
        check_host_memory(cfg, (int(total) - 1, "a test's figure"))
    message = str(err.value)
    assert message.startswith(f"host memory: the run needs an estimated {total / GIB:.2f} GiB")
    assert "actor 2 ranks x " in message and "engines 1 x " in message and "critic" not in message
    assert f"total {total / GIB:.2f} GiB x trainer.host_memory_margin=1" in message
    assert f"this host has {(int(total) - 1) / GIB:.2f} GiB available (a test's figure)" in message
    assert "actor.micro_batch_size" in message and "trainer.host_memory_check=false" in message


def test_the_margin_scales_the_estimate() -> None:
    cfg = compose_recipe("default", ["trainer.host_memory_margin=2"])
    total = _total(cfg)
    with pytest.raises(ConfigError, match=r"x trainer.host_memory_margin=2\)"):
        check_host_memory(cfg, (int(1.5 * total), "a test's figure"))
    lenient = compose_recipe("default", ["trainer.host_memory_margin=0.5"])
    check_host_memory(lenient, (int(0.6 * total), "a test's figure"))
    with pytest.raises(ConfigError, match=r"trainer.host_memory_margin=0.0 is invalid: expected > 0"):
        compose_recipe("default", ["trainer.host_memory_margin=0"])


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.host_memory_check=false"],  # turned off
        ["trainer.ray_address=10.0.0.1:6379"],  # a cluster: Ray places the ranks on other hosts too
    ],
)
def test_the_check_is_off_when_asked_and_on_a_cluster(overrides: list[str]) -> None:
    check_host_memory(compose_recipe("default", overrides), (0, "a test's figure"))


def test_a_gpu_run_is_not_checked_against_host_memory() -> None:
    """On CUDA the model lives in GPU memory (the dry run checks that); the host's figure says nothing of it."""
    cfg = compose_recipe("default")
    cfg.trainer.runtime = "cuda"
    check_host_memory(cfg, (0, "a test's figure"))


def test_the_critic_and_every_engine_are_counted() -> None:
    one = compose_recipe("default", ["algorithm.adv_estimator=gae", "critic.enable=true"])
    parts = dict(host_memory_parts(one, hf_config_of(one)))
    assert any(what.startswith("critic 1 ranks x ") for what in parts), parts
    two = compose_recipe("default", ["rollout.num_engines=2"])
    engines = [nbytes for what, nbytes in host_memory_parts(two, hf_config_of(two)) if what.startswith("engines 2 x ")]
    single = [nbytes for what, nbytes in host_memory_parts(one, hf_config_of(one)) if what.startswith("engines 1 x ")]
    assert engines == [pytest.approx(2 * single[0])]


def test_the_actor_part_is_the_dry_runs_per_rank_estimate() -> None:
    """Pre-flight counts the parameters in closed form (no Megatron in the driver); the dry run builds the meta
    model. The per-rank figures agree within 1%."""
    cfg = compose_recipe("default")
    hf = hf_config_of(cfg)
    closed, exact = actor_estimate(cfg, hf, exact_params=False).total, actor_estimate(cfg, hf).total
    assert closed == pytest.approx(exact, rel=0.01)
    (what, nbytes), *_ = host_memory_parts(cfg, hf)
    assert nbytes == pytest.approx(cfg.actor.world_size * closed)


def test_the_hosts_available_memory_is_read_from_the_kernel() -> None:
    have, source = host_available_bytes()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 <= have <= total and ("MemAvailable" in source or "cgroup" in source)


def test_a_run_larger_than_any_host_exits_2_before_ray_starts(tmp_path: Path) -> None:
    """The default job with experts of 2^30 intermediate size (a few hundred thousand GiB per rank): refused with
    exit 2 and the figures, and the run dir holds what any pre-flight refusal leaves, the FAILED marker."""
    run_dir = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", "model.hf_config.moe_intermediate_size=1073741824",
         f"trainer.run_dir={run_dir}"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if "host memory: the run needs an estimated" in line]
    assert len(lines) == 1, res.stderr[-3000:]
    assert "actor 2 ranks x " in lines[0] and "engines 1 x " in lines[0] and "GiB available (" in lines[0]
    assert "Started a local Ray instance" not in res.stdout + res.stderr  # refused before Ray
    assert sorted(os.listdir(run_dir)) == ["FAILED"]
    assert "host memory" in (run_dir / "FAILED").read_text()
