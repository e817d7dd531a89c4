"""The rollout engine kinds (mcore_rl/rollout/engines/): every registered kind answers the whole protocol, the
registry is the list of engine names the config accepts, importing the kinds stays light, and no code outside
rollout/engines/ compares an engine's name.

.venv/bin/pytest -q tests/test_engine_kinds.py
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mcore_rl.config import ConfigError, RLConfig, RolloutConfig, SyncConfig
from mcore_rl.rollout.engines import KINDS, EmbeddedKind, EngineKind, EngineShape, kind_of

ROOT = Path(__file__).resolve().parent.parent
BUILT_IN = ("hf", "sglang", "vllm")
#: the attributes every kind sets (EngineKind's annotations), with their types
ATTRIBUTES = {"name": str, "dialect": str, "embedded": bool, "uses_gpu_extra": bool}


def test_the_registry_holds_the_built_in_kinds_in_order() -> None:
    assert tuple(KINDS)[:3] == BUILT_IN
    assert set(ATTRIBUTES) == set(inspect.get_annotations(EngineKind))


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_kind_implements_the_whole_protocol(name: str) -> None:
    from mcore_rl.rollout.client import DIALECTS

    kind = kind_of(name)
    assert isinstance(kind, EngineKind) and kind.name == name
    assert not type(kind).__abstractmethods__
    for attribute, expected in ATTRIBUTES.items():
        assert isinstance(getattr(kind, attribute, None), expected), f"{name}: {attribute} is not a {expected}"
    assert kind.dialect in DIALECTS
    rollout = RolloutConfig(engine=name)
    for runtime in ("cpu", "cuda"):
        shape = kind.shape(rollout, runtime)
        assert isinstance(shape, EngineShape) and shape.ranks >= 1
        assert kind.update_group_backend(runtime) in ("gloo", "nccl", "vllm_nccl")
    assert kind.update_group_backend("cpu") == "gloo"
    assert kind.pause_mode("auto") in ("none", "abort")
    assert isinstance(kind.init_group_options(30.0), dict)
    assert isinstance(kind.router_class(), type)
    assert kind.nodes_problem(rollout) is None  # the default settings fit
    assert isinstance(kind.node_gpus_problem(rollout, "cuda", 16, 8), str)
    cfg = RLConfig()
    cfg.rollout.engine = name
    cfg.sync.transport = "distributed"
    kind.validate_rollout(cfg.rollout)
    kind.check_run(cfg)
    assert kind.cuda_transport_problem(cfg) is None  # split, distributed, one stage: every kind's sync runs


def test_importing_the_kinds_imports_no_torch_vllm_or_sglang() -> None:
    code = (
        "import sys\n"
        "import mcore_rl.rollout.engines as engines\n"
        "assert list(engines.KINDS) == ['hf', 'sglang', 'vllm'], list(engines.KINDS)\n"
        "print(sorted(m for m in ('torch', 'vllm', 'sglang') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


class _FakeKind(EmbeddedKind):
    """A fourth kind, registered by a test only: our server under another name."""

    name = "fake"


def test_a_registered_kind_is_found_and_accepted_by_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeKind()
    monkeypatch.setitem(KINDS, "fake", fake)
    assert kind_of("fake") is fake
    rollout = RolloutConfig(engine="fake")
    rollout.validate()
    assert rollout.kind is fake
    assert SyncConfig().pause_mode_for("fake") == "none"
    with pytest.raises(ConfigError, match=r"rollout\.engine='bogus' is invalid: expected one of \('hf', 'sglang', "
                                          r"'vllm', 'fake'\)"):  # fmt: skip
        RolloutConfig(engine="bogus").validate()


@pytest.mark.parametrize("name", ["bogus", "HF", "", None])
def test_an_unknown_engine_is_refused_naming_the_accepted_ones(name: Any) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.engine=.* is invalid: expected one of \('hf', 'sglang', 'vllm'\)"):
        RolloutConfig(engine=name).validate()
    with pytest.raises(ConfigError, match="expected one of"):
        kind_of(name)


def _literals(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def comparisons(source: str, filename: str = "<source>") -> list[str]:
    """`line: comparison` for every comparison in `source` with an engine name on either side (a string literal, or a
    tuple, list or set holding one), whatever the other side is called."""
    names = set(BUILT_IN)
    return [
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source, filename))
        if isinstance(node, ast.Compare) and any(_literals(x) & names for x in (node.left, *node.comparators))
    ]


def engine_name_comparisons(folders: tuple[str, ...] = ("mcore_rl", "resharding", "parallel")) -> list[str]:
    """`file:line: comparison` for every engine-name comparison outside mcore_rl/rollout/engines/."""
    engines = ROOT / "mcore_rl" / "rollout" / "engines"
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not path.is_relative_to(engines):
                found += [f"{path.relative_to(ROOT)}:{c}" for c in comparisons(path.read_text(), str(path))]
    return found


def test_no_code_outside_the_engine_kinds_compares_an_engine_name() -> None:
    found = engine_name_comparisons()
    assert not found, "ask the engine kind (rollout.kind / kind_of) instead:\n" + "\n".join(found)


def test_the_guard_finds_a_comparison_by_any_name() -> None:
    """The checker itself: a comparison is found whatever holds the name; other strings are not engine names."""
    source = (
        'if dialect.name == "vllm" or kind in ("hf", "x") or "sglang" != backend or cfg.engine not in ["vllm"]:\n'
        "    pass\n"
        'if backend == "vllm_nccl" or key == "rollout.vllm" or fmt in ("megatron",):\n'
        "    pass\n"
    )
    assert [c.split(":")[0] for c in comparisons(source)] == ["1"] * 4


def test_the_stream_leaders_group_is_made_by_the_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """EngineKind.update_group: parallel/update_group.py's group for every kind and backend, except vLLM's NCCL
    weight-transfer group, which the vLLM kind makes (sized by the plan's largest bucket) and shares across streams."""
    import mcore_rl.parallel.update_group as update_group
    import mcore_rl.rollout.vllm_nccl as vllm_nccl

    made: list[tuple[str, tuple, dict]] = []
    monkeypatch.setattr(update_group, "new_update_group", lambda *a, **k: made.append(("generic", a, k)) or "generic")
    monkeypatch.setattr(vllm_nccl, "new_vllm_nccl_group", lambda *a, **k: made.append(("vllm", a, k)) or "vllm")
    for name in BUILT_IN:
        kind = kind_of(name)
        for runtime in ("cpu", "cuda"):
            backend = kind.update_group_backend(runtime)
            shared = kind.shared_update_group(backend)
            assert shared == (name == "vllm" and runtime == "cuda"), (name, runtime)
            made.clear()
            group = kind.update_group(backend, "h", 1, 3, "g", 5.0, store="s", bucket_bytes=64, device="cpu",
                                      connect={"mint_id": "m"})  # fmt: skip
            if shared:
                assert (group, made) == (
                    "vllm",
                    [("vllm", ("h", 1, 3, "g", 64, "cpu", 5.0), {"store": "s", "mint_id": "m"})],
                )
            else:
                assert (group, made) == ("generic", [("generic", (backend, "h", 1, 0, 3, "g", 5.0), {"store": "s"})])
