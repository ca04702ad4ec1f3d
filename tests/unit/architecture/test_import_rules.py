"""The package's import rule, checked on the source: imports run one way through the stages
(discover -> comm -> estimate -> plan -> apply -> observe -> report -> guard -> cli), leaves may be
imported from anywhere, only the package ``__init__`` and ``cli/`` import the facade ``api`` (or the package root)
or the framework integrations (``distmem.keras``), and no module cycle exists - lazy imports inside
functions included (``if TYPE_CHECKING:`` blocks excluded: they never run). ``tests/unit`` mirrors the
package: one folder per stage."""
from __future__ import annotations

import ast
import os
from typing import Dict, List, Optional, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PKG = os.path.join(ROOT, "distmem")

#: Modules with no distmem dependencies beyond other leaves; anything may import them.
LEAVES = {"errors", "units", "costs", "settings", "defaults", "session", "console", "bounded", "children", "untrusted"}
#: Stages in flow order: a module may import its own stage and earlier ones.
STAGES = ["discover", "comm", "estimate", "plan", "apply", "observe", "report", "guard", "cli"]
#: Public framework integrations over the stages (like the facade): they may import any stage, and only
#: the package root and cli/ import them.
INTEGRATIONS = {"keras"}

Edge = Tuple[str, str, str, int]  # (importer, imported, file, line)


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel)


def all_modules() -> Dict[str, str]:
    out = {}
    for base, _, files in os.walk(PKG):
        if "__pycache__" in base:
            continue
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(base, f)
                out[module_name(path)] = path
    return out


class _Imports(ast.NodeVisitor):
    def __init__(self) -> None:
        self.found: List[Tuple[ast.AST, int]] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node, node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node, node.lineno))


def edges_of(mod: str, path: str, modules: Dict[str, str], source: Optional[str] = None) -> List[Edge]:
    tree = ast.parse(source if source is not None else open(path, encoding="utf-8").read())
    v = _Imports()
    v.visit(tree)
    is_pkg = path.endswith("__init__.py")
    out: List[Edge] = []
    for node, line in v.found:
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                parts = mod.split(".")
                base = parts if is_pkg else parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                absmod = ".".join(base + ([node.module] if node.module else []))
            else:
                absmod = node.module or ""
            for a in node.names:
                sub = f"{absmod}.{a.name}"
                targets.append(sub if sub in modules else absmod)
        for t in targets:
            if t == "distmem" or t.startswith("distmem."):
                while t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t != mod:
                    out.append((mod, t, os.path.relpath(path, ROOT), line))
    return out


def top(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def violation(edge: Edge) -> Optional[str]:
    src, dst, path, line = edge
    s, d = top(src), top(dst)
    where = f"{path}:{line} imports {dst}"
    if s in ("__init__", "__main__"):
        return None  # the package root re-exports the public API; `python -m distmem` runs the command line
    if d == "api" or d in INTEGRATIONS:
        return None if s == "cli" else f"{where}: only distmem/__init__.py and cli/ may import the facade or {dst}"
    if d == "__init__":
        return None if s == "cli" else f"{where}: a module inside the package must not import the package root"
    if d in LEAVES:
        return None
    if s in LEAVES:
        return f"{where}: leaf module distmem.{s} must not import a stage ({d})"
    if s == "api" or s in INTEGRATIONS:
        return None
    if s not in STAGES or d not in STAGES:
        return f"{where}: {s} or {d} is not a known stage; add it to STAGES or LEAVES in this test"
    if STAGES.index(d) > STAGES.index(s):
        return f"{where}: stage {s} may not import the later stage {d} (order: {' -> '.join(STAGES)})"
    return None


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(n: str) -> Optional[List[str]]:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def check(modules: Dict[str, str], sources: Optional[Dict[str, str]] = None) -> List[str]:
    problems: List[str] = []
    graph: Dict[str, Set[str]] = {}
    where: Dict[Tuple[str, str], str] = {}
    for mod, path in sorted(modules.items()):
        for e in edges_of(mod, path, modules, (sources or {}).get(mod)):
            msg = violation(e)
            if msg:
                problems.append(msg)
            graph.setdefault(e[0], set()).add(e[1])
            where.setdefault((e[0], e[1]), f"{e[2]}:{e[3]}")
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle) + " (first edge at "
                        + where[(cycle[0], cycle[1])] + ")")
    return problems


def test_the_package_follows_the_import_rule():
    problems = check(all_modules())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module, line, expect", [
    ("distmem.apply.torch", "from ..api import current_plan", "only distmem/__init__.py and cli/ may import the facade"),
    ("distmem.discover.identity", "from ..plan import make_plan", "stage discover may not import the later stage plan"),
    ("distmem.settings", "from .discover.identity import detect", "leaf module distmem.settings must not import"),
    ("distmem.report.findings", "from ..keras import MemoryReport", "may import the facade or distmem.keras"),
    ("distmem.comm.base", "from .. import api", "only distmem/__init__.py and cli/ may import the facade"),
])
def test_a_backward_import_is_named_with_its_file_and_line(module, line, expect):
    """The rule can fail: insert one backward import (inside a function, as lazy imports are)."""
    modules = all_modules()
    src = open(modules[module], encoding="utf-8").read() + f"\n\ndef _inserted():\n    {line}\n"
    problems = check(modules, {module: src})
    n = src.count("\n")
    assert any(expect in p and f":{n}" in p for p in problems), problems


def test_a_cycle_is_found():
    modules = all_modules()
    src = open(modules["distmem.plan.types"], encoding="utf-8").read() + "\n\ndef _x():\n    from .budget import slot\n"
    problems = check(modules, {"distmem.plan.types": src})
    assert any(p.startswith("import cycle:") and "distmem.plan.types" in p for p in problems), problems


def test_every_module_declares_all_and_no_private_name_crosses_modules():
    problems = []
    for mod, path in sorted(all_modules().items()):
        tree = ast.parse(open(path, encoding="utf-8").read())
        rel = os.path.relpath(path, ROOT)
        if mod != "distmem.cli.__main__" and not any(
                isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
                or isinstance(n, ast.ImportFrom) and any(a.name == "__all__" for a in n.names)
                for n in tree.body):
            problems.append(f"{rel}: no __all__ (internal modules say __all__ = [])")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("distmem")):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        problems.append(f"{rel}:{node.lineno} imports the private name {a.name} from another module")
    assert not problems, "\n".join(problems)


def test_unit_tests_mirror_the_package():
    """Every folder of tests/unit is a folder of the package (or this architecture folder), and every
    test module sits in the folder of the stage it tests: a test moved or a stage renamed shows here."""
    unit = os.path.join(ROOT, "tests", "unit")
    stages = {d for d in os.listdir(PKG) if os.path.isdir(os.path.join(PKG, d)) and d != "__pycache__"}
    folders = {d for d in os.listdir(unit) if os.path.isdir(os.path.join(unit, d)) and d != "__pycache__"}
    stray = sorted(folders - stages - {"architecture"})
    assert not stray, f"tests/unit folders {stray} name no folder of distmem/ ({sorted(stages)})"
    for base, dirs, files in os.walk(unit):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = os.path.relpath(base, unit)
        if rel in (".", "architecture"):
            continue
        assert os.path.isdir(os.path.join(PKG, rel)), f"tests/unit/{rel} has no distmem/{rel} to mirror"
