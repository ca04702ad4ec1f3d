"""Models of the allocators whose statistics an estimate predicts. Pure.

:class:`ExactAllocator` counts requested bytes; :class:`BFCAllocator` reproduces TensorFlow's
best-fit-with-coalescing allocator and :class:`CudaCachingAllocator` torch's CUDA caching
allocator, whose chunks can be larger than the request. With ``track=True`` every allocation is
booked to one of :data:`PARTS`, so a peak can be split into what it is made of.
"""
from __future__ import annotations

import bisect
from typing import Dict, List, Optional, Tuple

__all__ = ["ExactAllocator", "BFCAllocator", "CudaCachingAllocator", "PARTS", "BFC_MIN_ALLOCATION",
           "BFC_FIRST_REGION", "BFC_MAX_INTERNAL_FRAGMENTATION", "CUDA_MIN_BLOCK", "CUDA_SMALL_SIZE",
           "CUDA_SMALL_SEGMENT", "CUDA_MIN_LARGE_ALLOC", "CUDA_LARGE_SEGMENT", "CUDA_ROUND_LARGE", "bfc_round",
           "bfc_held_most"]

#: TensorFlow's BFC allocator rounds every request up to a multiple of 256 bytes.
BFC_MIN_ALLOCATION = 256
#: With growth enabled its first region is 2 MiB; each later region doubles the previous one.
BFC_FIRST_REGION = 2 * 1024 * 1024
#: A free chunk is split only if it is at least twice the request or would waste 128 MiB or more;
#: otherwise the whole chunk is handed out and counted as in use.
BFC_MAX_INTERNAL_FRAGMENTATION = 128 * 1024 * 1024


#: The named parts of an allocator peak (:meth:`ExactAllocator.parts`), in display order.
#: ``weights``: stored weights and buffers; ``gradients``: weight gradients; ``optimizer state``:
#: the optimizer's slots; ``inputs``: the step's batch; ``activations``: tensors kept for the
#: backward pass (forward outputs still alive at a forward peak among them); ``temporaries``:
#: everything else a step allocates and frees (unkept outputs, kernel temporaries, activation
#: gradients, optimizer update temporaries); ``workspaces``: library buffers kept for the process
#: (cuBLAS); ``allocator rounding``: what the allocator hands out beyond the requests.
PARTS = ("weights", "gradients", "optimizer state", "inputs", "activations", "temporaries", "workspaces",
         "allocator rounding")


class ExactAllocator:
    """Counts requested bytes; buffers below ``min_alloc`` are not counted (served from a pool
    the allocator's statistics leave out). With ``track=True`` every allocation carries one of
    :data:`PARTS` and :meth:`parts` splits the peak into them."""

    def __init__(self, min_alloc: int = 0, track: bool = False):
        self.min_alloc = min_alloc
        self.sizes: Dict[object, int] = {}
        self.in_use = 0
        self.peak = 0
        self.track = track
        self.by_part: Dict[str, int] = {}
        self.part_of: Dict[object, Tuple[str, int]] = {}
        self.peak_parts: Dict[str, int] = {}
        #: the largest single request booked (bytes): what a capped allocator must find in one piece
        self.largest = 0

    def reset_peak(self) -> None:
        self.peak = self.in_use
        if self.track:
            self.peak_parts = dict(self.by_part)

    def _count(self, key: object, size: int, chunk: int, part: str) -> None:
        """Book a new allocation (``chunk`` bytes handed out for ``size`` requested)."""
        self.in_use += chunk
        self.largest = max(self.largest, size)
        if self.track:
            self.part_of[key] = (part, size)
            self.by_part[part] = self.by_part.get(part, 0) + size
            if chunk != size:
                self.by_part["allocator rounding"] = self.by_part.get("allocator rounding", 0) + chunk - size
        if self.in_use > self.peak:
            self.peak = self.in_use
            if self.track:
                self.peak_parts = dict(self.by_part)

    def _uncount(self, key: object, chunk: int) -> None:
        self.in_use -= chunk
        if self.track:
            part, size = self.part_of.pop(key)
            self.by_part[part] -= size
            if chunk != size:
                self.by_part["allocator rounding"] -= chunk - size

    def parts(self) -> Dict[str, int]:
        """The peak split into :data:`PARTS` (bytes; they sum to :attr:`peak`). Needs ``track``."""
        out = {p: int(self.peak_parts.get(p, 0)) for p in PARTS}
        out["allocator rounding"] += self.peak - sum(out.values())  # 0 unless a part was never tracked
        return out

    def alloc(self, key: object, size: int, part: str = "temporaries") -> None:
        if size <= 0 or size < self.min_alloc:
            return
        self.sizes[key] = size
        self._count(key, size, size, part)

    def free(self, key: object) -> None:
        chunk = self.sizes.pop(key, None)
        if chunk is not None:
            self._uncount(key, chunk)


def bfc_round(size: int) -> int:
    """The bytes TensorFlow's BFC allocator rounds a request of ``size`` up to."""
    return max(BFC_MIN_ALLOCATION, -(-size // BFC_MIN_ALLOCATION) * BFC_MIN_ALLOCATION)


def bfc_held_most(size: int) -> int:
    """The largest chunk BFC may count as in use for a request of ``size``: a free chunk is split only
    when it is at least twice the rounded request or leaves :data:`BFC_MAX_INTERNAL_FRAGMENTATION`
    over (:meth:`BFCAllocator._split`), so an unsplit one is under both."""
    rounded = bfc_round(size)
    return min(2 * rounded, rounded + BFC_MAX_INTERNAL_FRAGMENTATION) - BFC_MIN_ALLOCATION


class BFCAllocator(ExactAllocator):
    """TensorFlow's best-fit-with-coalescing allocator, as far as its byte count goes.

    Requests round up to :data:`BFC_MIN_ALLOCATION`; the smallest free chunk that fits is taken
    and split only when it is at least twice the request (else the whole chunk counts as in use);
    freed chunks merge with free neighbours of their region; a new region is the next power-of-two
    multiple of :data:`BFC_FIRST_REGION` (or the request, if larger).
    """

    def __init__(self, min_alloc: int = 0, track: bool = False):
        super().__init__(min_alloc, track)
        self.region_bytes = BFC_FIRST_REGION
        self.free_chunks: List[Tuple[int, int, int, int]] = []  # (pool, size, address, region), sorted
        self.pool_of_region: Dict[int, int] = {}
        self.chunks: Dict[int, Tuple[int, int, bool]] = {}  # address -> (size, region, in_use)
        self.next_addr = 0
        self.where: Dict[object, int] = {}
        self.free_ending_at: Dict[int, int] = {}  # end address -> address of the free chunk ending there

    def _take_free(self, size: int, addr: int, region: int) -> None:
        item = (self.pool_of_region[region], size, addr, region)
        i = bisect.bisect_left(self.free_chunks, item)
        if i < len(self.free_chunks) and self.free_chunks[i] == item:
            del self.free_chunks[i]
        else:
            self.free_chunks.remove(item)
        self.free_ending_at.pop(addr + size, None)

    def _add_free(self, size: int, addr: int, region: int) -> None:
        bisect.insort(self.free_chunks, (self.pool_of_region[region], size, addr, region))
        self.chunks[addr] = (size, region, False)
        self.free_ending_at[addr + size] = addr

    def _round(self, size: int) -> int:
        return bfc_round(size)

    def _split(self, chunk: int, rounded: int) -> bool:
        return chunk >= 2 * rounded or chunk - rounded >= BFC_MAX_INTERNAL_FRAGMENTATION

    def _pool(self, rounded: int) -> int:
        return 0

    def _extend(self, rounded: int) -> None:
        grew = False
        while rounded > self.region_bytes:
            self.region_bytes *= 2
            grew = True
        size = self.region_bytes
        addr = self.next_addr
        self.next_addr += size
        self.pool_of_region[addr] = 0
        self._add_free(size, addr, addr)
        if not grew:
            self.region_bytes *= 2

    def alloc(self, key: object, size: int, part: str = "temporaries") -> None:
        if size <= 0 or size < self.min_alloc:
            return
        rounded = self._round(size)
        pool = self._pool(rounded)
        i = bisect.bisect_left(self.free_chunks, (pool, rounded, -1, -1))
        if i == len(self.free_chunks) or self.free_chunks[i][0] != pool:
            self._extend(rounded)
            i = bisect.bisect_left(self.free_chunks, (pool, rounded, -1, -1))
        _, csize, addr, region = self.free_chunks[i]
        self._take_free(csize, addr, region)
        if self._split(csize, rounded):
            self._add_free(csize - rounded, addr + rounded, region)
            csize = rounded
        self.chunks[addr] = (csize, region, True)
        self.where[key] = addr
        self.sizes[key] = csize
        self._count(key, size, csize, part)

    def free(self, key: object) -> None:
        addr = self.where.pop(key, None)
        if addr is None:
            return
        self._uncount(key, self.sizes.pop(key))
        size, region, _ = self.chunks.pop(addr)
        nxt = addr + size
        if nxt in self.chunks and not self.chunks[nxt][2] and self.chunks[nxt][1] == region:
            nsize = self.chunks.pop(nxt)[0]
            self._take_free(nsize, nxt, region)
            size += nsize
        prev = self._prev_free(addr, region)
        if prev is not None:
            psize = self.chunks.pop(prev)[0]
            self._take_free(psize, prev, region)
            addr, size = prev, psize + size
        self._add_free(size, addr, region)

    def _prev_free(self, addr: int, region: int) -> Optional[int]:
        a = self.free_ending_at.get(addr)
        if a is None:
            return None
        chunk = self.chunks.get(a)
        return a if chunk is not None and not chunk[2] and chunk[1] == region else None


#: torch's CUDA caching allocator rounds every request up to 512 bytes (kMinBlockSize).
CUDA_MIN_BLOCK = 512
#: Requests up to 1 MiB come from a pool of 2 MiB segments; a free block is split when at least
#: 512 bytes would remain.
CUDA_SMALL_SIZE = 1024 * 1024
CUDA_SMALL_SEGMENT = 2 * 1024 * 1024
#: Larger requests below 10 MiB get a 20 MiB segment; from 10 MiB a segment is the request
#: rounded up to 2 MiB. A large free block is split only when more than 1 MiB would remain, so a
#: reused block up to 1 MiB larger than the request counts whole in ``memory_allocated``.
CUDA_MIN_LARGE_ALLOC = 10 * 1024 * 1024
CUDA_LARGE_SEGMENT = 20 * 1024 * 1024
CUDA_ROUND_LARGE = 2 * 1024 * 1024


class CudaCachingAllocator(BFCAllocator):
    """torch's CUDA caching allocator as far as ``max_memory_allocated`` goes: best fit within a
    small and a large pool, the split rules and segment sizes above, segments kept (cached)."""

    def _round(self, size: int) -> int:
        return max(CUDA_MIN_BLOCK, -(-size // CUDA_MIN_BLOCK) * CUDA_MIN_BLOCK)

    def _pool(self, rounded: int) -> int:
        return 0 if rounded <= CUDA_SMALL_SIZE else 1

    def _split(self, chunk: int, rounded: int) -> bool:
        remaining = chunk - rounded
        return remaining >= CUDA_MIN_BLOCK if rounded <= CUDA_SMALL_SIZE else remaining > CUDA_SMALL_SIZE

    def _extend(self, rounded: int) -> None:
        if rounded <= CUDA_SMALL_SIZE:
            size = CUDA_SMALL_SEGMENT
        elif rounded < CUDA_MIN_LARGE_ALLOC:
            size = CUDA_LARGE_SEGMENT
        else:
            size = -(-rounded // CUDA_ROUND_LARGE) * CUDA_ROUND_LARGE
        addr = self.next_addr
        self.next_addr += size
        self.pool_of_region[addr] = self._pool(rounded)
        self._add_free(size, addr, addr)
