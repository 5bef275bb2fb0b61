"""The import graph of ``src/restage``, read from the AST (function-level and type-only imports included), and two
rules about what the code reads, checked on the AST too.

The layers of docs/DESIGN.md: ``restage.schedule`` is the contract below ``restage.plan`` (which builds
schedules) and ``restage.runtime`` (which executes them), so neither of those imports the other;
``restage.models`` is below ``restage.rollout`` (the engine over a decoder), both below the runtime;
and no module reaches itself through its imports.

The schedule is the runtime's only source of planning facts: no module under ``restage.runtime`` reads
``X.plan``, ``X.models`` or ``X.cluster`` where ``X`` is the experiment config (``config_reads``). And kinds are
enums, never strings: no code compares an MFC kind, an op kind, a dataset kind, the execution mode or the config's
plan mode with a string literal, nor matches one against string patterns (``kind_string_compares``).
"""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

from restage.config.choices import DatasetKind, Execution, PlanMode
from restage.graph import MFCKind
from restage.schedule.ops import Op

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


def test_models_rollout_and_the_contract_do_not_import_upward():
    """models/ is below rollout/ (the engine over a decoder), both below the runtime; the contract below plan and runtime."""
    graph = import_graph()
    upward = sorted((a, b) for a, targets in graph.items() for b in targets
                    if (_in(a, "restage.models") and any(_in(b, p) for p in ("restage.runtime", "restage.rollout")))
                    or (_in(a, "restage.rollout") and any(_in(b, p) for p in ("restage.runtime", "restage.plan")))
                    or (_in(a, "restage.schedule") and (_in(b, "restage.runtime") or _in(b, "restage.plan"))))
    assert upward == []


def _listing(offenders: dict[str, list[tuple[int, str]]]) -> str:
    return "\n" + "\n".join(f"{name}:{line}: {code}" for name, found in offenders.items() for line, code in found)


# --- The runtime reads no planning decision from the experiment config -------------------------------------------

PLANNING_SECTIONS = {"plan", "models", "cluster"}
# The names the experiment config goes by (a local, a parameter or an attribute such as ``self.cfg``); besides these,
# any parameter or attribute annotated ``ExperimentConfig`` in the same file.
CONFIG_NAMES = {"cfg", "config", "experiment", "experiment_config", "exp_cfg"}


def _config_names(tree: ast.AST) -> set[str]:
    names = set(CONFIG_NAMES)
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            if "ExperimentConfig" in ast.unparse(node.annotation):
                names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and "ExperimentConfig" in ast.unparse(node.annotation):
            target = node.target
            names.add(target.attr if isinstance(target, ast.Attribute) else ast.unparse(target))
    return names


def config_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, expression) of every ``X.plan`` / ``X.models`` / ``X.cluster`` whose ``X`` is a name or an attribute
    called as the experiment config is (``CONFIG_NAMES``, or annotated ``ExperimentConfig`` in the file)."""
    names = _config_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PLANNING_SECTIONS:
            base = node.value
            if (isinstance(base, ast.Name) and base.id in names) or (isinstance(base, ast.Attribute)
                                                                    and base.attr in names):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_runtime_reads_no_planning_section_of_the_config():
    modules = _modules()
    offenders = {name: reads for name, path in modules.items() if _in(name, "restage.runtime")
                 and (reads := config_reads(ast.parse(path.read_text(), str(path))))}
    assert offenders == {}, _listing(offenders)


def test_config_reads_finds_a_planted_read():
    planted = ast.parse("""
def f(cfg, schedule, run: ExperimentConfig):
    a = cfg.plan.execution          # read
    b = self.cfg.models["actor"]    # read
    c = run.cluster.name            # read: annotated ExperimentConfig
    d = schedule.models["actor"]    # the schedule: fine
    e = cfg.run.steps               # not a planning section
""")
    assert [line for line, _ in config_reads(planted)] == [3, 4, 5]


# --- Kinds are compared and matched as enum members, never as strings ----------------------------------------------

# The strings that name a kind or the execution mode, read from the enums and op classes themselves.
KIND_VALUES = frozenset({k.value for k in MFCKind} | {k.value for k in DatasetKind} | {e.value for e in Execution}
                        | {op.kind for op in typing.get_args(Op)})
PLAN_MODE_VALUES = frozenset(m.value for m in PlanMode)  # only for the config's own ``X.plan.mode``
# What holds a kind: an attribute or a name called kind / execution / mode (or ending in _kind, _mode).
KIND_HOLDER = re.compile(r"(^|_)(kind|execution|mode)$")


def _kind_values(node: ast.expr) -> frozenset[str]:
    """The strings that would name what ``node`` holds; empty when it holds no kind."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    if not KIND_HOLDER.search(name):
        return frozenset()
    plan_mode = (isinstance(node, ast.Attribute) and node.attr == "mode" and isinstance(node.value, ast.Attribute)
                 and node.value.attr == "plan")
    return KIND_VALUES | PLAN_MODE_VALUES if plan_mode else KIND_VALUES


def _kind_strings(node: ast.expr | ast.pattern, values: frozenset[str]) -> bool:
    """A string literal among ``values``, or a tuple / list / set of literals with one among them."""
    match node:
        case ast.Constant(value=str(value)) | ast.MatchValue(value=ast.Constant(value=str(value))):
            return value in values
        case ast.Tuple(elts=items) | ast.List(elts=items) | ast.Set(elts=items):
            return any(_kind_strings(item, values) for item in items)
        case ast.MatchOr(patterns=patterns):
            return any(_kind_strings(p, values) for p in patterns)
        case ast.MatchAs(pattern=inner) if inner is not None:
            return _kind_strings(inner, values)
    return False


def kind_string_compares(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, code) of each comparison (==, !=, in, not in, is) of a kind holder (``KIND_HOLDER``) with a string that
    names a kind or the execution mode (``KIND_VALUES``; the config's ``plan.mode`` also with ``PLAN_MODE_VALUES``),
    and each ``match`` on a kind holder with such a string among its patterns."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_kind_strings(b, _kind_values(a)) or _kind_strings(a, _kind_values(b))
                   for a, b in zip(sides, sides[1:])):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Match) and (values := _kind_values(node.subject)):
            if any(_kind_strings(case.pattern, values) for case in node.cases):
                found.append((node.lineno, f"match {ast.unparse(node.subject)}"))
    return sorted(found)


def test_no_kind_or_mode_is_compared_with_a_string():
    offenders = {name: compares for name, path in _modules().items()
                 if (compares := kind_string_compares(ast.parse(path.read_text(), str(path))))}
    assert offenders == {}, _listing(offenders)


def test_kind_string_compares_finds_planted_ones():
    planted = ast.parse("""
if mfc.kind == "generate": pass                      # 2: an MFC kind
if "async" != cfg.plan.execution: pass               # 3: the execution mode, either side
if op.kind in ("realloc", "transfer"): pass          # 4: op kinds
match ds.kind:                                       # 5: a dataset kind as a string pattern
    case "sft" | "preference": pass
if exec_mode == "sync": pass                         # 7: a name ending in _mode
if cfg.plan.mode != "manual": pass                   # 8: the config's plan mode
if outcome.mode == "manual": pass                    # fine: a planner's own Literal, not the config's enum
if mfc.kind is MFCKind.GENERATE: pass                # fine: the member
if estimator_kind == "k1": pass                      # fine: not a kind of ours
if dtype.kind == "O": pass                           # fine: numpy's
match mfc.kind:
    case MFCKind.TRAIN_STEP: pass                    # fine
""")
    assert [line for line, _ in kind_string_compares(planted)] == [2, 3, 4, 5, 7, 8]
