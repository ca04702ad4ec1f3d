"""A CPU stand-in for one shared GPU, so the post-mortem scenarios run here as they run on the H200.

Used only by ``bench/report/postmortem_scenarios.py --cpu`` (a smoke run that develops and checks
the benchmark without a GPU) and the fixtures it writes; never on a GPU. The job's tensors are real
CPU tensors of a real training job (torch CPU, Gloo); every buffer torch creates is seen by a
dispatch mode and booked, ``scale`` times its size, through a model of torch's CUDA caching
allocator (``distmem.estimate.allocators.CudaCachingAllocator``: best fit in a small and a large
pool, its split rules and segment sizes) that is capped the way ``set_per_process_memory_fraction``
caps it and, where it must grow, asks the shared fake GPU (``tests/gpu/progs/fakegpu``: one JSON
state all processes on the "GPU" book into, read by a fake ``pynvml``). A request that does not fit
first releases the pool's wholly free segments, as torch does, then calls the out-of-memory
observers (distmem's record) and raises ``torch.cuda.OutOfMemoryError`` with torch's message.
With expandable segments (``expandable_segments:True``) the pool maps pages on demand: no segment
boundaries, only 2 MiB pages.

distmem-bench: internal - a stand-in GPU, not a figure: it books a CPU job's tensors through the
estimator's model of torch's caching allocator so the jobs run out of memory here as on a GPU; the
door measured is ``distmem postmortem`` (bench/report/postmortem_scenarios.py), which never sees it.
"""
from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKEGPU = os.path.join(ROOT, "tests", "gpu", "progs", "fakegpu")
MiB = 1024 ** 2
PAGE = 2 * MiB

__all__ = ["Device", "install", "FAKEGPU", "env"]


def env(state_dir: str, total_mib: int, scale: int) -> Dict[str, str]:
    """The environment of every process on the CPU stand-in (the job's ranks, a foreign process)."""
    return {"DISTMEM_FAKE_GPU": "1", "DISTMEM_FAKE_GPU_DIR": state_dir, "DISTMEM_FAKE_GPU_COUNT": "1",
            "DISTMEM_FAKE_GPU_TOTAL_MIB": str(total_mib), "DISTMEM_FAKE_GPU_RESERVED_MIB": "16",
            "DISTMEM_FAKE_GPU_CTX_MIB": "24", "DISTMEM_EMU_SCALE": str(scale)}


class _NoRoom(Exception):
    def __init__(self, size: int, why: str):
        super().__init__(why)
        self.size, self.why = size, why


def _caching_pool(grow: Callable[[int], Optional[str]], shrink: Callable[[int], None]) -> Any:
    from distmem.estimate.allocators import (CUDA_LARGE_SEGMENT, CUDA_MIN_LARGE_ALLOC, CUDA_ROUND_LARGE,
                                             CUDA_SMALL_SEGMENT, CUDA_SMALL_SIZE, CudaCachingAllocator)

    class Pool(CudaCachingAllocator):
        """torch's caching allocator with a cap: a new segment only where ``grow`` allows it."""

        def __init__(self) -> None:
            super().__init__()
            self.regions: Dict[int, int] = {}

        def reserved(self) -> int:
            return sum(self.regions.values())

        def _extend(self, rounded: int) -> None:
            if rounded <= CUDA_SMALL_SIZE:
                size = CUDA_SMALL_SEGMENT
            elif rounded < CUDA_MIN_LARGE_ALLOC:
                size = CUDA_LARGE_SEGMENT
            else:
                size = -(-rounded // CUDA_ROUND_LARGE) * CUDA_ROUND_LARGE
            why = grow(size)
            if why is not None:
                self.release()
                why = grow(size)
                if why is not None:
                    raise _NoRoom(size, why)
            addr = self.next_addr
            self.next_addr += size
            self.regions[addr] = size
            self.pool_of_region[addr] = self._pool(rounded)
            self._add_free(size, addr, addr)

        def release(self) -> None:
            """Return every wholly free segment to the device (torch's release_cached_blocks)."""
            for addr, size in list(self.regions.items()):
                chunk = self.chunks.get(addr)
                if chunk is not None and not chunk[2] and chunk[0] == size:
                    self._take_free(size, addr, addr)
                    del self.chunks[addr]
                    del self.regions[addr]
                    self.pool_of_region.pop(addr, None)
                    shrink(size)

        def segments(self) -> List[Dict[str, Any]]:
            out = []
            for addr, size in sorted(self.regions.items()):
                blocks, a = [], addr
                while a < addr + size and a in self.chunks:
                    csize, _, used = self.chunks[a]
                    blocks.append({"size": csize, "state": "active_allocated" if used else "inactive"})
                    a += csize
                out.append({"device": 0, "total_size": size, "blocks": blocks,
                            "segment_type": "small" if self.pool_of_region.get(addr) == 0 else "large"})
            return out

    return Pool()


class _ExpandablePool:
    """Expandable segments: pages mapped as the pool grows and unmapped when freed at the end."""

    def __init__(self, grow: Callable[[int], Optional[str]], shrink: Callable[[int], None]):
        self.grow, self.shrink = grow, shrink
        self.sizes: Dict[object, int] = {}
        self.in_use = 0
        self.peak = 0
        self.mapped = 0

    def reserved(self) -> int:
        return self.mapped

    def alloc(self, key: object, size: int) -> None:
        size = max(512, -(-size // 512) * 512)
        need = -(-(self.in_use + size) // PAGE) * PAGE
        if need > self.mapped:
            why = self.grow(need - self.mapped)
            if why is not None:
                raise _NoRoom(need - self.mapped, why)
            self.mapped = need
        self.sizes[key] = size
        self.in_use += size
        self.peak = max(self.peak, self.in_use)

    def free(self, key: object) -> None:
        size = self.sizes.pop(key, None)
        if size is not None:
            self.in_use -= size

    def release(self) -> None:
        keep = -(-self.in_use // PAGE) * PAGE
        if keep < self.mapped:
            self.shrink(self.mapped - keep)
            self.mapped = keep

    def segments(self) -> List[Dict[str, Any]]:
        return [{"device": 0, "total_size": self.mapped, "segment_type": "large",
                 "blocks": [{"size": self.in_use, "state": "active_allocated"},
                            {"size": self.mapped - self.in_use, "state": "inactive"}]}]


class Device:
    """The CPU stand-in of this process's GPU: distmem's torch backend (through fakegpu's) and the
    allocator distmem's post-mortem hooks read."""

    def __init__(self, scale: int = 1):
        sys.path.insert(0, FAKEGPU)
        import fakecuda
        import state

        self.state = state
        self.backend = _Backend(self)
        self.scale = int(scale)
        self.cap: Optional[int] = None
        self.observers: List[Callable[..., None]] = []
        self.expandable = "expandable_segments:true" in (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") +
                                                         os.environ.get("PYTORCH_ALLOC_CONF", "")).lower()
        self.pool: Any = None
        self.num_ooms = 0
        self.outside = 0
        self._fakecuda = fakecuda

    # -- the shared GPU ---------------------------------------------------------------------
    def _book(self, delta: int) -> Optional[str]:
        """Book ``delta`` more bytes for this process on the GPU; the reason where it does not fit."""
        with self.state.transact() as st:
            procs = st["gpus"]["0"]
            me = procs.setdefault(str(os.getpid()), {"ctx": self.state.CTX_INIT, "mem": 0})
            used = sum(v["ctx"] + v["mem"] for v in procs.values())
            if delta > 0 and used + delta > self.state.CUDA_TOTAL:
                return "device"
            me["mem"] += delta
        return None

    def _grow(self, size: int) -> Optional[str]:
        if self.cap is not None and self.pool.reserved() + size > self.cap:
            return "cap"
        return self._book(size)

    def _shrink(self, size: int) -> None:
        self._book(-size)

    def start(self) -> None:
        if self.pool is None:
            self.pool = (_ExpandablePool(self._grow, self._shrink) if self.expandable
                         else _caching_pool(self._grow, self._shrink))

    def free_bytes(self) -> int:
        with self.state.transact() as st:
            return self.state.CUDA_TOTAL - sum(v["ctx"] + v["mem"] for v in st["gpus"]["0"].values())

    def hold_outside(self, size: int) -> None:
        """Memory this process holds outside its allocator (a library's own ``cudaMalloc``); raises
        the library's out-of-memory error where the GPU is full."""
        if self._book(int(size) * self.scale) is not None:
            raise RuntimeError(f"NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL "
                               f"version 2.27: Cuda failure 'out of memory' (emulated, {size * self.scale} bytes)")
        self.outside += int(size) * self.scale

    # -- the allocator distmem reads --------------------------------------------------------
    def initialized(self) -> bool:
        return self.pool is not None

    def memory_stats(self, device: int = 0) -> Dict[str, Any]:
        p = self.pool
        if p is None:
            return {}
        return {"allocated_bytes.all.current": p.in_use, "reserved_bytes.all.current": p.reserved(),
                "allocated_bytes.all.peak": p.peak, "reserved_bytes.all.peak": p.reserved(),
                "num_ooms": self.num_ooms}

    def segments(self) -> List[Dict[str, Any]]:
        return self.pool.segments() if self.pool is not None else []

    def attach(self, observer: Callable[..., None]) -> bool:
        self.observers.append(observer)
        return True

    def alloc(self, key: object, nbytes: int) -> None:
        self.start()
        size = int(nbytes) * self.scale
        try:
            self.pool.alloc(key, size)
        except _NoRoom as exc:
            self.num_ooms += 1
            free = max(self.free_bytes(), 0)
            cap = self.cap if self.cap is not None else self.state.CUDA_TOTAL
            for obs in list(self.observers):
                obs(0, size, cap, free)
            import torch

            gib = 1024 ** 3
            why = (f"of which {free / MiB:.2f} MiB is free" if exc.why == "device" else
                   f"and this process's limit is {cap / gib:.2f} GiB")
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {_size(size)}. GPU 0 has a total capacity of "
                f"{self.state.CUDA_TOTAL / gib:.2f} GiB {why}. Of the allocated memory {_size(self.pool.in_use)} is "
                f"allocated by PyTorch, and {_size(self.pool.reserved() - self.pool.in_use)} is reserved by PyTorch "
                "but unallocated. (CPU stand-in)") from None

    def free(self, key: object) -> None:
        if self.pool is not None:
            self.pool.free(key)

    def empty_cache(self) -> None:
        if self.pool is not None:
            self.pool.release()


def _size(n: int) -> str:
    for unit, s in (("GiB", 1024 ** 3), ("MiB", MiB), ("KiB", 1024)):
        if n >= s:
            return f"{n / s:.2f} {unit}"
    return f"{n} bytes"


class _Backend:
    """distmem's torch backend protocol over fakegpu's, with the fraction as this pool's cap."""

    def __init__(self, dev: Device):
        self.dev = dev

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dev._fakecuda.BACKEND, name)

    def set_memory_fraction(self, fraction: float, index: int) -> None:
        self.dev._fakecuda.BACKEND.set_memory_fraction(fraction, index)
        self.dev.cap = int(fraction * self.dev.state.CUDA_TOTAL)

    def memory_stats(self, index: int) -> Dict[str, Any]:
        return self.dev.memory_stats(index)

    def set_allocator_settings(self, conf: str) -> bool:
        if "expandable_segments:true" in conf.lower() and self.dev.pool is None:
            self.dev.expandable = True
        return True


def install(scale: Optional[int] = None) -> Device:
    """Route distmem's torch backend to the stand-in and book every tensor this process creates
    from now on (a dispatch mode entered for the rest of the process). Returns the device."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from distmem.apply import torch as tadapter

    dev = Device(int(scale or os.environ.get("DISTMEM_EMU_SCALE", "1")))
    tadapter.set_backend(dev.backend)

    class Book(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    st = t.untyped_storage()
                    key = st._cdata
                    if key in seen or st.nbytes() == 0:
                        continue
                    seen.add(key)
                    weakref.finalize(st, _release, key)
                    dev.alloc(key, st.nbytes())
            return out

    seen: set = set()

    def _release(key: int) -> None:
        seen.discard(key)
        dev.free(key)

    Book().__enter__()
    return dev
