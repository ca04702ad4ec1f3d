"""A simulated step's allocation trace replayed: later steps from the first one's record, and the
peak split into its parts (weights, gradients, optimizer state, activations...)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..allocators import PARTS, CudaCachingAllocator, ExactAllocator

__all__ = ["replay_steps", "peak_parts"]


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
    workspaces, temporaries (everything else) — and the allocator's rounding beside them."""
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

    def track(ph: str) -> None:
        # step ``which``'s peak within each phase, split the same way (``phases``); called only while
        # that step is replayed
        if alloc.in_use > best.get(ph, -1):
            best[ph] = alloc.in_use
            split = {p: int(alloc.by_part.get(p, 0)) for p in PARTS}
            split["allocator rounding"] += alloc.in_use - sum(split.values())
            phases[ph] = split

    alloc.reset_peak()
    tracking = phases is not None and which == 0
    for serial, n, ph in trace:
        if n >= 0:
            alloc.alloc(("s", serial), n, part(serial, ph))
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
                alloc.alloc(("r", r, serial), n, part(serial, ph))
                if tracking:
                    track(ph)
            else:
                alloc.free(("r", r, serial))
        for serial, n, _ in trace:
            alloc.free(("r", r, serial))
        results.append((alloc.peak, alloc.parts()))
    got, parts = results[which]
    if got != peak:  # the record does not reproduce the step: say so in the parts, never hide it
        parts["allocator rounding"] += peak - got
    return parts
