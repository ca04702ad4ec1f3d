"""What the GPU tests and bench/plan/packing.py do to a GPU and how they look at it, written once.

``Nvml`` reads NVML through pynvml directly, never through distmem, so that every claim is checked
against an independent source. The operations (pin, a training step, fill until OOM, release) use
torch.cuda. With DISTMEM_FAKE_GPU=1 (CPU dry runs of this harness; tests/gpu/progs/fakegpu on
PYTHONPATH) the same calls go to a fake GPU instead; on a real GPU that variable is never set.
"""
import gc
import os
import sys
import time
import traceback

__all__ = ["ROOT", "MiB", "GiB", "FAKE", "CHUNKS_MIB", "setup", "Nvml", "Gpu", "mpi_main", "norm_uuid"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MiB = 1024 ** 2
GiB = 1024 ** 3
FAKE = os.environ.get("DISTMEM_FAKE_GPU") == "1"
#: Fill order: large chunks, then smaller ones for the tail. 1 MiB requests come from the small pool
#: (2 MiB segments), so at most ~2 MiB of what a tenant could get is left unclaimed; 8/4/2 MiB
#: requests would each want a 20 MiB segment and leave up to 20 MiB.
CHUNKS_MIB = (256, 128, 64, 32, 16, 1)


def norm_uuid(u):
    u = u.decode() if isinstance(u, bytes) else str(u)
    return u.lower().replace("gpu-", "")


def setup():
    """Make distmem importable and, in a dry run, route distmem's torch backend to the fake GPU."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if FAKE:
        import fakecuda

        from distmem.apply import torch as tadapter

        tadapter.set_backend(fakecuda.BACKEND)


class Nvml:
    """NVML through pynvml, independent of distmem. Bytes throughout; ``index`` is NVML's."""

    def __init__(self):
        import pynvml

        self.p = pynvml
        pynvml.nvmlInit()
        self.count = pynvml.nvmlDeviceGetCount()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.count)]

    def procs(self, i):
        """{pid: bytes} NVML attributes to each process on GPU ``i`` (None where it cannot)."""
        out = {}
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                rows = getattr(self.p, fn)(self.handles[i]) or []
            except Exception:  # noqa: BLE001 - "not supported" on some drivers for graphics processes
                rows = []
            for r in rows:
                used = getattr(r, "usedGpuMemory", None)
                out.setdefault(int(r.pid), None if used is None else int(used))
        return out

    def gpu(self, i):
        h = self.handles[i]
        m = self.p.nvmlDeviceGetMemoryInfo(h)
        row = {"index": i, "uuid": norm_uuid(self.p.nvmlDeviceGetUUID(h)), "name": str(self.p.nvmlDeviceGetName(h)),
               "total": int(m.total), "used": int(m.used), "free": int(m.free), "reserved": None,
               "procs": self.procs(i)}
        try:
            m2 = self.p.nvmlDeviceGetMemoryInfo(h, version=self.p.nvmlMemory_v2)
            row.update(reserved=int(m2.reserved), used_v2=int(m2.used), free_v2=int(m2.free))
        except Exception:  # noqa: BLE001 - an older driver or binding without the v2 structure
            pass
        return row

    def gpus(self):
        return [self.gpu(i) for i in range(self.count)]

    def where(self, pid=None):
        """{nvml index: bytes} for every GPU on which NVML lists ``pid`` (default: this process)."""
        pid = os.getpid() if pid is None else pid
        return {i: p[pid] for i in range(self.count) for p in [self.procs(i)] if pid in p}

    def index_of(self, uuid):
        for i, h in enumerate(self.handles):
            if norm_uuid(self.p.nvmlDeviceGetUUID(h)) == norm_uuid(uuid):
                return i
        return None

    def driver(self):
        try:
            return str(self.p.nvmlSystemGetDriverVersion())
        except Exception:  # noqa: BLE001
            return None


class Gpu:
    """The operations on one CUDA ordinal, through torch.cuda (or the fake GPU in a dry run)."""

    def __init__(self, index):
        import torch

        self.torch = torch
        self.i = int(index)
        self.dev = torch.device("cuda", self.i)
        self.fake = None
        if FAKE:
            import fakecuda

            self.fake = fakecuda.BACKEND

    def pin(self):
        (self.fake.set_device if self.fake else self.torch.cuda.set_device)(self.i)

    def set_fraction(self, fraction):
        if self.fake:
            self.fake.set_memory_fraction(fraction, self.i)
        else:
            self.torch.cuda.set_per_process_memory_fraction(float(fraction), self.i)

    def touch(self):
        """Start CUDA on this device with a first tensor."""
        if self.fake:
            return self.fake.set_device(self.i) if self.fake.current != self.i else self.fake._context(self.i)
        self.torch.zeros(1, device=self.dev)
        self.torch.cuda.synchronize(self.i)

    def train_step(self):
        """One step that loads cuBLAS (fp32 and bf16) and cuDNN, forward and backward; keeps nothing."""
        if self.fake:
            return self.fake.train_step(self.i)
        t = self.torch
        lin = t.nn.Linear(1024, 1024).to(self.dev)
        conv = t.nn.Conv2d(16, 32, 3, padding=1).to(self.dev)
        bn = t.nn.BatchNorm2d(32).to(self.dev)
        x = t.randn(64, 1024, device=self.dev, requires_grad=True)
        img = t.randn(8, 16, 64, 64, device=self.dev, requires_grad=True)
        loss = lin(x).square().mean() + bn(conv(img)).relu().mean()
        with t.autocast("cuda", dtype=t.bfloat16):
            loss = loss + lin(x).float().square().mean()
        loss.backward()
        t.cuda.synchronize(self.i)
        del lin, conv, bn, x, img, loss

    def alloc(self, nbytes):
        if self.fake:
            return self.fake.malloc(self.i, int(nbytes))
        return self.torch.empty(int(nbytes), dtype=self.torch.uint8, device=self.dev)

    def fill(self, held, chunks_mib=CHUNKS_MIB, stop_at=None):
        """Allocate chunks until OOM, largest first, appending to ``held``. Returns what happened.

        ``stop_at`` (bytes of allocator reserve) ends the fill early, for tenants that only need some.
        """
        t0 = time.monotonic()
        ooms, last = 0, None
        oom_type = self.torch.cuda.OutOfMemoryError
        for c in chunks_mib:
            n = c * MiB
            while stop_at is None or self.reserved() + n <= stop_at:
                try:
                    held.append(self.alloc(n))
                except oom_type as exc:
                    ooms += 1
                    last = " ".join(str(exc).split())[:600]
                    break
        self.sync()
        return {"allocated": self.allocated(), "reserved": self.reserved(), "ooms": ooms, "last_oom": last,
                "seconds": round(time.monotonic() - t0, 3), "chunks": len(held)}

    def release(self, held):
        if self.fake:
            for h in held:
                self.fake.free(h)
            held.clear()
            return
        held.clear()
        gc.collect()
        self.torch.cuda.synchronize(self.i)
        self.torch.cuda.empty_cache()

    def sync(self):
        if not self.fake:
            self.torch.cuda.synchronize(self.i)

    def _stat(self, key):
        if self.fake:
            return int(self.fake.memory_stats(self.i)[key])
        return int(self.torch.cuda.memory_stats(self.i).get(key, 0))

    def allocated(self):
        return self._stat("allocated_bytes.all.current")

    def peak(self):
        return self._stat("allocated_bytes.all.peak")

    def reserved(self):
        return self._stat("reserved_bytes.all.current")

    def mem_get_info(self):
        if self.fake:
            return self.fake.mem_get_info(self.i)
        free, total = self.torch.cuda.mem_get_info(self.i)
        return int(free), int(total)

    def uuid(self):
        if self.fake:
            return self.fake.device_uuid(self.i)
        return norm_uuid(self.torch.cuda.get_device_properties(self.i).uuid)

    def expandable(self):
        """True/False whether the allocator's segments on this device are expandable; None if unknown."""
        if self.fake:
            return any("expandable_segments:True" in s for s in self.fake.settings) or None
        segs = [s for s in self.torch.cuda.memory_snapshot() if s.get("device") == self.i]
        flags = [s.get("is_expandable") for s in segs if "is_expandable" in s]
        return (all(flags) if flags else None)


def mpi_main(fn):
    """Run ``fn(comm)`` on every rank; the first rank that fails prints why and aborts the whole job."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    try:
        fn(comm)
    except BaseException:  # noqa: BLE001 - any failure must end every rank, not leave them in a barrier
        sys.stderr.write(f"[rank {comm.Get_rank()}] FAILED\n{traceback.format_exc()}")
        sys.stderr.flush()
        comm.Abort(1)
