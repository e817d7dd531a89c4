"""SGLang's own receiving code, as tests use it, is the pinned wheel's code.

tools/fetch_sglang_contract.py keeps files of the SGLang 0.5.23 wheel (each checked against a pinned sha256) and
builds `sglang_cpu_receiver.py` from exact source segments of them. These tests fail if a kept file differs from the
pinned wheel's, or if the built module holds anything but those segments and its fixed header.
Run: `make setup`, then `pytest tests/test_sglang_receiver.py`.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import pickle
import re
import sys
from pathlib import Path

import pytest
import torch
from _sglang_code import RECEIVER_PATH, SGLANG_DIR, load_sglang_receiver

FETCH = Path(__file__).resolve().parents[1] / "tools" / "fetch_sglang_contract.py"
MARKER = re.compile(r"^# (sglang/[\w/.]+\.py):(\d+)-(\d+)$", re.M)


def _fetch_module():
    spec = importlib.util.spec_from_file_location("fetch_sglang_contract", FETCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fetch_sglang_contract", module)
    spec.loader.exec_module(module)
    return module


fetch = _fetch_module()


def _node_name(node: ast.stmt) -> str:
    if isinstance(node, ast.Assign):
        return node.targets[0].id
    return node.name


def test_every_kept_file_has_the_pinned_wheel_hash():
    load_sglang_receiver()  # skips when set-up did not fetch
    for name in fetch.FILES:
        data = (SGLANG_DIR / name).read_bytes()
        assert fetch.record_hash(data) == fetch.SHA256[name], f"{name} differs from the pinned SGLang wheel's"


def test_pinned_hashes_are_the_wheels_record():
    """The pins are the RECORD lines of the wheel set-up downloaded (kept beside the extracted files)."""
    load_sglang_receiver()  # skips when set-up did not fetch
    record = SGLANG_DIR / fetch.RECORD
    assert record.is_file(), f"{record}: set-up keeps the wheel's RECORD beside its files (make setup)"
    listed = dict(line.split(",")[:2] for line in record.read_text().splitlines() if line.count(",") == 2)
    for name, pin in fetch.SHA256.items():
        assert listed[name] == f"sha256={pin}", name


def test_built_module_is_header_plus_exact_segments_of_the_kept_files():
    load_sglang_receiver()
    text = RECEIVER_PATH.read_text(encoding="utf-8")
    first_marker = MARKER.search(text)
    assert text[: first_marker.start()].rstrip("\n") == fetch.RECEIVER_HEADER.rstrip("\n"), "header was edited"
    markers = list(MARKER.finditer(text))
    got_names = []
    for i, marker in enumerate(markers):
        path, first, last = marker.group(1), int(marker.group(2)), int(marker.group(3))
        end = markers[i + 1].start() if i + 1 < len(markers) else len(text)
        segment = text[marker.end() + 1 : end].rstrip("\n") + "\n"
        kept = (SGLANG_DIR / path).read_text(encoding="utf-8").splitlines(keepends=True)
        assert segment == "".join(kept[first - 1 : last]), f"{path}:{first}-{last} differs from the kept file"
        nodes = ast.parse(segment).body
        assert len(nodes) == 1, f"{path}:{first}-{last} is not one definition"
        got_names.append((path, _node_name(nodes[0])))
    wanted = [(path, name) for path, names in fetch.RECEIVER_PARTS for name in names]
    assert got_names == wanted
    assert text == fetch.build_receiver(SGLANG_DIR)


def test_segments_are_the_ones_sglang_names():
    """The functions the tests call are SGLang's (their code objects come from the built file, not from ours)."""
    sglang = load_sglang_receiver()
    for name in ("init_custom_process_group", "monkey_patch_torch_reductions", "_safe_load_torch_storage"):
        assert getattr(sglang, name).__code__.co_filename == str(RECEIVER_PATH)
    assert sglang.SafeUnpickler.ALLOWED_GLOBALS, "SafeUnpickler lost its allow-list"
    assert sglang._is_npu is False and sglang._is_musa is False


def test_sglang_deserializer_opens_a_cpu_payload_and_refuses_code():
    sglang = load_sglang_receiver()
    tensor = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    data = sglang.MultiprocessingSerializer.serialize([("w", tensor)], output_str=True)
    [(name, back)] = sglang.MultiprocessingSerializer.deserialize(data)
    assert name == "w" and torch.equal(back, tensor)

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("true",))

    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        sglang.SafeUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()


def test_refuses_a_kept_file_that_differs_from_the_pin(tmp_path):
    with pytest.raises(fetch.FetchError, match="sglang/srt/utils/common.py has sha256"):
        fetch.check_pinned("sglang/srt/utils/common.py", b"def init_custom_process_group(): pass\n")
