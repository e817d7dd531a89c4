"""Load SGLang 0.5.23's own receiving code in tests, without installing SGLang.

`make setup` (tools/fetch_sglang_contract.py) keeps a few files of the pinned wheel under `.venv/sglang-0.5.23/` and
builds `sglang_cpu_receiver.py` from them: SGLang's `init_custom_process_group`, `MultiprocessingSerializer`,
`SafeUnpickler`, `monkey_patch_torch_reductions` and `FlattenedTensorBucket`, each an exact source segment.

    from _sglang_code import load_sglang_receiver
    sglang = load_sglang_receiver()            # skips the test if set-up did not fetch it
    pg = sglang.init_custom_process_group(backend="gloo", init_method="tcp://127.0.0.1:29600", ...)

`load_sglang_communicator()` loads the kept `sglang/srt/managers/communicator.py` as it is (it imports only the
standard library): its `FanOutCommunicator` is how SGLang's tokenizer manager queues control requests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from pathlib import Path

SGLANG_DIR = Path(__file__).resolve().parents[1] / ".venv" / "sglang-0.5.23"
RECEIVER_PATH = SGLANG_DIR / "sglang_cpu_receiver.py"
MODULE_NAME = "sglang_cpu_receiver"
COMMUNICATOR_PATH = SGLANG_DIR / "sglang" / "srt" / "managers" / "communicator.py"
COMMUNICATOR_NAME = "sglang_communicator"


def load_sglang_receiver() -> types.ModuleType:
    """The built module (imported once per process, by path); skips the calling test when set-up did not build it."""
    if MODULE_NAME in sys.modules:
        return sys.modules[MODULE_NAME]
    if not RECEIVER_PATH.is_file():
        import pytest

        pytest.skip(
            f"{RECEIVER_PATH} is missing: `make setup` builds it "
            "(tools/fetch_sglang_contract.py, from the SGLang 0.5.23 wheel)"
        )
    spec = importlib.util.spec_from_file_location(MODULE_NAME, RECEIVER_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module  # dataclasses and pickle look a class's module up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[MODULE_NAME]
        raise
    return module


def load_sglang_communicator() -> types.ModuleType:
    """SGLang's `managers/communicator.py`, imported by path once per process; skips the calling test when set-up did
    not keep it."""
    if COMMUNICATOR_NAME in sys.modules:
        return sys.modules[COMMUNICATOR_NAME]
    if not COMMUNICATOR_PATH.is_file():
        import pytest

        pytest.skip(f"{COMMUNICATOR_PATH} is missing: `make setup` keeps it (tools/fetch_sglang_contract.py)")
    spec = importlib.util.spec_from_file_location(COMMUNICATOR_NAME, COMMUNICATOR_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[COMMUNICATOR_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[COMMUNICATOR_NAME]
        raise
    return module


@contextlib.contextmanager
def sglang_receiver_process(
    tp_rank: int = 0,
    defer_copy_s: float = 0.0,
    timeout_s: float = 120.0,
    peers: Sequence[str] = (),
    env: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[str]:
    """Run tests/_sglang_receiver.py (an engine rank receiving with SGLang's code) in a child process; yields its URL.
    `peers`: the URLs of the engine's other TP ranks (given to rank 0, which hands them each tensor update); `env`:
    variables set in the child (CUDA_VISIBLE_DEVICES: the one GPU an engine rank sees); `extra_args`: more of its
    flags (`--delay-init GROUP=SECONDS`, `--nccl-store-only`).

    Skips the calling test, as load_sglang_receiver does, when set-up did not build SGLang's code."""
    load_sglang_receiver()
    script = Path(__file__).resolve().parent / "_sglang_receiver.py"
    child = subprocess.Popen(
        [sys.executable, str(script), "--tp-rank", str(tp_rank), "--defer-copy-s", str(defer_copy_s)]
        + [arg for url in peers for arg in ("--peer", url)]
        + list(extra_args),
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env} if env else None,
    )
    try:
        ready = threading.Timer(timeout_s, child.kill)  # a child that never says READY is killed, not waited on
        ready.start()
        line = child.stdout.readline()
        ready.cancel()
        if not line.startswith("READY "):
            raise RuntimeError(f"the SGLang receiver did not start (exit {child.poll()}): {line!r}")
        yield line.split()[1]
    finally:
        child.kill()
        child.wait()
