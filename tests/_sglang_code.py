"""Load SGLang 0.5.23's own receiving code in tests, without installing SGLang.

`make setup` (tools/fetch_sglang_contract.py) keeps a few files of the pinned wheel under `.venv/sglang-0.5.23/` and
builds `sglang_cpu_receiver.py` from them: SGLang's `init_custom_process_group`, `MultiprocessingSerializer`,
`SafeUnpickler`, `monkey_patch_torch_reductions` and `FlattenedTensorBucket`, each an exact source segment.

    from _sglang_code import load_sglang_receiver
    sglang = load_sglang_receiver()            # skips the test if set-up did not fetch it
    pg = sglang.init_custom_process_group(backend="gloo", init_method="tcp://127.0.0.1:29600", ...)
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

SGLANG_DIR = Path(__file__).resolve().parents[1] / ".venv" / "sglang-0.5.23"
RECEIVER_PATH = SGLANG_DIR / "sglang_cpu_receiver.py"
MODULE_NAME = "sglang_cpu_receiver"


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
