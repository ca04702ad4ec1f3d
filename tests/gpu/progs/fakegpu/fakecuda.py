"""Fake CUDA for CPU dry runs of the GPU harness: distmem's torch backend and gpuprobe's operations
over fakegpu.state. One instance per process (``BACKEND``), shared by distmem and the probe."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import state  # noqa: E402
from fake_torch_cuda import FakeCudaBase  # noqa: E402 - tests/, shared with the unit tests

MiB = state.MiB


def _oom(msg):
    import torch

    return torch.cuda.OutOfMemoryError(f"CUDA out of memory. {msg} (fake GPU)")


class Backend(FakeCudaBase):
    version = "2.11.0+fake"

    def __init__(self):
        super().__init__(state.COUNT)
        self.stepped = set()
        self.limit = {}
        self.alloc = {}
        self.peak = {}
        self.settings = []

    # distmem.apply.torch backend protocol (the shared part in tests/fake_torch_cuda.py)
    def device_count(self):
        return state.COUNT

    def _context(self, i, extra=0):
        if not 0 <= i < state.COUNT:
            raise RuntimeError(f"CUDA error: invalid device ordinal {i}")
        self.initialised = True
        with state.transact() as st:
            me = st["gpus"][str(i)].setdefault(str(os.getpid()), {"ctx": 0, "mem": 0})
            if i not in self.ctx:
                me["ctx"] += state.CTX_INIT
            me["ctx"] += extra
        self.ctx.add(i)

    def set_device(self, i):
        self._context(i)
        self.current = i

    def mem_get_info(self, i):
        self._context(i)
        with state.transact() as st:
            used = sum(v["ctx"] + v["mem"] for v in st["gpus"][str(i)].values())
        return state.CUDA_TOTAL - used, state.CUDA_TOTAL

    def set_memory_fraction(self, f, i):
        self._context(i)
        self.limit[i] = int(f * state.CUDA_TOTAL)

    def memory_stats(self, i):
        a = self.alloc.get(i, 0)
        return {"allocated_bytes.all.current": a, "allocated_bytes.all.peak": self.peak.get(i, 0),
                "reserved_bytes.all.current": a, "reserved_bytes.all.peak": self.peak.get(i, 0), "num_ooms": 0}

    def reset_peak(self, i):
        self.peak[i] = self.alloc.get(i, 0)

    def device_uuid(self, i):
        return state.uuid(i)

    def set_allocator_settings(self, conf):
        self.settings.append(conf)
        return True

    # gpuprobe operations
    def train_step(self, i):
        self._context(i, 0 if i in self.stepped else state.CTX_STEP)
        self.stepped.add(i)

    def malloc(self, i, n):
        self._context(i)
        if i in self.limit and self.alloc.get(i, 0) + n > self.limit[i]:
            raise _oom(f"Tried to allocate {n // MiB} MiB; limit {self.limit[i] // MiB} MiB")
        with state.transact() as st:
            procs = st["gpus"][str(i)]
            used = sum(v["ctx"] + v["mem"] for v in procs.values())
            if used + n > state.CUDA_TOTAL:
                raise _oom(f"Tried to allocate {n // MiB} MiB; GPU {i} full")
            procs[str(os.getpid())]["mem"] += n
        self.alloc[i] = self.alloc.get(i, 0) + n
        self.peak[i] = max(self.peak.get(i, 0), self.alloc[i])
        return (i, n)

    def free(self, handle):
        i, n = handle
        with state.transact() as st:
            st["gpus"][str(i)][str(os.getpid())]["mem"] -= n
        self.alloc[i] -= n


BACKEND = Backend()


def measure_context(device):
    """What distmem.frameworks.torch.measure_context returns, from the fake GPU's numbers."""
    step = state.CTX_INIT + state.CTX_STEP
    return {"device": device, "name": "NVIDIA H200 (fake)", "method": "process", "nvml_after_init_bytes": state.CTX_INIT,
            "reserved_after_init_bytes": 2 * MiB, "nvml_after_step_bytes": step + 40 * MiB,
            "reserved_after_step_bytes": 40 * MiB, "overhead_bytes": step,
            "overhead_after_init_bytes": state.CTX_INIT - 2 * MiB, "cuda_total_bytes": state.CUDA_TOTAL,
            "cuda_free_bytes": state.CUDA_TOTAL - step, "torch": "fake", "cuda": "13.0", "cudnn": 0,
            "driver": "580.00-fake"}
