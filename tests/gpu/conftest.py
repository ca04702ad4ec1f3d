"""GPU tests: skipped without a GPU (decided once per session, in a subprocess so this process never
starts CUDA); with DISTMEM_REQUIRE_GPU=1 a skip becomes a failure."""
import functools
import os
import subprocess
import sys

import pytest


@functools.lru_cache(maxsize=1)
def gpu_count() -> int:
    code = ("import pynvml\n"
            "try:\n pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())\n"
            "except Exception: print(0)\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
        return int(out.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001 - no NVML, no GPU
        return 0


def pytest_collection_modifyitems(config, items):
    n = gpu_count()
    required = os.environ.get("DISTMEM_REQUIRE_GPU") == "1"
    for item in items:
        if "gpu" + os.sep not in str(item.fspath):
            continue
        need = item.get_closest_marker("gpus")
        want = need.args[0] if need else 1
        if n >= want:
            continue
        reason = f"needs {want} GPU(s), NVML sees {n}"
        if required:
            item.add_marker(pytest.mark.usefixtures("_gpu_required"))
            item.user_properties.append(("gpu_missing", reason))
        else:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): needs at least n GPUs")


@pytest.fixture
def _gpu_required(request):
    reason = dict(request.node.user_properties).get("gpu_missing", "no GPU")
    pytest.fail(f"DISTMEM_REQUIRE_GPU=1 but this test would skip: {reason}")
