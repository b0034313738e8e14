"""The package's structure: no import cycle anywhere in harness/, reference/ and cases/ (lazy
imports inside functions count: they run too), no folder-level cycle but the documented one
(``harness/targets/bundled.py`` bundles ``cases``, whose examples build targets), the library
never imports its own examples (``cases``) outside the modules that bundle them, at most 12
top-level modules in harness/, and ``import harness`` (the user API), the plugin and the rank
pool stay cheap to import (no torch) for projects that never start a rank."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("harness", "reference", "cases")
# The only library modules that may name cases.*: what bundles the examples as targets and
# strategies, and the CLI that lists and runs them.
MAY_IMPORT_CASES = {"harness.targets.bundled", "harness.search.builtins", "harness.cli"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = REPO.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (every import statement, at any depth). For
    ``from pkg import name`` the edge goes to ``pkg.name`` when that is a module, else to pkg."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = _module_name(path)
            is_package = path.name == "__init__.py"
            deps: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = name.split(".") if is_package else name.split(".")[:-1]
                        base = base[: len(base) - node.level + 1]
                        target = ".".join(base + ([node.module] if node.module else []))
                    else:
                        target = node.module or ""
                    if target.split(".")[0] not in PACKAGES:
                        continue
                    for alias in node.names:
                        sub = f"{target}.{alias.name}"
                        deps.add(sub if _is_module(sub) else target)
            deps.discard(name)
            graph[name] = {d for d in deps if _is_module(d)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_library_does_not_import_its_examples() -> None:
    graph = import_graph()
    offenders = {m: sorted(d for d in deps if d.split(".")[0] == "cases")
                 for m, deps in graph.items() if m.startswith("harness") and m not in MAY_IMPORT_CASES}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_the_plugin_and_the_pool_leave_torch_unloaded() -> None:
    code = "import sys, harness.pytest_plugin, harness.launch.pool; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


# The one folder-level cycle allowed: the bundled targets name the examples, and the examples
# build targets with harness.targets.target.
ALLOWED_FOLDER_CYCLES = [{"cases", "harness.targets"}]


def _room(module: str) -> str:
    """A module's room in the house: a folder of harness/ (``harness.analysis``), a top-level
    module of harness/ (``harness.run``), or a top-level package (``reference``, ``cases``)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "harness" else parts[0]


def test_folders_import_each_other_in_one_direction() -> None:
    graph: dict[str, set[str]] = {}
    for module, deps in import_graph().items():
        graph.setdefault(_room(module), set()).update(_room(d) for d in deps if _room(d) != _room(module))
    found = [set(c) for c in cycles(graph)]
    assert [c for c in found if c not in ALLOWED_FOLDER_CYCLES] == []


def test_at_most_twelve_top_level_modules() -> None:
    top = sorted(p.name for p in (REPO / "harness").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 12, top


def test_import_harness_is_torch_free_and_names_the_user_api() -> None:
    code = ("import sys, harness; print('torch' in sys.modules); "
            "print(all(getattr(harness, n) is not None for n in harness.__all__)); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True"], out.stderr
    import harness

    for name in ("assert_matches_reference", "CustomRun", "RankLayout", "ParallelDims", "Case", "diagnose_target",
                 "run_strategy", "StrategyBase", "simulate_target", "CODES"):
        assert name in harness.__all__
