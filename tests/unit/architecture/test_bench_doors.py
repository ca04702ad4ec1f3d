"""Every figure the docs quote comes from a bench that asks a public door: the benches are read
(their code, and the child programs they carry as strings), and an import of the planner's
internals fails - a bench hands the door a model built as users build one and takes the door's
answer as the product, never computes with what the door computes itself.

The doors: the ``distmem`` command (a subprocess, or ``distmem.cli.main`` in the bench's own
process), ``distmem``'s public names (``distmem.__all__``: ``init``, ``plan_from_env``, ``fit``,
...), and ``distmem.estimate``'s (its ``__all__``: ``estimate``, and ``estimate_keras`` /
``estimate_torch``, which README "Per-layer estimates" documents as the package's functions for a
built model; ``estimate(method="model")`` hands a live model to them unchanged, so their answer is
the door's). The planner's internals: ``distmem.plan`` and everything under it (``rank_peak``,
``ModelState``, ``wrapper_demand``, ``plan.fit.costs``' ``EstimateCosts`` / ``LayerListCosts``, the
partition), ``distmem.costs``, ``distmem.defaults``, ``distmem.api`` (the doors' wiring: take the
names from ``distmem``), and every module under ``distmem.estimate`` (dispatch, ``Tracker``,
allocators, liveness, kernels, the measured path's rules). What is not the planner - the guard,
the transports, discovery, snapshots, reports, the native cap - is measured by benches for its
own cost and is free to import.

A bench that measures an internal on purpose says so in its docstring, with the reason::

    distmem-bench: internal - <why: what it measures, and that no product figure comes from it>

and then no README/docs figure may cite a results file it writes (by path, or a
``distmem-figure`` marker)."""
from __future__ import annotations

import ast
import glob
import os
import re
from typing import Iterator, List, Optional, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCH = os.path.join(ROOT, "bench")
RESULTS = os.path.join(BENCH, "results")

#: Modules (and everything under them) a bench may not import: the planner's internals.
INTERNAL = ("distmem.plan", "distmem.costs", "distmem.defaults", "distmem.api")
MARKER = re.compile(r"^\s*distmem-bench:\s*internal\b[\s:-]*(.*)$", re.M)
_CODE_LINE = re.compile(r"^\s*(?:from\s+distmem[\w.]*\s+import\s+[^\n]+|import\s+distmem[\w.]*[^\n]*)$", re.M)
_DOTTED = re.compile(r"^distmem(?:\.\w+)+$")


def _all_of(path: str) -> Set[str]:
    """A module's ``__all__`` read from its source (importing distmem.estimate would start TensorFlow)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    out: Set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("__all__", "LAZY_MODULES")
                                                for t in node.targets):
            out |= {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return out


DOORS = {"distmem": _all_of(os.path.join(ROOT, "distmem", "__init__.py")),
         "distmem.estimate": _all_of(os.path.join(ROOT, "distmem", "estimate", "__init__.py"))}


def internal(dotted: str) -> Optional[str]:
    """Why ``dotted`` (a module, or a module's name) is the planner's internal; None for a door or
    a part that is not the planner."""
    for prefix in INTERNAL:
        if dotted == prefix or dotted.startswith(prefix + "."):
            return f"{prefix} is the planner's internals"
    parts = dotted.split(".")
    if parts[:2] == ["distmem", "estimate"] and len(parts) > 2 and parts[2] not in DOORS["distmem.estimate"]:
        return ("distmem.estimate's door is its __all__ (" + ", ".join(sorted(DOORS["distmem.estimate"]))
                + f"); {parts[2]} is not")
    return None


def benches() -> List[str]:
    return sorted(p for p in glob.glob(os.path.join(BENCH, "*", "*.py")) if not p.endswith("__init__.py"))


def _imports(tree: ast.AST) -> Iterator[Tuple[str, int]]:
    """Every distmem name a tree imports or reaches by attribute (``distmem.plan.fit.x``), with its line."""
    aliases = {"distmem"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "distmem":
                    yield a.name, node.lineno
                    if a.asname:
                        aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "distmem" \
                and not node.level:
            for a in node.names:
                yield f"{node.module}.{a.name}", node.lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain: List[str] = []
            at: ast.AST = node
            while isinstance(at, ast.Attribute):
                chain.insert(0, at.attr)
                at = at.value
            if isinstance(at, ast.Name) and at.id == "distmem" and len(chain) > 1:
                yield "distmem." + ".".join(chain), node.lineno


def offences(source: str, where: str) -> List[str]:
    """Each import of the planner's internals in a bench's source, code carried in strings included."""
    tree = ast.parse(source)
    found = [(name, line) for name, line in _imports(tree)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if _DOTTED.match(text.strip()):  # importlib.import_module("distmem.plan.x"), python -m distmem.x
                found.append((text.strip(), node.lineno))
            for m in _CODE_LINE.finditer(text):
                try:
                    found += [(name, node.lineno) for name, _ in _imports(ast.parse(m.group(0).strip()))]
                except SyntaxError:
                    continue
    out = []
    for name, line in sorted(set(found), key=lambda x: x[1]):
        why = internal(name)
        if why:
            out.append(f"{where}:{line}: {name} ({why})")
    return out


def marker(source: str) -> Optional[str]:
    """The reason a bench gives for measuring an internal on purpose (its docstring's marker)."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    m = MARKER.search(doc)
    return m.group(1).strip() if m else None


def written_results(path: str, source: str) -> Set[str]:
    """The results files a bench writes: those its source names, those named after it, and those
    whose own text names it (a results file's command / how field)."""
    stem, rel = os.path.basename(path)[:-3], os.path.relpath(path, ROOT)
    names = set(re.findall(r"bench/results/([\w.\-/]+\.(?:json|jsonl|txt|log))", source))
    for f in glob.glob(os.path.join(RESULTS, "**", "*"), recursive=True):
        if not os.path.isfile(f):
            continue
        name = os.path.relpath(f, RESULTS)
        if os.path.basename(name).startswith(stem):
            names.add(name)
        elif os.path.getsize(f) < 4_000_000:
            with open(f, encoding="utf-8", errors="replace") as fh:
                if rel in fh.read():
                    names.add(name)
    return names


def _docs() -> List[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


BENCHES = benches()


def test_the_benches_are_found_in_their_rooms():
    rooms = {os.path.basename(os.path.dirname(p)) for p in BENCHES}
    assert {"estimate", "plan", "guard", "comm", "report", "native"} <= rooms, rooms
    assert len(BENCHES) >= 30


@pytest.mark.parametrize("path", BENCHES, ids=[os.path.relpath(p, BENCH) for p in BENCHES])
def test_a_bench_asks_a_public_door(path):
    source = open(path, encoding="utf-8").read()
    rel = os.path.relpath(path, ROOT)
    found = offences(source, rel)
    reason = marker(source)
    if reason is not None:
        assert len(reason.split()) >= 5, (
            f"{rel}: its 'distmem-bench: internal' marker needs the reason (what it measures on purpose, and "
            f"that no product figure comes from it), got {reason!r}")
        return
    assert not found, (
        f"{rel} computes with the planner's internals instead of asking a door:\n  " + "\n  ".join(found)
        + "\nAsk the door (the distmem command, distmem.init / plan_from_env / fit, distmem.estimate's functions) "
          "about a model built as users build it; or, for a bench that measures an internal on purpose and whose "
          "figure the docs do not quote, say so in its docstring: 'distmem-bench: internal - REASON'")


MARKED = [p for p in BENCHES if marker(open(p, encoding="utf-8").read()) is not None]


@pytest.mark.parametrize("path", MARKED, ids=[os.path.relpath(p, BENCH) for p in MARKED])
def test_no_docs_figure_comes_from_an_internal_bench(path):
    source = open(path, encoding="utf-8").read()
    results = written_results(path, source)
    cited = []
    for doc in _docs():
        text = open(doc, encoding="utf-8").read()
        for name in results:
            for m in re.finditer(re.escape(f"bench/results/{name}"), text):
                cited.append(f"{os.path.relpath(doc, ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {name}")
    assert not cited, (f"{os.path.relpath(path, ROOT)} measures an internal (its marker says why), so the docs may "
                       "not quote its results as a product figure:\n  " + "\n  ".join(cited))


def test_the_rule_finds_an_internal_import_and_passes_a_door():
    """The check can fail: each way a bench reaches the planner's internals is found, the doors pass."""
    bad = {
        "from distmem.plan.wrappers import rank_peak": "distmem.plan",
        "from distmem.plan.fit.costs import EstimateCosts": "distmem.plan",
        "import distmem.estimate.torch.kernels as k": "__all__",
        "from distmem.estimate.allocators import BFCAllocator": "__all__",
        "from distmem.estimate import dispatch": "__all__",
        "from distmem import costs": "distmem.costs",
        "from distmem.api import plan_from_env": "distmem.api",
        "import distmem\nx = distmem.plan.partition.solve": "distmem.plan",
        "CHILD = '''\nimport sys\nfrom distmem.plan.fit.costs import LayerListCosts\n'''": "distmem.plan",
        "import importlib\nm = importlib.import_module('distmem.plan.partition')": "distmem.plan",
    }
    for source, why in bad.items():
        found = offences(source, "b.py")
        assert found and why in found[0], (source, found)
    good = ["import distmem\nplan = distmem.init(strategy='data')", "from distmem import fit, plan_from_env",
            "from distmem.estimate import estimate, estimate_torch", "import distmem.estimate\n"
            "e = distmem.estimate.estimate('keras:ResNet50', 32)", "from distmem.cli import main",
            "from distmem.guard.grads import gradient_reducer", "from distmem.report.aggregate import aggregate",
            "cmd = [sys.executable, '-m', 'distmem', 'plan', '--json']"]
    for source in good:
        assert offences(source, "b.py") == [], source
    assert marker('"""A bench.\n\n    distmem-bench: internal - replays the allocator trace, no product '
                  'figure\n"""') == "replays the allocator trace, no product figure"
    assert marker('"""A bench."""') is None
