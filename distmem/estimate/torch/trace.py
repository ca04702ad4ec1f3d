"""A simulated step's allocation trace replayed: later steps from the first one's record, and the
peak split into its parts (weights, gradients, optimizer state, activations...)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ...costs import EARLIER_BACKWARD, GRADIENT_BEING_MADE
from ..allocators import PARTS, CudaCachingAllocator, ExactAllocator

__all__ = ["replay_steps", "peak_parts", "gradient_frontier"]


def gradient_frontier(levels: Dict[int, Tuple[int, Dict[str, int]]]) -> List[Dict[str, int]]:
    """The backward moments a rank keeping a fraction of each gradient can peak at.

    ``levels``: for each number of gradient bytes made in the backward, the most bytes in use with
    that many made and their split. A rank that keeps a share ``1 - k`` of each gradient uses
    ``in_use - k x gradients`` at a moment; for every ``k`` between 0 (every gradient kept) and 1
    (none kept) its largest moment lies on the upper convex hull of the (gradients, in use) points,
    between the largest in use (``k = 0``) and the largest ``in_use - gradients`` (``k = 1``):
    those points, fewest gradients first, each as its split."""
    pts = sorted((g, m) for g, (m, _) in levels.items())
    hull: List[Tuple[int, int]] = []
    for g, m in pts:  # the upper hull, left to right (monotone chain)
        while len(hull) >= 2 and (hull[-1][0] - hull[-2][0]) * (m - hull[-2][1]) >= \
                (hull[-1][1] - hull[-2][1]) * (g - hull[-2][0]):
            hull.pop()
        hull.append((g, m))
    top = max(hull, key=lambda p: (p[1], -p[0]))
    none_kept = max(hull, key=lambda p: (p[1] - p[0], -p[0]))
    return [levels[g][1] for g, m in hull if none_kept[0] <= g <= top[0]]


def replay_steps(alloc, tracker, steps: int, peaks: List[int], phases: List[str]) -> None:
    """Steps after the first, replayed from the first one's allocation trace through the allocator
    model: the same kernels allocate and free the same buffers, except those the first step made
    and left alive (the optimizer's state, created once), which a later step finds in place."""
    trace = tracker.trace or []
    tracker.trace = None
    alive = set(tracker.serial.values())
    skip = {s for s, n, _ in trace if n >= 0 and s in alive}
    for r in range(steps):
        alloc.reset_peak()
        phase = "forward"
        for serial, n, ph in trace:
            if serial in skip:
                continue
            if n >= 0:
                before = alloc.peak
                alloc.alloc(("r", r, serial), n)
                if alloc.peak > before:
                    phase = ph
            else:
                alloc.free(("r", r, serial))
        for serial, n, _ in trace:  # whatever the trace left allocated (nothing, normally)
            alloc.free(("r", r, serial))
        peaks.append(alloc.peak)
        phases.append(phase)


def peak_parts(cuda: bool, before: List[Tuple[int, str]], trace: List[Tuple[int, int, str]], alive: set,
                grad_serials: set, workspaces: List[int], steps: int, which: int, peak: int,
                phases: Optional[Dict[str, Dict[str, int]]] = None) -> Dict[str, int]:
    """The peak of step ``which`` split into ``liveness.PARTS``: the recorded step replayed through a
    fresh allocator model in the same order, each buffer booked by what it was — weights and the
    batch (alive before the step), the weights' gradients, the optimizer state (made in the update
    and alive after it), kept activations (made in the forward pass and alive past it), cuBLAS
    workspaces, temporaries (everything else) — and the allocator's rounding beside them. With
    ``phases``, step ``which``'s peak within each phase is split the same way, and beside the
    backward's peak the moments of :func:`gradient_frontier` (``distmem.costs.EARLIER_BACKWARD`` 1, 2, ...)."""
    alloc = CudaCachingAllocator(track=True) if cuda else ExactAllocator(track=True)
    for i, (n, part) in enumerate(before):
        alloc.alloc(("pre", i), n, part)
    freed_in: Dict[int, str] = {}
    for serial, n, ph in trace:
        if n < 0:
            freed_in.setdefault(serial, ph)

    def part(serial: int, ph: str) -> str:
        if serial in grad_serials:
            return "gradients"
        if ph == "update" and serial in alive:
            return "optimizer state"
        if ph == "forward" and freed_in.get(serial) != "forward":
            return "activations"
        return "temporaries"
    results: List[Tuple[int, Dict[str, int]]] = []
    best: Dict[str, int] = {}
    levels: Dict[int, Tuple[int, Dict[str, int]]] = {}  # backward: gradients made -> (most in use, split)
    # the same, keyed by the gradients made before the newest one (a rank keeping a share of each
    # gradient holds the newest whole until its accumulation ends)
    settled: Dict[int, Tuple[int, Dict[str, int]]] = {}
    newest = [0]

    def split_now() -> Dict[str, int]:
        split = {p: int(alloc.by_part.get(p, 0)) for p in PARTS}
        split["allocator rounding"] += alloc.in_use - sum(split.values())
        return split

    def track(ph: str) -> None:
        # step ``which``'s peak within each phase, split the same way (``phases``); called only while
        # that step is replayed
        if alloc.in_use > best.get(ph, -1):
            best[ph] = alloc.in_use
            phases[ph] = split_now()
        if ph == "backward":
            made = int(alloc.by_part.get("gradients", 0))
            new = min(made, newest[0])
            if alloc.in_use > levels.get(made, (-1,))[0] or alloc.in_use > settled.get(made - new, (-1,))[0]:
                split = split_now()
                split["gradients"], split[GRADIENT_BEING_MADE] = made - new, new
                if alloc.in_use > levels.get(made, (-1,))[0]:
                    levels[made] = (alloc.in_use, split)
                if alloc.in_use > settled.get(made - new, (-1,))[0]:
                    settled[made - new] = (alloc.in_use, split)

    def book(key: Tuple, serial: int, n: int, ph: str) -> None:
        kind = part(serial, ph)
        alloc.alloc(key, n, kind)
        if kind == "gradients":
            newest[0] = n

    alloc.reset_peak()
    tracking = phases is not None and which == 0
    for serial, n, ph in trace:
        if n >= 0:
            book(("s", serial), serial, n, ph)
            if tracking:
                track(ph)
        else:
            alloc.free(("s", serial))
    for i, n in enumerate(workspaces):
        alloc.alloc(("cublas", i), n, "workspaces")
    results.append((alloc.peak, alloc.parts()))
    skip = {s for s, n, _ in trace if n >= 0 and s in alive}
    for r in range(steps - 1):
        alloc.reset_peak()
        tracking = phases is not None and which == r + 1
        for serial, n, ph in trace:
            if serial in skip:
                continue
            if n >= 0:
                book(("r", r, serial), serial, n, ph)
                if tracking:
                    track(ph)
            else:
                alloc.free(("r", r, serial))
        for serial, n, _ in trace:
            alloc.free(("r", r, serial))
        results.append((alloc.peak, alloc.parts()))
    if phases is not None and levels:
        earlier: List[Dict[str, int]] = []
        for m in gradient_frontier(levels) + gradient_frontier(settled):
            if m not in earlier:
                earlier.append(m)
        earlier.sort(key=lambda m: m["gradients"] + m[GRADIENT_BEING_MADE])
        for i, m in enumerate(earlier, 1):
            phases[f"{EARLIER_BACKWARD}{i}"] = m
    got, parts = results[which]
    if got != peak:  # the record does not reproduce the step: say so in the parts, never hide it
        parts["allocator rounding"] += peak - got
    return parts
