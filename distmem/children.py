"""Every Python child distmem starts of its own (the estimator's child, the CUDA-context probe,
``distmem doctor``'s Horovod probe) is started here, with an isolated import path.

``python -m x`` and ``python -c ...`` put the working folder first on ``sys.path``, and so does an
empty or relative ``PYTHONPATH`` entry (``PYTHONPATH=.``): run from a shared folder, a child would
import a ``distmem/``, ``torch/`` or ``sitecustomize.py`` another user left there, as this user. A
child started by :func:`run` instead

* has no working folder, script folder, empty or relative entry on its path, on every Python
  version (what ``-P`` does from 3.11; the bootstrap removes the entry ``-c`` adds before anything
  is imported, and the child's ``PYTHONPATH`` keeps only absolute entries);
* finds distmem where this process found it: the folder that holds this package, by absolute
  path, first (so a tree run with ``PYTHONPATH=.`` works the same);
* keeps everything else of the user's: absolute ``PYTHONPATH`` entries, site-packages, the user
  site folder, ``PYTHON*`` settings (which ``-I`` would drop);
* may search ``extra_paths`` (absolute folders) after all of those: the estimator's child finds the
  user's own model module there, and an installed package of the same name still wins.

Nothing here runs at import; it is a leaf (standard library only).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence

__all__ = ["run", "argv", "environment", "package_root", "import_folders", "working_folder_entries"]

#: Runs first in every child: drops the entry ``-c`` put at ``sys.path[0]`` (none under ``-P`` /
#: ``PYTHONSAFEPATH``) and any relative one, puts distmem's folder first and the extra folders last,
#: then runs the module or the code as ``__main__`` with the caller's arguments.
_BOOTSTRAP = """\
import os, sys
if not getattr(sys.flags, "safe_path", False):
    del sys.path[0]
sys.path[:] = [p for p in sys.path if p and os.path.isabs(p)]
import json
_spec = json.loads(sys.argv[1])
sys.path[:0] = [p for p in _spec["first"] if p not in sys.path]
sys.path += [p for p in _spec["last"] if p not in sys.path]
sys.argv = [sys.argv[0]] + sys.argv[2:]
if _spec["module"]:
    import runpy
    runpy.run_module(_spec["module"], run_name="__main__", alter_sys=True)
else:
    _code = compile(_spec["code"], "<distmem child>", "exec")
    del _spec
    exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


def package_root() -> str:
    """The folder that holds this ``distmem`` package (absolute, links resolved)."""
    return os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _absolute(paths: Sequence[str]) -> List[str]:
    return [p for p in paths if p and os.path.isabs(p)]


def environment(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``env`` (default: this process's) with ``PYTHONPATH`` made safe: distmem's folder first, then
    the absolute entries; empty and relative ones (each means a working folder) dropped."""
    out = dict(os.environ if env is None else env)
    entries = [package_root()] + _absolute((out.get("PYTHONPATH") or "").split(os.pathsep))
    out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(entries))
    return out


def argv(*, module: Optional[str] = None, code: Optional[str] = None, args: Sequence[str] = (),
         python: Optional[str] = None, extra_paths: Sequence[str] = ()) -> List[str]:
    """The command line of an isolated child running ``module`` (as ``python -m`` would) or ``code``
    (as ``python -c`` would) with ``args``, under ``python`` (default: this interpreter)."""
    if (module is None) == (code is None):
        raise ValueError("give exactly one of module= and code=")
    spec = {"module": module, "code": code, "first": [package_root()], "last": _absolute(extra_paths)}
    return [python or sys.executable, "-c", _BOOTSTRAP, json.dumps(spec), *args]


def run(*, module: Optional[str] = None, code: Optional[str] = None, args: Sequence[str] = (),
        python: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
        extra_paths: Sequence[str] = (), **options: Any) -> "subprocess.CompletedProcess[Any]":
    """Start the isolated child (:func:`argv`, :func:`environment`) and wait for it:
    ``subprocess.run`` with ``options`` (``input``, ``capture_output``, ``text``, ``timeout``...)."""
    return subprocess.run(argv(module=module, code=code, args=args, python=python, extra_paths=extra_paths),
                          env=environment(env), **options)


def working_folder_entries(path: Optional[Sequence[str]] = None) -> List[str]:
    """The entries of ``path`` (default ``sys.path``) that mean the working folder without the user
    having put it there: ``""`` and relative entries (``python -c``, ``PYTHONPATH=.``), and the
    working folder itself unless the user's ``PYTHONPATH`` names it by its absolute path
    (``python -m`` puts it first). A user's own module is never searched for there."""
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = ""
    named = {os.path.normpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.isabs(p)}
    return [p for p in (sys.path if path is None else path) if not p or not os.path.isabs(p)
            or (os.path.normpath(p) == cwd and cwd not in named)]


def import_folders(*modules: str) -> List[str]:
    """The folders this process would import each top-level module of ``modules`` from (``a.b`` ->
    the folder that holds ``a``), found without importing anything and never in the working folder
    (:func:`working_folder_entries`); names it cannot find are left out. For a child that must
    import the same user module as this process."""
    import importlib.machinery

    out: List[str] = []
    hidden = working_folder_entries()
    search = [p for p in sys.path if p not in hidden]
    for name in modules:
        top = (name or "").strip().partition(".")[0]
        if not top.isidentifier():
            continue
        try:
            spec = (importlib.util.find_spec(top) if top in sys.modules
                    else importlib.machinery.PathFinder.find_spec(top, search))
        except (ImportError, ValueError, AttributeError):
            continue
        if spec is None:
            continue
        places = list(spec.submodule_search_locations or [])  # a package: its folder(s)
        if places:
            folders = [os.path.dirname(os.path.abspath(p)) for p in places]
        elif spec.has_location and spec.origin:
            folders = [os.path.dirname(os.path.abspath(spec.origin))]
        else:
            folders = []  # built in or frozen: on every path already
        out += [f for f in folders if f not in out]
    return out
