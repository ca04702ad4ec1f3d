"""Replay a training step over a layer graph and find its memory peak. Pure.

A step is a list of :class:`Node` (one per layer application, in forward order) reading and
writing :class:`Tensor` s. The replay allocates each node's outputs and temporaries, frees a tensor
after its last forward reader unless a node keeps it for the backward pass, then walks the nodes
backwards: each allocates the gradients of its inputs and weights, frees the gradients of its
outputs and the tensors only it still kept. Every allocation and free goes through an allocator
model (:class:`ExactAllocator` counts requested bytes; :class:`BFCAllocator` reproduces
TensorFlow's best-fit-with-coalescing allocator, whose chunks can be larger than the request), and
the largest amount in use on the way is the peak the framework reports. What each node keeps is
the framework's business (see ``from_keras``); this module only counts.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

__all__ = ["needs_gradient", "Tensor", "Node", "Graph", "Replay", "replay", "ExactAllocator", "BFCAllocator", "PARTS",
           "CudaCachingAllocator",
           "BFC_MIN_ALLOCATION", "BFC_FIRST_REGION", "BFC_MAX_INTERNAL_FRAGMENTATION"]

#: TensorFlow's BFC allocator rounds every request up to a multiple of 256 bytes.
BFC_MIN_ALLOCATION = 256
#: With growth enabled its first region is 2 MiB; each later region doubles the previous one.
BFC_FIRST_REGION = 2 * 1024 * 1024
#: A free chunk is split only if it is at least twice the request or would waste 128 MiB or more;
#: otherwise the whole chunk is handed out and counted as in use.
BFC_MAX_INTERNAL_FRAGMENTATION = 128 * 1024 * 1024


@dataclass
class Tensor:
    """A buffer of ``per_sample * batch + fixed`` bytes; ``alias`` names the tensor whose buffer
    it shares (a reshape), so it costs nothing itself and keeps that buffer alive."""

    per_sample: int
    fixed: int = 0
    alias: Optional[int] = None

    def at(self, batch: int) -> int:
        return self.per_sample * batch + self.fixed


@dataclass
class Node:
    """One layer application.

    ``saved``: tensor ids (inputs, outputs or temporaries) its gradient reads, so they stay alive
    until this node's backward. ``temps``: buffers created inside the node; freed when it returns
    unless saved. ``backward_temps``: buffers its backward allocates besides the input gradients.
    ``grads``: bytes of each trainable weight's gradient. ``update_temps``: bytes of the optimizer
    temporaries while one of its weights is updated (one entry per buffer, all weights).
    ``early_update_temps``: bytes of update temporaries that do not depend on the gradient
    (momentum's ``m * momentum``, RMSprop's ``rho * velocity``): a dataflow executor computes them
    as soon as the step starts, so they are alive from the step's start until the update.
    ``held_read_copies``: bytes of weights that an update made at the step's start (decoupled weight
    decay) copies because the forward's read of them is still held for this node's backward: alive
    from the step's start until this node's backward has run and released the old buffer.
    """

    row: int
    inputs: Tuple[int, ...]
    outputs: Tuple[int, ...]
    saved: Tuple[int, ...] = ()
    temps: Tuple[int, ...] = ()
    backward_temps: Tuple[int, ...] = ()
    grads: Tuple[int, ...] = ()
    update_temps: Tuple[int, ...] = ()
    trainable: bool = False
    early_update_temps: Tuple[int, ...] = ()
    held_read_copies: Tuple[int, ...] = ()


@dataclass
class Graph:
    """A training step: tensors, nodes in forward order, the step's data inputs (held by the caller
    for the whole step) and ``persistent`` (bytes of each weight and optimizer-state buffer,
    alive throughout, in the order they were created)."""

    tensors: List[Tensor] = field(default_factory=list)
    nodes: List[Node] = field(default_factory=list)
    inputs: Tuple[int, ...] = ()
    persistent: List[int] = field(default_factory=list)
    #: the :data:`PARTS` name of each ``persistent`` buffer (default ``"weights"``)
    persistent_parts: List[str] = field(default_factory=list)
    #: with gradients applied as they come (``grads_held=False``): a dataflow executor starts each
    #: weight update as soon as its gradient exists and goes on with the backward pass beside it, so
    #: an update (its gradient and temporaries) is still alive while the next layers' backward and
    #: updates run. It finishes once the backward has since allocated ``update_overlap`` times its
    #: own bytes (work as a clock: a large weight's element-wise update outlasts several small
    #: layers' backward); 0 = each update finishes before the backward goes on
    update_overlap: float = 0.0

    def add(self, per_sample: int, fixed: int = 0, alias: Optional[int] = None) -> int:
        self.tensors.append(Tensor(int(per_sample), int(fixed), alias))
        return len(self.tensors) - 1

    def root(self, t: int) -> int:
        while self.tensors[t].alias is not None:
            t = self.tensors[t].alias  # type: ignore[assignment]
        return t


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

    def reset_peak(self) -> None:
        self.peak = self.in_use
        if self.track:
            self.peak_parts = dict(self.by_part)

    def _count(self, key: object, size: int, chunk: int, part: str) -> None:
        """Book a new allocation (``chunk`` bytes handed out for ``size`` requested)."""
        self.in_use += chunk
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
        return max(BFC_MIN_ALLOCATION, -(-size // BFC_MIN_ALLOCATION) * BFC_MIN_ALLOCATION)

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


@dataclass
class Replay:
    """What a replay found, in bytes at ``batch``.

    ``peak``: the largest amount in use. ``phase``/``node``: where it happened (``"forward"``,
    ``"backward"`` or ``"update"``; node index or -1). ``saved``: activations alive when the
    backward pass starts. ``saved_by_row``: those per table row (the earliest node keeping each).
    ``forward_peak``: the peak of a forward pass that keeps nothing (inference). ``parts``: the
    peak split into :data:`PARTS`, when the allocator tracked them.
    """

    batch: int
    peak: int
    phase: str
    node: int
    saved: int
    saved_by_row: Dict[int, int]
    forward_peak: int
    saved_at_peak: int = 0
    grads_at_peak: int = 0
    parts: Optional[Dict[str, int]] = None

    def as_dict(self) -> Dict[str, object]:
        out: Dict[str, object] = {
            "batch": self.batch, "peak": self.peak, "phase": self.phase, "node": self.node, "saved": self.saved,
            "forward_peak": self.forward_peak, "saved_at_peak": self.saved_at_peak,
            "grads_at_peak": self.grads_at_peak}
        if self.parts is not None:
            out["parts"] = dict(self.parts)
        return out


def _plan(g: Graph, train: bool):
    """What a replay needs that does not depend on the batch: which tensors need a gradient and
    which nodes a backward, how long each kept tensor lives, each tensor's last forward reader, the
    step's held inputs. Cached on the graph (keyed by its size, so a graph still being built is
    planned again); every estimate replays its graph several times."""
    key = (bool(train), len(g.nodes), len(g.tensors), tuple(g.inputs))
    cache = g.__dict__.setdefault("_plans", {})
    if key in cache:
        return cache[key]
    root = g.root
    nodes = g.nodes
    needs_grad = set()
    needs_backward = [False] * len(nodes)
    if train:
        for k, n in enumerate(nodes):
            if n.trainable or any(root(i) in needs_grad for i in n.inputs):
                needs_backward[k] = True
                needs_grad.update(root(o) for o in n.outputs)
    # a kept tensor lives until the backward of its earliest keeper (the backward walks nodes in reverse)
    kept_until: Dict[int, int] = {}
    for k, n in enumerate(nodes):
        if needs_backward[k]:
            for t in n.saved:
                r = root(t)
                kept_until[r] = min(kept_until.get(r, k), k)
    last_read: Dict[int, int] = {}
    for k, n in enumerate(nodes):
        for t in n.inputs:
            last_read[root(t)] = k
    held = {root(t) for t in g.inputs}
    freed_after: Dict[int, List[int]] = {}
    for t, k in kept_until.items():
        if t not in held:
            freed_after.setdefault(k, []).append(t)
    if len(cache) >= 4:
        cache.clear()
    cache[key] = (needs_grad, needs_backward, kept_until, last_read, held, freed_after)
    return cache[key]


def needs_gradient(g: Graph) -> set:
    """Tensor ids (roots) whose gradient a training step computes: outputs of trainable nodes and
    of every node downstream of one."""
    return _plan(g, True)[0]


def replay(graph: Graph, batch: int, *, grads_held: bool, train: bool = True,
           allocator: Optional[ExactAllocator] = None, steps: int = 1, saved_only: bool = False) -> Replay:
    """Replay ``steps`` training steps at ``batch`` and return the largest peak.

    ``grads_held``: weight gradients stay alive until one optimizer step after the backward pass
    (torch, loss-scaled Keras); otherwise each is applied and freed as soon as it exists (a Keras
    graph, whose per-variable updates depend only on their own gradient). ``train=False``
    replays a forward pass only. ``allocator``: how bytes are counted (default: exactly).
    ``saved_only``: return only what is kept for the backward pass (``saved``, ``saved_by_row``),
    which needs no allocation (peak fields are 0).
    """
    g = graph
    root = g.root
    size = [0 if t.alias is not None else t.at(batch) for t in g.tensors]
    nodes = g.nodes
    a = allocator if allocator is not None else ExactAllocator()

    needs_grad, needs_backward, kept_until, last_read, held, freed_after = _plan(g, train)
    saved_by_row: Dict[int, int] = {}
    for t, k in kept_until.items():
        if t not in held:
            saved_by_row[nodes[k].row] = saved_by_row.get(nodes[k].row, 0) + size[t]
    saved_total = sum(saved_by_row.values())
    if saved_only:
        return Replay(batch, 0, "forward", -1, saved_total, saved_by_row, 0)

    pparts = g.persistent_parts
    for i, nbytes in enumerate(g.persistent):
        a.alloc(("w", i), nbytes, pparts[i] if i < len(pparts) else "weights")
    for t in held:
        a.alloc(t, size[t], "inputs")
    best = [a.in_use, "forward", -1, 0, 0]
    forward_peak = a.in_use
    kept_live = [0]
    weight_grads = [0]

    overlap = max(0.0, float(g.update_overlap))

    def finish_update(k: int) -> None:
        n = nodes[k]
        for j in range(len(n.update_temps)):
            a.free(("ut", k, j))
        for j in range(len(n.early_update_temps)):
            a.free(("et", k, j))
        for j, nbytes in enumerate(n.grads):
            if ("wg", k, j) in a.sizes:
                weight_grads[0] -= nbytes
            a.free(("wg", k, j))

    def mark(phase: str, k: int) -> None:
        if a.in_use > best[0]:
            best[:] = [a.in_use, phase, k, kept_live[0], weight_grads[0]]

    for _ in range(max(1, steps)):
        allocated = set(held)
        kept_live[0] = 0
        for k, n in enumerate(nodes):
            for j, nbytes in enumerate(n.early_update_temps):
                a.alloc(("et", k, j), nbytes)
            for j, nbytes in enumerate(n.held_read_copies):
                a.alloc(("rc", k, j), nbytes)
        for k, n in enumerate(nodes):
            fresh = list(dict.fromkeys(root(t) for t in (*n.outputs, *n.temps) if root(t) not in allocated))
            allocated.update(fresh)
            for t in fresh:
                a.alloc(t, size[t], "activations" if t in kept_until else "temporaries")
                if t in kept_until and t in a.sizes:  # counted by the allocator (not below its floor)
                    kept_live[0] += size[t]
            mark("forward", k)
            forward_peak = max(forward_peak, a.in_use)
            for t in fresh:
                if t in kept_until or t in held or last_read.get(t, -1) > k:
                    continue
                a.free(t)
                allocated.discard(t)
            for t in dict.fromkeys(root(i) for i in n.inputs):
                if last_read.get(t) == k and t not in kept_until and t not in held and t in allocated:
                    a.free(t)
                    allocated.discard(t)
        if not train:
            for t in list(allocated):
                if t not in held:
                    a.free(t)
            return Replay(batch, forward_peak, "forward", -1, 0, {}, forward_peak)

        grad_of: Dict[int, bool] = {}
        pending: List[Tuple[str, int, int]] = []
        # weight updates still running: (node, backward bytes allocated when it started, its bytes)
        in_flight: List[Tuple[int, int, int]] = []
        work = [0]
        for k in range(len(nodes) - 1, -1, -1):
            if not needs_backward[k]:
                continue
            n = nodes[k]
            extra = []
            for i in dict.fromkeys(root(t) for t in n.inputs):
                if i not in needs_grad:
                    continue
                if i in grad_of:
                    extra.append((("g+", i), size[i]))  # a second contribution, summed into the first
                else:
                    grad_of[i] = True
                    a.alloc(("g", i), size[i])
            for j, t in enumerate(n.backward_temps):
                extra.append((("bt", k, j), size[root(t)]))
            for key, nbytes in extra:
                a.alloc(key, nbytes)
            for j, nbytes in enumerate(n.grads):
                a.alloc(("wg", k, j), nbytes, "gradients")
                if ("wg", k, j) in a.sizes:
                    weight_grads[0] += nbytes
            mark("backward", k)
            if not grads_held:
                for j, nbytes in enumerate(n.update_temps):
                    a.alloc(("ut", k, j), nbytes)
                mark("backward", k)
                cost = sum(n.grads) + sum(n.update_temps)
                work[0] += sum(nb for _, nb in extra) + cost
                if cost:
                    in_flight.append((k, work[0], cost))
                for item in [f for f in in_flight if work[0] - f[1] >= overlap * f[2]]:
                    in_flight.remove(item)
                    finish_update(item[0])
            else:
                pending.extend(("wg", k, j) for j in range(len(n.grads)))
            for key, _ in extra:
                a.free(key)
            for j in range(len(n.held_read_copies)):
                a.free(("rc", k, j))
            for o in dict.fromkeys(root(t) for t in n.outputs):
                if grad_of.pop(o, False):
                    a.free(("g", o))
            for t in freed_after.get(k, ()):
                if t in a.sizes:
                    kept_live[0] -= size[t]
                a.free(t)
        while in_flight:
            finish_update(in_flight.pop(0)[0])
        for i in list(grad_of):
            a.free(("g", i))
        for k, n in enumerate(nodes):
            for j in range(len(n.held_read_copies)):
                a.free(("rc", k, j))
        if grads_held:
            for k, n in enumerate(nodes):
                # one node's update temporaries are alive together, as when its gradients are not held
                for j, nbytes in enumerate(n.update_temps):
                    a.alloc(("ut", k, j), nbytes)
                mark("update", k)
                for j in range(len(n.update_temps)):
                    a.free(("ut", k, j))
                for j in range(len(n.early_update_temps)):
                    a.free(("et", k, j))
            for key in pending:
                a.free(key)
            weight_grads[0] = 0
        for t in allocated:
            if t not in held and t not in kept_until:
                a.free(t)
    peak, phase, where, saved_at, grads_at = best
    out = Replay(batch, int(peak), str(phase), int(where), saved_total, saved_by_row, forward_peak,
                 int(saved_at), int(grads_at))
    if a.track:
        out.parts = a.parts()
    return out
