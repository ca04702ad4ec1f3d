"""Shared state of fake GPUs for CPU dry runs of the GPU harness (DISTMEM_FAKE_GPU=1).

Several processes (mpirun ranks) see the same GPUs: one JSON file under ``DISTMEM_FAKE_GPU_DIR``,
guarded by ``flock``, holds each live process's context and allocations per GPU. The numbers follow
an H200 with CUDA 13: NVML total 143771 MiB, of which the driver keeps 606 MiB (CUDA reports the
rest), 612 MiB per process once CUDA starts and 148 MiB more after cuBLAS/cuDNN ran a step.
Not a model of PyTorch's allocator: it exists to run the harness's plumbing without a GPU.
"""
import contextlib
import fcntl
import json
import os

__all__ = ["MiB", "COUNT", "NVML_TOTAL", "DRIVER_RESERVED", "CUDA_TOTAL", "CTX_INIT", "CTX_STEP",
           "transact", "snapshot", "uuid"]

MiB = 1024 ** 2
COUNT = int(os.environ.get("DISTMEM_FAKE_GPU_COUNT", "2"))
NVML_TOTAL = int(os.environ.get("DISTMEM_FAKE_GPU_TOTAL_MIB", "143771")) * MiB
DRIVER_RESERVED = int(os.environ.get("DISTMEM_FAKE_GPU_RESERVED_MIB", "606")) * MiB
CUDA_TOTAL = NVML_TOTAL - DRIVER_RESERVED
CTX_INIT = int(os.environ.get("DISTMEM_FAKE_GPU_CTX_MIB", "612")) * MiB
CTX_STEP = 148 * MiB
DIR = os.environ.get("DISTMEM_FAKE_GPU_DIR", "/tmp/distmem-fakegpu")


def uuid(i: int) -> str:
    return f"{i:08x}-fa6e-4a11-8000-00000000000{i % 10}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@contextlib.contextmanager
def transact():
    """Lock, load, yield the state ({"gpus": {"0": {"pid": {"ctx": b, "mem": b}}}}), save."""
    os.makedirs(DIR, exist_ok=True)
    with open(os.path.join(DIR, "lock"), "a+") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        path = os.path.join(DIR, "state.json")
        try:
            with open(path) as f:
                st = json.load(f)
        except (OSError, ValueError):
            st = {"gpus": {}}
        for i in range(COUNT):
            procs = st["gpus"].setdefault(str(i), {})
            for pid in [p for p in procs if not _alive(int(p))]:
                del procs[pid]
        yield st
        tmp = path + f".{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(st, f)
        os.replace(tmp, path)
        fcntl.flock(lk, fcntl.LOCK_UN)


def snapshot():
    with transact() as st:
        return json.loads(json.dumps(st))
