"""One rank of a job runs out of memory, uncaught; every rank has the post-mortem hooks init() installs.

The GPU is distmem's small fake CUDA backend (tests/fake_torch_cuda.py) with a caching allocator's
figures: it holds this rank's planned limit as torch's per-process fraction would, and a request
above it calls the allocator's out-of-memory observers, then raises torch's message. CPU only.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import distmem  # noqa: E402
from distmem.guard import oom  # noqa: E402
from distmem.observe import oom_record  # noqa: E402
from fake_torch_cuda import FakeCudaBase  # noqa: E402

GiB = 1024**3


class FakeCuda(FakeCudaBase):
    def __init__(self, cap):
        super().__init__(count=1, initialised=True)
        self.cap, self.blocks, self.observers = cap, [], []

    def memory_stats(self, device):
        used = sum(self.blocks)
        return {"allocated_bytes.all.current": used, "reserved_bytes.all.current": used,
                "allocated_bytes.all.peak": used, "num_ooms": 0}

    def segments(self):
        return [{"device": 0, "total_size": b, "blocks": [{"size": b, "state": "active_allocated"}]}
                for b in self.blocks]

    def attach(self, observer):
        self.observers.append(observer)

    def initialized(self):
        return True

    def malloc(self, n):
        if sum(self.blocks) + n > self.cap:
            for obs in self.observers:
                obs(0, n, self.cap, 0)
            raise RuntimeError(f"CUDA out of memory. Tried to allocate {n / GiB:.2f} GiB. GPU 0 has a total "
                               f"capacity of {self.cap / GiB:.2f} GiB")
        self.blocks.append(n)


plan = distmem.init(strategy="data", fleet="1x16GiB", framework="none", memory="limit", verbose=False)
cuda = FakeCuda(plan.mine.limit_bytes)
oom.use_allocator(cuda)  # init() installed the hooks (unless DISTMEM_POSTMORTEM=0); they read this allocator
oom_record.note_step(0)
for step in range(1, 6):
    oom_record.note_step(step)
    cuda.malloc(int(0.4 * GiB) if plan.mine.rank != int(os.environ["OOM_RANK"]) else GiB)
print(f"rank {plan.mine.rank} finished", flush=True)
