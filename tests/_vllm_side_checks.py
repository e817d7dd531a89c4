"""The driver both vLLM side scripts (tests/_vllm_transfer_side.py, _vllm_colocated_side.py) run under .venv-vllm's
Python: `python SIDE.py IN.json OUT.json` runs the side's `check_<name>(inputs)` for every name of IN's "checks", with
IN's optional "env" set first, and writes {name: result or {"error": traceback}} to OUT (each failure reported to the
test, which names it)."""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any


def run_checks(checks: dict[str, Any]) -> None:
    """`checks`: the side module's globals, holding its `check_<name>` functions."""
    with open(sys.argv[1]) as f:
        inp = json.load(f)
    os.environ.update(inp.get("env", {}))
    out: dict[str, Any] = {}
    for name in inp["checks"]:
        try:
            out[name] = checks[f"check_{name}"](inp)
        except Exception:  # noqa: BLE001 (reported to the test, which names it)
            out[name] = {"error": traceback.format_exc()[-3000:]}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
