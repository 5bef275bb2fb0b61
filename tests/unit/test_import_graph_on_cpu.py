"""The import graph of ``src/restage``, read from the AST (function-level and type-only imports included).

The layers of docs/DESIGN.md: ``restage.schedule`` is the contract below ``restage.plan`` (which builds
schedules) and ``restage.runtime`` (which executes them), so neither of those imports the other;
``restage.models`` is below the runtime; and no module reaches itself through its imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "restage").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The restage modules ``name`` imports anywhere in its file, with the packages whose ``__init__`` that runs."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import restage.x.y.z` where z is a name in y
                target = target.rpartition(".")[0]
            # Importing restage.a.b runs restage/a/__init__.py: an edge unless the importer is inside restage.a.
            while target and target != "restage":
                if target in modules and target != name and not name.startswith(target + "."):
                    found.add(target)
                target = target.rpartition(".")[0]
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_graph_reads_the_imports_it_should():
    graph = import_graph()
    assert "restage.schedule" in graph and "restage.runtime.step.worker" in graph
    assert {"restage.schedule.ops", "restage.schedule"} <= graph["restage.runtime.step.worker"]
    assert "restage.graph" in graph["restage.algorithms.interface"]


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_plan_and_runtime_do_not_import_each_other():
    graph = import_graph()
    crossing = sorted((a, b) for a, targets in graph.items() for b in targets
                      if (_in(a, "restage.plan") and _in(b, "restage.runtime"))
                      or (_in(a, "restage.runtime") and _in(b, "restage.plan")))
    assert crossing == []


def test_models_and_the_contract_do_not_import_the_runtime_or_the_planner():
    graph = import_graph()
    upward = sorted((a, b) for a, targets in graph.items() for b in targets
                    if (_in(a, "restage.models") and _in(b, "restage.runtime"))
                    or (_in(a, "restage.schedule") and (_in(b, "restage.runtime") or _in(b, "restage.plan"))))
    assert upward == []
