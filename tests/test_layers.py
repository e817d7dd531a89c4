"""The package's import graph follows the layer order of the design (shared/DESIGN.md, "Layers"): imports point down
or sideways within a layer, never up, and no set of modules imports itself round in a circle.

The graph is built with `ast` from every module of the installed package (`mcore_rl`, and `parallel/`, `resharding/`,
`kernels/` under their `mcore_rl.` names), with function-level imports included; imports under `if TYPE_CHECKING:`
are left out (they are never executed). `KNOWN` lists the edges that break the order today, each with why it is
there and where it goes; an entry that no longer occurs fails the test too, so the list only shrinks.

Run: `.venv/bin/pytest tests/test_layers.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: import name -> folder in the repository (setup.py's package_dir)
FOLDERS = {
    "mcore_rl": "mcore_rl",
    "mcore_rl.parallel": "parallel",
    "mcore_rl.resharding": "resharding",
    "mcore_rl.kernels": "kernels",
}
#: top to bottom; a module's layer is that of the first prefix that matches it (most specific first)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry", ("mcore_rl.train", "mcore_rl.cli", "mcore_rl.lifecycle")),
    # pre-flight is the controller's check of a run's inputs before anything starts (both loops call it), with the
    # record of the checkpoint passes it remembers
    ("controller", ("mcore_rl.controller", "mcore_rl.preflight", "mcore_rl.preflight_cache")),
    ("compat", ("mcore_rl.compat",)),
    (
        "services",
        (
            "mcore_rl.actor",
            "mcore_rl.workers",
            "mcore_rl.rollout",
            "mcore_rl.reward",
            "mcore_rl.data",
            "mcore_rl.checkpoint",
            "mcore_rl.metrics",
        ),
    ),
    ("config", ("mcore_rl.config",)),
    ("algorithms", ("mcore_rl.algorithms",)),
    ("models", ("mcore_rl.models",)),
    ("resharding", ("mcore_rl.resharding",)),
    ("parallel", ("mcore_rl.parallel",)),
    ("kernels", ("mcore_rl.kernels",)),
    # imported from anywhere: the package itself, its import hooks, warnings filters, shared errors, the watchdog
    (
        "base",
        (
            "mcore_rl._megatron_import",
            "mcore_rl._quiet",
            "mcore_rl.errors",
            "mcore_rl.gpu_extra",
            "mcore_rl.watchdog",
        ),
    ),
]

#: (importer, imported) -> why the edge is there today and where it goes. Upward edges and the edges of cycles.
KNOWN: dict[tuple[str, str], str] = {
    # the config validates names against registries that live with the services they name
    ("mcore_rl.config.rollout", "mcore_rl.rollout.vllm_config"): "vLLM's config checks; move to the vLLM kind",
    ("mcore_rl.config.rollout", "mcore_rl.rollout.engines"): (
        "rollout.engine's kind (RolloutConfig.kind, engine_kind: one function-level import): the registry of kinds "
        "is the list of accepted names, and the engine's own checks, pause mode and derived settings are its"
    ),
    ("mcore_rl.config.rollout", "mcore_rl.rollout.agent.parser"): "the agent parsers' registry is read by the config",
    ("mcore_rl.config.rollout", "mcore_rl.rollout.agent.tools"): "the agent tools' registry is read by the config",
    # the reward loader's built-in table holds verl's data sources, and a user's reward file may import verl's
    # reward_score: both are read from compat/verl/shim.py on first use, never when reward/ is imported; the edge stays
    # while verl's scorers are built-ins of every run
    ("mcore_rl.reward.loader", "mcore_rl.compat.verl.shim"): "verl's data sources and reward_score shim, read lazily",
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = list(rel.parts)
            if folder == "mcore_rl" and parts[0] in ("parallel", "resharding", "kernels"):
                continue  # not there; the mapped folders are read from the repository root
            if "vllm_plugin" in parts:  # a separate distribution installed into vLLM's virtualenv
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = ".".join(package[: len(package) - node.level + 1])
                module = stem + ("." + node.module if node.module else "")
            else:
                module = node.module or ""
            targets.add(module)
            targets.update(f"{module}.{alias.name}" for alias in node.names)
    resolved: set[str] = set()
    for target in targets:
        while target and target not in modules:  # `from pkg import name`: the name may be a module or an attribute
            target = target.rpartition(".")[0]
        if target and target != name and not name.startswith(target + "."):  # a package's own parents run first
            resolved.add(target)
    return resolved


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (function-level imports included, TYPE_CHECKING ones not)."""
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> int:
    """Index in LAYERS, 0 at the top; the package root alone is the base layer."""
    if module == "mcore_rl":
        return len(LAYERS) - 1
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py LAYERS: add it where it belongs")


def cycle_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The edges inside strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    component_of: dict[str, int] = {}
    sizes: list[int] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    for member in members:
                        component_of[member] = len(sizes)
                    sizes.append(len(members))
    return {
        (a, b)
        for a, deps in graph.items()
        for b in deps
        if component_of[a] == component_of[b] and sizes[component_of[a]] > 1
    }


def violations() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """(upward edges, edges on a cycle) of the package's import graph."""
    graph = import_graph()
    upward = {(a, b) for a, deps in graph.items() for b in deps if layer_of(b) < layer_of(a)}
    return upward, cycle_edges(graph)


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_no_upward_import_and_no_cycle_beyond_the_known_list():
    upward, cycles = violations()
    new = sorted((upward | cycles) - set(KNOWN))
    assert not new, "imports that break the layer order (shared/DESIGN.md, Layers):\n" + "\n".join(
        f"  {a} -> {b} ({'up' if (a, b) in upward else 'cycle'})" for a, b in new
    )


def test_the_known_list_only_holds_edges_that_still_occur():
    upward, cycles = violations()
    gone = sorted(set(KNOWN) - upward - cycles)
    assert not gone, "fixed, so remove from KNOWN: " + ", ".join(f"{a} -> {b}" for a, b in gone)


def test_the_graph_sees_function_level_imports_and_cycles():
    """The checker itself: a function-level import is an edge, and a two-module cycle is found."""
    graph = import_graph()
    # models/registry.py imports the families inside `_import_families`
    assert "mcore_rl.models.llama" in graph["mcore_rl.models.registry"]
    assert cycle_edges({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == {("a", "b"), ("b", "a")}
    assert layer_of("mcore_rl.parallel.groups") > layer_of("mcore_rl.rollout.client")
