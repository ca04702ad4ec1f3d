"""What every bench shares, written once: this tree on ``sys.path``, the launchers beside the
interpreter, where results live, and the one JSON line a bench prints.

A bench lives in the room of the package part it measures (``bench/estimate/``, ``bench/plan/``,
``bench/guard/``, ``bench/comm/``, ``bench/report/``, ``bench/native/``); results stay flat in
``bench/results/``. A bench starts with the two lines that make ``bench`` importable, run as
``python bench/ROOM/NAME.py`` from anywhere::

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from bench import runner  # noqa: E402

after which ``distmem`` is this tree's (not an installed one) and another bench is imported by its
room: ``from bench.comm import faults``.

The line: every bench prints one JSON line, ``{"bench": NAME, "figure": ..., "peer": ..., "ratio":
...}`` - the figure, the strongest peer or baseline measured in the same run, their ratio - plus
what else the bench reports; :func:`emit` prints it and, given ``--out``, keeps it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any, Dict, Optional

__all__ = ["ROOT", "RESULTS", "results_path", "env_bin", "tool", "line", "emit", "write_json", "add_out"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def results_path(name: str) -> str:
    """``bench/results/NAME`` of this tree (results are one flat folder, whatever the bench's room)."""
    return os.path.join(RESULTS, name)


def env_bin() -> str:
    """The folder of the environment's tools: ``DISTMEM_ENV_BIN`` (set by ``make test``) or this
    interpreter's own ``bin/``."""
    return os.environ.get("DISTMEM_ENV_BIN") or os.path.dirname(sys.executable)


def tool(name: str) -> str:
    """A launcher (``mpirun``, ``horovodrun``, ``torchrun``) beside this interpreter, else on PATH."""
    here = os.path.join(env_bin(), name)
    found = here if os.path.exists(here) else shutil.which(name)
    if not found:
        raise SystemExit(f"{os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)}: {name} not found beside "
                         f"{sys.executable} or on PATH; use the main environment (scripts/env.sh main)")
    return found


def line(bench: str, figure: Any, peer: Any = None, ratio: Any = None, **more: Any) -> Dict[str, Any]:
    """The bench's JSON line: its figure, the peer measured in the same run and their ratio
    (``figure / peer`` when both are numbers and no ratio is given), then ``more``."""
    if ratio is None and isinstance(figure, (int, float)) and isinstance(peer, (int, float)) and peer:
        ratio = round(figure / peer, 4)
    return {"bench": bench, "figure": figure, "peer": peer, "ratio": ratio, **more}


def write_json(path: str, obj: Any, indent: Optional[int] = 1) -> None:
    """``obj`` as a JSON file at ``path`` (its folder made); ``.jsonl`` appends one line instead."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    if path.endswith(".jsonl"):
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")
        return
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")


def emit(row: Dict[str, Any], out: Optional[str] = None, full: Any = None,
         indent: Optional[int] = 1) -> Dict[str, Any]:
    """Print ``row`` as one JSON line (flushed) and, given ``out``, keep ``full`` there (the whole
    result, rows and all; ``row`` itself when not given) with :func:`write_json`."""
    print(json.dumps(row), flush=True)
    if out:
        write_json(out, row if full is None else full, indent)
    return row


def add_out(parser: argparse.ArgumentParser, help: str = "also write the result (JSON) here; "
            "a .jsonl file gets the line appended") -> None:
    """The ``--out`` option every bench takes."""
    parser.add_argument("--out", default=None, help=help)
