"""The OOM guard on real GPUs: `mpirun -np 2`, a real CUDA OOM on rank 1 only (a per-process limit
from torch.cuda.set_per_process_memory_fraction, calibrated between the peaks of the two micro-batch
sizes), nothing injected. The program asserts on every rank; this test checks that it finished in time,
that every rank passed, and that the allocator's own error drove the fallback.

    PYTHONPATH=. python3 -m pytest tests/gpu/test_guard_gpu.py
"""
import json
import os
import shutil
import time

import pytest

from helpers import mpirun

PROG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guard_progs", "guard_real_oom.py")


def _evidence(data):
    """One JSON line for tests/gpu/run_gpu.sh's evidence file, when it asks for one."""
    path = os.environ.get("DISTMEM_GPU_EVIDENCE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"name": "guard-real-oom-np2", "time": time.time(), **data}, default=str) + "\n")


@pytest.mark.gpus(1)
def test_real_oom_on_one_rank_keeps_both_ranks_in_step():
    pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun (Open MPI) is not installed")
    env = {"DISTMEM_TIMEOUT": "120", "DISTMEM_QUIET": "0", "NCCL_NVLS_ENABLE": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    res = mpirun(2, [PROG], timeout=420, env=env)
    line = next((ln for ln in res.out.splitlines() if "GUARD_GPU_RESULT " in ln), None)
    _evidence({"rc": res.rc, "timed_out": res.timed_out, "seconds": round(res.seconds, 1),
               "result": json.loads(line.split("GUARD_GPU_RESULT ", 1)[1]) if line else None,
               "log_tail": None if line and res.rc == 0 else res.out[-3000:]})
    assert not res.timed_out, f"the guarded job hung (killed after {res.seconds:.0f} s)\n{res.out[-6000:]}"
    assert res.rc == 0, f"a rank failed (exit code {res.rc})\n{res.out[-8000:]}"
    assert line is not None, f"rank 0 printed no result\n{res.out[-6000:]}"
    result = json.loads(line.split("GUARD_GPU_RESULT ", 1)[1])
    assert result["fallbacks"][0][1] == [1] and result["micro_after"] < result["micro_before"]
    assert "CUDA out of memory" in result["oom_message"] or "out of memory" in result["oom_message"].lower()
    print(line)
