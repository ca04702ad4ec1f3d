"""Run GPU test files where pytest is not installed (the GPU machine may lack it and has no network).

    python tests/gpu/progs/minitest.py tests/gpu/test_pinning.py ... [--stub]

Supports what the GPU tests use: module and function marks (``gpus(n)`` as tests/gpu/conftest.py
reads it: skipped with fewer GPUs, a failure when DISTMEM_REQUIRE_GPU=1 and there is none), ``parametrize`` (with
``ids``), the ``tmp_path`` and ``monkeypatch`` fixtures, ``pytest.skip`` and ``pytest.fail``. With
real pytest importable it uses real pytest's exceptions; ``--stub`` forces the stand-in (to test
this runner). Exit code 1 when any test failed or none ran.
"""
import importlib.util
import itertools
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
ROOT = os.path.dirname(TESTS)


class Skipped(Exception):
    pass


class Failed(AssertionError):
    pass


class _Mark:
    def __init__(self, name, args=(), kwargs=None):
        self.name, self.args, self.kwargs = name, args, kwargs or {}

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # applied to a test function
            fn = args[0]
            fn.pytestmark = getattr(fn, "pytestmark", []) + [self]
            return fn
        return _Mark(self.name, args, kwargs)


class _MarkGen:
    def __getattr__(self, name):
        return _Mark(name)


def _stub_pytest():
    mod = types.ModuleType("pytest")
    mod.mark = _MarkGen()

    def skip(reason=""):
        raise Skipped(reason)

    def fail(reason=""):
        raise Failed(reason)

    def importorskip(name, *a, **k):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            raise Skipped(f"could not import {name}: {exc}")

    mod.skip, mod.fail, mod.importorskip = skip, fail, importorskip
    mod.fixture = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))
    return mod


class MonkeyPatch:
    def __init__(self):
        self._undo = []

    def setattr(self, obj, name, value, raising=True):
        old = getattr(obj, name, None)
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, old))

    def setitem(self, mapping, key, value):
        missing = key not in mapping
        old = mapping.get(key)
        mapping[key] = value
        self._undo.append(lambda: mapping.pop(key) if missing else mapping.__setitem__(key, old))

    def setenv(self, name, value):
        old = os.environ.get(name)
        os.environ[name] = str(value)
        self._undo.append(lambda: os.environ.pop(name) if old is None else os.environ.__setitem__(name, old))

    def delenv(self, name, raising=True):
        if name in os.environ:
            old = os.environ.pop(name)
            self._undo.append(lambda: os.environ.__setitem__(name, old))

    def undo(self):
        for fn in reversed(self._undo):
            fn()
        self._undo.clear()


def _marks(obj):
    m = getattr(obj, "pytestmark", [])
    return m if isinstance(m, list) else [m]


def gpu_count():
    code = "import pynvml\ntry:\n pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())\nexcept Exception: print(0)\n"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
        return int(out.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001
        return 0


def cases(fn, module_marks):
    marks = module_marks + _marks(fn)
    params = [m for m in marks if m.name == "parametrize"]
    combos = [({}, "")]
    for m in params:
        names = [n.strip() for n in m.args[0].split(",")] if isinstance(m.args[0], str) else list(m.args[0])
        values = list(m.args[1])
        ids = m.kwargs.get("ids")
        new = []
        for (kw, tag), (i, v) in itertools.product(combos, enumerate(values)):
            v = v if len(names) > 1 else (v,)
            label = ids[i] if ids else "-".join(str(x) for x in v)
            new.append(({**kw, **dict(zip(names, v))}, f"{tag}-{label}" if tag else label))
        combos = new
    need = max([m.args[0] for m in marks if m.name == "gpus"] or [1])
    return [(kw, tag, need) for kw, tag in combos]


def main(argv):
    stub = "--stub" in argv
    files = [a for a in argv if a != "--stub"]
    try:
        if stub:
            raise ImportError
        import pytest as real  # noqa: F401

        skip_types = (Skipped, real.skip.Exception)
        fail_types = (Failed, real.fail.Exception)
    except ImportError:
        sys.modules["pytest"] = _stub_pytest()
        skip_types, fail_types = (Skipped,), (Failed,)
    for p in (ROOT, TESTS, os.path.join(TESTS, "gpu"), HERE):
        if p not in sys.path:
            sys.path.insert(0, p)
    n_gpu = gpu_count()
    required = os.environ.get("DISTMEM_REQUIRE_GPU") == "1"
    results = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    rows = []
    for path in files:
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
        except BaseException:  # noqa: BLE001
            results["failed"] += 1
            failures.append((path, traceback.format_exc()))
            print(f"ERROR collecting {path}", flush=True)
            continue
        module_marks = _marks(mod)
        for attr in list(vars(mod)):  # definition order
            fn = getattr(mod, attr)
            if not (attr.startswith("test_") and callable(fn)):
                continue
            for kw, tag, need in cases(fn, module_marks):
                nodeid = f"{path}::{attr}" + (f"[{tag}]" if tag else "")
                t0 = time.monotonic()
                mp = MonkeyPatch()
                try:
                    if n_gpu < need:  # the rule of tests/gpu/conftest.py
                        if required and n_gpu == 0:
                            raise Failed(f"DISTMEM_REQUIRE_GPU=1 but NVML sees no GPU; this test needs {need}")
                        raise Skipped(f"needs {need} GPUs; this machine has {n_gpu}")
                    args = dict(kw)
                    params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
                    if "tmp_path" in params:
                        args["tmp_path"] = pathlib.Path(tempfile.mkdtemp(prefix="minitest-"))
                    if "monkeypatch" in params:
                        args["monkeypatch"] = mp
                    fn(**args)
                    outcome = "PASSED"
                except skip_types as exc:
                    outcome = f"SKIPPED ({exc})"
                except (AssertionError, Exception) + fail_types:  # noqa: B030
                    outcome = "FAILED"
                    failures.append((nodeid, traceback.format_exc()))
                finally:
                    mp.undo()
                key = outcome.split()[0].lower()
                results[key] = results.get(key, 0) + 1
                seconds = time.monotonic() - t0
                rows.append({"id": nodeid, "outcome": key, "seconds": round(seconds, 2)}
                            | ({"reason": outcome[len(key) + 2:-1]} if key == "skipped" else {})
                            | ({"reason": failures[-1][1][-2000:]} if key == "failed" else {}))
                print(f"{nodeid} {outcome} ({seconds:.1f} s)", flush=True)
                if os.environ.get("DISTMEM_GPU_RESULTS"):  # a run cut short still says what finished
                    from launch import write_results

                    write_results(os.environ["DISTMEM_GPU_RESULTS"], "minitest", rows, complete=False)
    for nodeid, tb in failures:
        print(f"\n_____ {nodeid} _____\n{tb}", flush=True)
    print(f"\nminitest: {results['passed']} passed, {results['failed']} failed, {results['skipped']} skipped",
          flush=True)
    if os.environ.get("DISTMEM_GPU_RESULTS"):
        from launch import write_results

        write_results(os.environ["DISTMEM_GPU_RESULTS"], "minitest", rows)
    return 1 if results["failed"] or not results["passed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
