"""Weight payloads are data, never code: gadget pickles are refused without running anything.

Each gadget, if unpickled by an unpickler that admits it, creates a marker file; a test passes only if the payload
is refused with a message naming the global and the marker does not exist. The same payloads go over HTTP to a real
embedded server (with its API key: any key holder could send them). Our allow-list is also checked against the one
in SGLang 0.5.23's own `SafeUnpickler`, extracted from the pinned wheel at set-up: every pair we admit, SGLang admits.

Run: `.venv/bin/pytest tests/test_weight_receiver_security.py`
"""

from __future__ import annotations

import base64
import io
import pickle
import sys
from pathlib import Path

import pytest
import requests
import torch
from tiny_models import tiny_qwen3_moe

from mcore_rl.rollout.safe_pickle import ALLOWED_GLOBALS, SafeUnpickler, UnsafePayload, safe_loads
from mcore_rl.rollout.server import ServerThread, build_server
from mcore_rl.rollout.weight_receiver import WeightUpdateError, decode_payload, encode_payload

KEY = "test-key"


def _global(module: str, name: str) -> bytes:
    """Protocol-2 opcodes that push module.name (GLOBAL takes 'module\\nname\\n')."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _call(module: str, name: str, *args: str | bytes) -> bytes:
    """A pickle that calls module.name(*args) (REDUCE) with string or bytes arguments."""
    body = b"\x80\x02" + _global(module, name) + b"("
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
            body += b"X" + len(arg).to_bytes(4, "little") + arg
        else:
            body += b"B" + len(arg).to_bytes(4, "little") + arg
    return body + b"tR."


def gadgets(marker: Path) -> dict[str, bytes]:
    """Payloads that would run `touch marker` (or read a file) if their globals were admitted."""
    cmd = f"touch {marker}"

    class Evil:  # pickled with plain pickle.dumps: reduces to os.system(cmd)
        def __reduce__(self):
            import os

            return (os.system, (cmd,))

    # torch.save bytes of an object that runs the command on a weights_only=False load: the reason
    # torch.storage._load_from_bytes (admitted by the old `_load_*` prefix rule) is a gadget.
    inner = io.BytesIO()
    torch.save(Evil(), inner)
    return {
        "os.system": _call("os", "system", cmd),
        "posix.system": _call("posix", "system", cmd),
        "subprocess.getoutput": _call("subprocess", "getoutput", cmd),
        "builtins.eval": _call("builtins", "eval", f"__import__('os').system({cmd!r})"),
        "builtins.exec": _call("builtins", "exec", f"import os; os.system({cmd!r})"),
        "builtins.getattr": _call("builtins", "getattr", "x", "y"),
        "torch.load": _call("torch", "load", str(marker)),
        "torch.storage._load_from_bytes": _call("torch.storage", "_load_from_bytes", inner.getvalue()),
        "torch.serialization.load": _call("torch.serialization", "load", str(marker)),
        "torch._tensor._rebuild_from_type_v2": _call("torch._tensor", "_rebuild_from_type_v2", "x"),
        "functools.partial": _call("functools", "partial", "x"),
        "copyreg._reconstructor": _call("copyreg", "_reconstructor", "x"),
        "multiprocessing.resource_sharer.DupFd": _call("multiprocessing.resource_sharer", "DupFd", "x"),
        "plain pickle of os.system": pickle.dumps(Evil(), protocol=2),
        "nested in a list": pickle.dumps([("w", Evil())], protocol=4),
    }


@pytest.mark.parametrize("name", list(gadgets(Path("/nonexistent"))))
def test_gadget_refused_and_never_runs(name: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    raw = gadgets(marker)[name]
    for load_format in (None, "flattened_bucket"):
        with pytest.raises(WeightUpdateError) as err:
            decode_payload(base64.b64encode(raw).decode(), load_format)
        assert not marker.exists(), f"{name}: the payload ran a command"
        if name != "torch.storage._load_from_bytes":  # that name is answered by a weights_only loader, which refuses
            assert "may not contain" in str(err.value)


def test_load_from_bytes_is_answered_weights_only(tmp_path: Path) -> None:
    """A plain pickle of a tensor goes through torch.storage._load_from_bytes: it still loads, weights only."""
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    back = safe_loads(pickle.dumps([("w", tensor)]))
    assert torch.equal(back[0][1], tensor)
    marker = tmp_path / "ran"
    with pytest.raises((UnsafePayload, pickle.UnpicklingError)):
        safe_loads(gadgets(marker)["torch.storage._load_from_bytes"])
    assert not marker.exists()


def test_legitimate_payloads_still_decode() -> None:
    named = [("a", torch.randn(3, 4)), ("b", torch.zeros(5, dtype=torch.bfloat16)), ("c", torch.ones(2).half())]
    for load_format in (None, "flattened_bucket"):
        out = decode_payload(encode_payload(named, load_format), load_format)
        assert [n for n, _ in out] == ["a", "b", "c"]
        assert all(torch.equal(t, dict(named)[n]) for n, t in out)


def test_allow_list_is_exact_pairs_within_sglangs() -> None:
    """No prefixes or patterns: the unpickler admits the pairs of ALLOWED_GLOBALS and nothing near them; and every
    pair we admit is admitted by SGLang 0.5.23's own SafeUnpickler (extracted from the pinned wheel)."""
    near = [
        ("torch.storage", "_load_anything"),
        ("torch._utils", "_rebuild_device_tensor_from_numpy"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch", "load"),
        ("torch", "save"),
    ]
    for module, name in near:
        assert (module, name) not in ALLOWED_GLOBALS
        with pytest.raises(UnsafePayload):
            SafeUnpickler(io.BytesIO(b"")).find_class(module, name)
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from _sglang_code import load_sglang_receiver
    except ImportError:
        pytest.skip("tests/_sglang_code.py (the loader of SGLang's extracted code) is not there yet")
    sglang = load_sglang_receiver()
    extra = sorted(ALLOWED_GLOBALS - set(sglang.SafeUnpickler.ALLOWED_GLOBALS))
    assert not extra, f"pairs we admit that SGLang 0.5.23 does not: {extra}"


def test_gadgets_refused_by_sglangs_own_unpickler_too(tmp_path: Path) -> None:
    """The same gadgets against SGLang's SafeUnpickler: what we refuse is what SGLang refuses (a shared yardstick)."""
    try:
        from _sglang_code import load_sglang_receiver
    except ImportError:
        pytest.skip("tests/_sglang_code.py (the loader of SGLang's extracted code) is not there yet")
    sglang = load_sglang_receiver()
    marker = tmp_path / "ran"
    for name, raw in gadgets(marker).items():
        with pytest.raises(Exception):  # noqa: B017 (SGLang raises RuntimeError or UnpicklingError)
            sglang.MultiprocessingSerializer.deserialize(raw)
        assert not marker.exists(), f"{name} ran under SGLang's unpickler"


def test_gadget_over_http_is_a_400_and_runs_nothing(tmp_path: Path) -> None:
    """A key holder POSTs gadgets to /update_weights_from_tensor: 400 naming the global, nothing runs, and the
    session that carried it commits nothing (the old weight version stays)."""
    thread = ServerThread(build_server(dict(tiny_qwen3_moe()), api_key=KEY, max_running_requests=8))
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        marker = tmp_path / "ran"
        for name in ("os.system", "torch.storage._load_from_bytes", "plain pickle of os.system"):
            before = requests.get(thread.url + "/get_weight_version", headers=auth, timeout=30)
            assert requests.post(thread.url + "/begin_weight_update", json={}, headers=auth, timeout=30).ok
            body = {"serialized_named_tensors": [base64.b64encode(gadgets(marker)[name]).decode()]}
            answer = requests.post(thread.url + "/update_weights_from_tensor", json=body, headers=auth, timeout=30)
            assert answer.status_code == 400, (name, answer.status_code, answer.text)
            assert answer.json()["success"] is False
            requests.post(thread.url + "/end_weight_update", json={}, headers=auth, timeout=30)
            assert not marker.exists(), f"{name} ran a command on the server"
            after = requests.get(thread.url + "/get_weight_version", headers=auth, timeout=30)
            if before.ok:
                assert after.json() == before.json()
    finally:
        thread.stop()
