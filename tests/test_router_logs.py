"""The sglang-router process's log directory: a temporary one goes at stop unless the router wrote to it; one the
caller names (the run directory's rollout/) always stays."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mcore_rl.rollout.router import Router


def test_a_temporary_log_directory_is_created_at_start_and_removed_at_stop() -> None:
    router = Router([])
    assert not os.path.exists(router.log_dir)  # constructing a Router (e.g. for its command line) writes nothing
    router.start()
    try:
        assert os.path.isdir(router.log_dir)
    finally:
        router.stop()
    assert not os.path.exists(router.log_dir)


def test_a_temporary_log_directory_with_the_router_s_output_is_kept() -> None:
    router = Router([])
    router.start()
    try:
        with open(router.log_path, "a") as log:  # what the router would write on an error
            log.write("ERROR something the user must read\n")
    finally:
        router.stop()
    assert os.path.getsize(router.log_path) > 0
    shutil.rmtree(router.log_dir)


def test_a_named_log_directory_stays(tmp_path: Path) -> None:
    router = Router([], log_dir=str(tmp_path / "rollout"))
    router.start()
    router.stop()
    assert (tmp_path / "rollout").is_dir()
