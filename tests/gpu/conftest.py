"""GPU tests: they run on any number of GPUs from one - the ranks of a case share the GPUs the machine
has - and skip without a GPU (decided once per session, in a subprocess, so this process never starts
CUDA). A test marked ``gpus(n)`` needs n GPUs and skips on fewer, saying how many the machine has.
With DISTMEM_REQUIRE_GPU=1 a test that would skip because NVML sees no GPU at all fails instead.

With DISTMEM_GPU_RESULTS=FILE every test's outcome (passed, failed, skipped with the reason, seconds)
is written to FILE as JSON when the session ends; tests/gpu/run_gpu.sh builds its suite summary from it
(tests/gpu/progs/minitest.py writes the same where pytest is missing)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "progs"))

from launch import gpu_count, write_results  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
_ids = set()
_outcomes = {}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): needs at least n GPUs (default 1; 0: runs without a GPU)")


def _ours(item) -> bool:
    return str(item.fspath).startswith(HERE + os.sep)


def pytest_collection_modifyitems(config, items):
    _ids.update(item.nodeid for item in items if _ours(item))


def need_of(item) -> int:
    mark = item.get_closest_marker("gpus")
    return mark.args[0] if mark else 1


def pytest_runtest_setup(item):
    if not _ours(item):
        return
    need, have = need_of(item), gpu_count()
    if have >= need:
        return
    if have == 0 and os.environ.get("DISTMEM_REQUIRE_GPU") == "1":
        pytest.fail(f"DISTMEM_REQUIRE_GPU=1 but NVML sees no GPU; this test needs {need}", pytrace=False)
    pytest.skip(f"needs {need} GPUs; this machine has {have}")


def pytest_runtest_logreport(report):
    if report.nodeid not in _ids:
        return
    row = _outcomes.setdefault(report.nodeid, {"id": report.nodeid, "outcome": "passed", "seconds": 0.0})
    row["seconds"] = round(row["seconds"] + report.duration, 2)
    if report.failed:
        row["outcome"] = "failed"
        row["reason"] = str(report.longrepr)[-2000:]
    elif report.skipped and row["outcome"] != "failed":
        row["outcome"] = "skipped"
        longrepr = report.longrepr
        row["reason"] = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    if report.when == "teardown" and os.environ.get("DISTMEM_GPU_RESULTS"):
        # after every test: a run cut short by its time limit still says what finished
        write_results(os.environ["DISTMEM_GPU_RESULTS"], "pytest", list(_outcomes.values()), complete=False)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("DISTMEM_GPU_RESULTS")
    if not path:
        return
    write_results(path, "pytest", list(_outcomes.values()))

