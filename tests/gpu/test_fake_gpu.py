"""The CPU harness's fake GPU (tests/gpu/progs/fakegpu, ``DISTMEM_FAKE_GPU=1``) answers every NVML call
distmem makes: one it lacked (``nvmlDeviceGetHandleByUUID``) failed 7 tests of docs/torch.md's
``DISTMEM_FAKE_GPU=1 ... tests/gpu/run_gpu.sh``. The names are read from distmem's source (every
``nvml...`` name handed to its one NVML binding). And that binding treats a function the installed
pynvml lacks as "not supported": the query's default, never an AttributeError in a report.
Runs without a GPU."""
import ast
import importlib.util
import os
import re
import sys
from types import SimpleNamespace

import pytest

from distmem.discover import nvml

pytestmark = pytest.mark.gpus(0)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FAKE = os.path.join(HERE, "progs", "fakegpu")
_NAME = re.compile(r"^nvml[A-Z]\w*$")


def nvml_names():
    """Every NVML function or constant name distmem's source spells out."""
    found = set()
    for base, _, files in os.walk(os.path.join(ROOT, "distmem")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(base, f), encoding="utf-8") as src:
                    tree = ast.parse(src.read())
                found |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                          and isinstance(n.value, str) and _NAME.match(n.value)}
    return found


def _fake_pynvml():
    sys.path.insert(0, FAKE)
    try:
        spec = importlib.util.spec_from_file_location("fake_pynvml", os.path.join(FAKE, "pynvml.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(FAKE)
        sys.modules.pop("state", None)


def test_the_fake_answers_every_nvml_call_distmem_makes():
    names = nvml_names()
    assert {"nvmlDeviceGetHandleByUUID", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses"} <= names
    fake = _fake_pynvml()
    missing = sorted(n for n in names if not hasattr(fake, n))
    assert not missing, f"tests/gpu/progs/fakegpu/pynvml.py lacks {missing}, which distmem calls"


def test_a_function_the_binding_lacks_is_not_supported(monkeypatch):
    monkeypatch.setitem(nvml._state, "init", True)
    monkeypatch.setattr(nvml, "nvml_handle_module", lambda: SimpleNamespace(nvmlInit=lambda: None))
    assert nvml.nvml_query("nvmlDeviceGetHandleByUUID", "GPU-0", default=None) is None
    try:  # no default: the caller asked to hear it
        nvml.nvml_query("nvmlDeviceGetHandleByUUID", "GPU-0")
    except AttributeError:
        pass
    else:
        raise AssertionError("a query without a default must raise what the binding raised")
