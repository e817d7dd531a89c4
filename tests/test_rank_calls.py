"""Calls to the Megatron ranks name the method itself (`group.call(MegatronActor.update, batch)`), never its name as
a string: a reader and a type checker follow each call to its method and arguments (ParamSpec), and a misspelt or
foreign method is refused before anything is sent to a rank."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mcore_rl.actor.megatron_actor import MegatronActor
from mcore_rl.controller.actor_group import method_name

ROOT = Path(__file__).resolve().parent.parent


def test_a_megatron_actor_method_is_named_by_itself() -> None:
    assert method_name(MegatronActor.update) == "update"
    assert method_name(MegatronActor.sync_send) == "sync_send"


@pytest.mark.parametrize(
    "method",
    ["update", str.upper, lambda self: None, MegatronActor],
    ids=["a string", "another class's method", "a lambda", "the class"],
)
def test_anything_else_is_refused_naming_what_is_expected(method: object) -> None:
    with pytest.raises(TypeError, match=r"MegatronActor method \(e\.g\. MegatronActor\.update\)"):
        method_name(method)  # type: ignore[arg-type]


def test_no_rank_call_in_the_package_passes_a_method_name_as_a_string() -> None:
    """Every `.call(...)`, `.call_rank(r, ...)` and `.submit(r, ...)` in the package names a method, not a string;
    and no module reaches a rank's Ray handle (`handles[i].method.remote`) outside the group itself."""
    found = []
    for folder in ("mcore_rl", "resharding", "parallel"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                    continue
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                position = {"call": 0, "call_rank": 1, "submit": 1}.get(node.func.attr)
                if position is not None and len(node.args) > position:
                    arg = node.args[position]
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        found.append(f"{where}: .{node.func.attr}({arg.value!r}, ...)")
                reaches_handle = node.func.attr == "remote" and "handles[" in ast.unparse(node.func)
                if reaches_handle and path.name != "actor_group.py":
                    found.append(f"{where}: {ast.unparse(node.func)}")
    assert not found, "rank calls by name:\n" + "\n".join(found)
