"""`make test`'s grouping (tests/conftest.py): under `pytest -n 2 --dist loadgroup` a group of files (every
test_vllm_*.py; the sandbox's files) and every other file runs whole on one worker, so its module fixtures start
once. xdist 3.8's own loadgroup did not do this under pytest 9 (it tags `item._nodeid`, which pytest 9 no longer
reads): every test was its own unit, and both workers ran parts of every file, each setting up its module fixtures
(two vLLM servers at once, the same training run twice).

    .venv/bin/python -m pytest -q tests/test_xdist_groups.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

FILE = """
import os
import pytest

@pytest.fixture(scope="module")
def started():
    with open(os.environ["GROUPS_LOG"], "a") as f:
        f.write(f"setup {os.environ['PYTEST_XDIST_WORKER']} {__name__}\\n")

@pytest.mark.parametrize("i", range(4))
def test_one(started, i):
    with open(os.environ["GROUPS_LOG"], "a") as f:
        f.write(f"test {os.environ['PYTEST_XDIST_WORKER']} {__name__}\\n")
"""


# The long tier: it starts a pytest with two xdist workers of its own (about 15 s in CI); it guards how the CI tier's
# time is spent, not what the tier shows.
@pytest.mark.long
def test_a_group_and_a_file_each_run_whole_on_one_worker_with_one_module_setup(tmp_path: Path) -> None:
    """Two vLLM files (one group) and two other files (a group each), four tests each, on two workers: each group's
    tests all on one worker, each file's module fixture set up once."""
    names = ["test_vllm_a", "test_vllm_b", "test_other_c", "test_other_d"]
    for name in names:
        (tmp_path / f"{name}.py").write_text(FILE)
    log = tmp_path / "groups.log"
    env = dict(os.environ, GROUPS_LOG=str(log), PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder",
         "-p", "conftest", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [line.split() for line in log.read_text().splitlines()]
    workers: dict[str, set[str]] = {}
    for kind, worker, module in records:
        if kind == "test":
            group = "vllm" if module.startswith("test_vllm_") else module
            workers.setdefault(group, set()).add(worker)
    assert sorted(workers) == ["test_other_c", "test_other_d", "vllm"]
    assert all(len(w) == 1 for w in workers.values()), workers
    setups = sorted(module for kind, _, module in records if kind == "setup")
    assert setups == sorted(names), setups
