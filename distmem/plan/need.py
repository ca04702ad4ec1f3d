"""What a step that ran out of memory needed, what its peers needed, and which change lets it train. Pure.

The out-of-memory records (:mod:`distmem.observe.oom_record`: ``kind`` ``oom`` for a rank that ran
out, ``stopped`` for a rank fail fast stopped when another failed) are read here for the two that
act on them: the post-mortem (:mod:`distmem.report.postmortem`, which names the causes) and the next
plan (:mod:`distmem.plan.from_report`, which never plans a rank above its share of the GPU and says
which change fits where the need does not). Both use the same figures.

**The whole step's need.** What a rank held when an allocation failed plus what it asked for is
only a lower bound: the rest of the step (the forward's remaining layers, the backward, the
update) was still to come. The figure, best first:

``history``    its own earlier steps, as the allocator saw them (``note_step``): a step whose peak
               rose is an exact sample of that step's activations (peak - what it held entering
               it); scaled to this step's size (the elements of what it was fed) where sizes are known
``estimate``   distmem's estimate of the model (``note_estimate``) at this step's samples
``peers``      the other ranks of its stage measured the same way (their records: earlier steps, and
               the step a rank stopped by fail fast was in), scaled to this step's size: the
               estimator at that rank's batch, measured rather than modelled
``trend``      its own earlier steps without sizes: the same step again, on what it holds now
``at failure`` allocated + asked for: the lower bound, where nothing else is known

A figure below what the rank already held at the failure is short: the lower bound stands.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import defaults
from ..units import MiB, format_bytes, plural

__all__ = ["Record", "StepNeed", "ran_out", "stopped", "at_failure", "step_need", "peers_of", "peer_figure",
           "imbalance", "growth", "first_step_state", "gpu_offer", "equal_share", "rank_share", "outside_bytes", "device_short",
           "changes_for_need", "SOURCES"]

Record = Dict[str, Any]
SOURCES = ("history", "estimate", "peers", "trend", "at failure")
#: A figure this close under what the rank held plus asked for at the failure (>= this fraction of it)
#: is taken as that: the step's shape was right, its bytes a little low. Further below, it was wrong.
FIGURE_TOLERANCE = 0.9


def _int(v: Any) -> Optional[int]:
    """A byte or unit figure as an int; None where it is missing or not a plain non-negative number."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        n = int(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return n if n >= 0 else None


def _fmt(n: Optional[float]) -> str:
    return format_bytes(n) if n is not None else "?"


def ran_out(rec: Record) -> bool:
    """A record of a rank that ran out of memory (not one fail fast stopped, not a report's row)."""
    return rec.get("kind", "oom") == "oom"


def stopped(rec: Record) -> bool:
    return rec.get("kind") == "stopped"


def at_failure(rec: Record) -> Optional[int]:
    """Allocated + asked for at the failing allocation: the step's lower bound (None without both)."""
    a, r = _int(rec.get("allocated_bytes")), _int(rec.get("request_bytes"))
    return None if a is None or r is None else a + r


def _steps(rec: Record) -> List[Dict[str, Any]]:
    return [p for p in rec.get("steps") or [] if isinstance(p, dict) and _int(p.get("step")) is not None]


def _entering(rec: Record) -> Optional[int]:
    """What the rank held entering the step it was in (its last ``note_step`` of that step)."""
    steps = _steps(rec)
    if steps and rec.get("step") is not None and steps[-1].get("step") == rec.get("step"):
        return _int(steps[-1].get("allocated_bytes"))
    return None


def _units(rec: Record) -> Tuple[Optional[int], Optional[int]]:
    u = rec.get("units") or {}
    return _int(u.get("elements")), _int(u.get("samples"))


def _samples_of(rec: Record, current: bool) -> List[Tuple[Optional[int], int, int]]:
    """Exact step samples ``(elements, activation bytes, step)`` of one rank: each step during which
    its allocator's peak rose (the peak is that step's), the peak less what the rank held entering
    it; with ``current``, the step it was in when its record was written, where its peak rose in
    it. A rank's first noted step is left out where later ones were measured: it also created the
    gradients and optimizer state that stay (state, not activations)."""
    steps = _steps(rec)
    out: List[Tuple[Optional[int], int, int]] = []
    for a, b in zip(steps, steps[1:]):
        pa, pb = _int(a.get("peak_bytes")), _int(b.get("peak_bytes"))
        sa = _int(a.get("allocated_bytes"))
        if None in (pa, pb, sa) or pb <= pa or b.get("step") != a.get("step") + 1:  # type: ignore[operator]
            continue
        out.append((_int(a.get("elements")), pb - sa, int(a["step"])))  # type: ignore[operator]
    if current and steps and steps[-1].get("step") == rec.get("step"):
        last, peak = steps[-1], _int(rec.get("peak_bytes"))
        pl, s = _int(last.get("peak_bytes")), _int(last.get("allocated_bytes"))
        if None not in (peak, pl, s) and peak > pl:  # type: ignore[operator]
            out.append((_int(last.get("elements")), peak - s, int(last["step"])))  # type: ignore[operator]
    if len(out) > 1 and steps and out[0][2] == steps[0].get("step"):
        out = out[1:]
    return out


def _per_unit(samples: Sequence[Tuple[Optional[int], int, int]]) -> Optional[Tuple[float, float]]:
    """``(fixed, per element)`` of a step's activations from exact samples with sizes: a line through
    them where sizes differ (never a negative slope or intercept), else through zero."""
    pts = [(u, act) for u, act, _ in samples if u]
    if not pts:
        return None
    if len({u for u, _ in pts}) >= 2:
        n = len(pts)
        mu, ma = sum(u for u, _ in pts) / n, sum(a for _, a in pts) / n
        var = sum((u - mu) ** 2 for u, _ in pts)
        slope = sum((u - mu) * (a - ma) for u, a in pts) / var if var else 0.0
        fixed = ma - slope * mu
        if slope > 0 and fixed >= 0:
            return fixed, slope
    return 0.0, max(a / u for u, a in pts)


@dataclass(frozen=True)
class StepNeed:
    """What one rank's failing step needed. ``bytes``: the best figure for the whole step;
    ``source``: one of :data:`SOURCES`; ``lower_bound``: only allocated + asked for is known (or a
    figure fell short of it); ``entering_bytes``: what it held entering the step; ``fixed_bytes`` /
    ``per_element``: the step's activations as a line in the size of what it was fed (where known);
    ``elements``/``samples``: that size; ``evidence``: the figures the need rests on, in words."""

    bytes: Optional[int]
    source: str
    lower_bound: bool
    at_failure: Optional[int]
    entering_bytes: Optional[int] = None
    fixed_bytes: Optional[float] = None
    per_element: Optional[float] = None
    elements: Optional[int] = None
    samples: Optional[int] = None
    evidence: str = ""
    estimate_points: List[Tuple[int, int]] = field(default_factory=list)

    def at_elements(self, elements: float) -> Optional[int]:
        """The step's need fed ``elements`` instead (what it holds entering + the activation line)."""
        if self.per_element is None or self.entering_bytes is None:
            return None
        return int(self.entering_bytes + (self.fixed_bytes or 0) + self.per_element * elements)

    def at_samples(self, samples: int) -> Optional[int]:
        """The step's need at ``samples`` (a micro-batch): the estimate's figure where it has one at
        that size, else the activation line at that many samples' elements."""
        for s, b in self.estimate_points:
            if s == samples:
                return b
        if self.elements and self.samples:
            return self.at_elements(self.elements * samples / self.samples)
        return None


def first_step_state(rec: Record, peers: Sequence[Record] = ()) -> int:
    """Where ``rec`` failed in its first noted step: the state a first step leaves behind (gradients,
    optimizer slots), as the median rise over their first step of the ranks (its peers, or its own
    records) that got past theirs; 0 where it was not its first step or none did."""
    steps = _steps(rec)
    if len(steps) != 1 or steps[0].get("step") != rec.get("step"):
        return 0
    rises = []
    for p in peers:
        ps = _steps(p)
        if len(ps) >= 2 and ps[1].get("step") == ps[0].get("step") + 1:  # type: ignore[operator]
            a, b = _int(ps[0].get("allocated_bytes")), _int(ps[1].get("allocated_bytes"))
            if a is not None and b is not None and b > a:
                rises.append(b - a)
    return int(statistics.median(rises)) if rises else 0


def step_need(rec: Record, peers: Sequence[Record] = ()) -> StepNeed:
    """The whole failing step's need of ``rec`` (see the module's sources), with ``peers`` the
    records of the other ranks of its stage (``stopped`` or ``oom``)."""
    low = at_failure(rec)
    entering = _entering(rec)
    created = first_step_state(rec, peers)
    if entering is not None and created:
        entering += created  # its first step would have left this state behind, as its peers' did
    elements, samples = _units(rec)
    est = rec.get("estimate") or {}
    points = sorted(((int(s), int(b)) for s, b in (est.get("points") or [])
                     if _int(s) and _int(b) is not None), reverse=True)
    base = dict(at_failure=low, entering_bytes=entering, elements=elements, samples=samples, estimate_points=points)
    found: Optional[StepNeed] = None
    own = _samples_of(rec, current=False)
    line = _per_unit(own) if elements else None
    if line is not None and entering is not None and elements:
        need = int(entering + line[0] + line[1] * elements)
        found = StepNeed(need, "history", False, fixed_bytes=line[0], per_element=line[1], evidence=(
            f"its own {len(own)} earlier step(s) whose peak rose, {_fmt(line[0] + line[1] * elements)} of "
            f"activations at this step's {elements} elements, on the {_fmt(entering)} it held entering the step"),
            **base)
    if found is None and points and samples:
        at = next((b for s, b in points if s == samples), None)
        if at is not None:
            found = StepNeed(at, "estimate", False, evidence=(
                f"distmem's estimate of its model ({est.get('method') or '?'}) at its {samples} samples"), **base)
    if found is None and elements and entering is not None:
        # a peer that ran out did not finish its step: only its earlier steps count
        theirs = [s for p in peers for s in _samples_of(p, current=not ran_out(p))]
        line = _per_unit(theirs)
        if line is not None:
            need = int(entering + line[0] + line[1] * elements)
            found = StepNeed(need, "peers", False, fixed_bytes=line[0], per_element=line[1], evidence=(
                f"its peers' steps ({len(theirs)} from {len({id(p) for p in peers})} rank(s)) scaled to its "
                f"{elements} elements: {_fmt(line[0] + line[1] * elements)} of activations on the {_fmt(entering)} it "
                "held entering the step"), **base)
    if found is None and own and entering is not None:
        act = max(a for _, a, _ in own)
        found = StepNeed(int(entering + act), "trend", False, fixed_bytes=float(act), per_element=None,
                         evidence=(f"its own earlier steps: {_fmt(act)} of activations on the {_fmt(entering)} it "
                                   "held entering this step (the same step again; sizes not noted)"), **base)
    if found is not None and low is not None and found.bytes is not None and low * FIGURE_TOLERANCE <= found.bytes < low:
        # a little short of what it already held: the figure's shape stands, on the bytes it held
        found = replace(found, bytes=low, evidence=found.evidence + f"; {_fmt(found.bytes)}, raised to the "
                                                                     f"{_fmt(low)} it held plus asked for")
    if found is not None and low is not None and found.bytes is not None and found.bytes < low:
        return StepNeed(low, "at failure", True, evidence=(
            f"it held {_fmt(rec.get('allocated_bytes'))} and asked for {_fmt(rec.get('request_bytes'))}; the "
            f"{found.source} figure ({_fmt(found.bytes)}) was short of that"),
                        **{**base, "fixed_bytes": found.fixed_bytes, "per_element": found.per_element})
    if found is not None:
        if created:
            found = replace(found, evidence=found.evidence + f" (with the {_fmt(created)} of gradients and optimizer "
                                                             "state a first step leaves behind, as its peers' did)")
        return found
    return StepNeed(low, "at failure", True, evidence=(
        f"allocated {_fmt(rec.get('allocated_bytes'))} + asked for {_fmt(rec.get('request_bytes'))}: the rest of "
        "the step is not known (note_step(step, batch) and note_estimate(...) record what prices it)"), **base)


# -- the other ranks ----------------------------------------------------------------------------

def peers_of(rec: Record, records: Sequence[Record]) -> List[Record]:
    """The other ranks' records of ``rec``'s pipeline stage (all the others where no stage is planned)."""
    me = rec.get("rank")
    return [r for r in records if r.get("rank") != me and r.get("stage") == rec.get("stage")]


def peer_figure(rec: Record) -> Optional[int]:
    """A peer's figure for the median: what it needed where it ran out (its own history, estimate or
    lower bound: no peers, so no recursion), its allocator peak where it was stopped or reported."""
    if ran_out(rec):
        return step_need(rec).bytes
    return _int(rec.get("peak_bytes"))


def imbalance(rec: Record, need: StepNeed, peers: Sequence[Record]) -> Optional[Dict[str, Any]]:
    """How far ``rec``'s step is from its peers': ``ratio`` of its need to the median of their
    figures, ``units_ratio`` of its size to the median of theirs (where sizes are known)."""
    figures = [f for f in (peer_figure(p) for p in peers) if f]
    if not figures or not need.bytes:
        return None
    median = statistics.median(figures)
    units = [u for u in (_units(p)[0] for p in peers) if u]
    # a peer stopped inside its first step has a partial peak; one that finished a step has a whole one
    complete = all(not stopped(p) or len(_steps(p)) >= 2 or (_int(p.get("step")) or 0) >= 1 for p in peers)
    out: Dict[str, Any] = {"ratio": need.bytes / median, "median_bytes": int(median), "peers": len(figures),
                           "at_failure_ratio": (need.at_failure / median) if need.at_failure else None,
                           "peers_complete": complete}
    if units and need.elements:
        mu = statistics.median(units)
        out.update(units_ratio=need.elements / mu, median_elements=int(mu),
                   median_samples=statistics.median([s for s in (_units(p)[1] for p in peers) if s] or [0]) or None)
    return out


def growth(rec: Record) -> Optional[Dict[str, Any]]:
    """Memory that grows from step to step: what the rank held entering each step, over its last
    steps, rising steadily (a least-squares slope ``per_step_bytes``, ``r2`` of the line, ``since``
    step, ``grew_bytes`` in all). None below :data:`defaults.GROWTH_MIN_STEPS` steps or
    :data:`defaults.GROWTH_MIN_BYTES`."""
    pts = [(int(p["step"]), _int(p.get("allocated_bytes"))) for p in _steps(rec)]
    pts = [(s, a) for s, a in pts if a is not None]
    # the run of consecutive steps that ends at the latest one
    run = pts[-1:]
    for s, a in reversed(pts[:-1]):
        if s != run[0][0] - 1:
            break
        run.insert(0, (s, a))
    if len(run) < defaults.GROWTH_MIN_STEPS:
        return None
    # steps 0-1 build lazily made state (optimizer slots, gradients): start after the first rise settles
    xs = [float(s) for s, _ in run]
    ys = [float(a) for _, a in run]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    ss = sum((y - my) ** 2 for y in ys)
    res = sum((y - (my + slope * (x - mx))) ** 2 for x, y in zip(xs, ys))
    r2 = 1 - res / ss if ss else 0.0
    rises = sum(1 for (_, a), (_, b) in zip(run, run[1:]) if b > a)
    grew = run[-1][1] - run[0][1]
    if slope <= 0 or grew < defaults.GROWTH_MIN_BYTES or rises < 0.75 * (n - 1):
        return None
    return {"per_step_bytes": int(slope), "r2": round(r2, 3), "since": run[0][0], "steps": n, "grew_bytes": grew,
            "first_bytes": run[0][1], "last_bytes": run[-1][1]}


# -- what the GPU offers -----------------------------------------------------------------------

def gpu_offer(rec: Record, ranks: Optional[int] = None, foreign: Optional[int] = None,
              overhead: Optional[int] = None) -> Optional[int]:
    """What the rank's GPU offers ``ranks`` processes together (the plan's formula, from the figures
    the record carries: total, driver reserved, reserve, foreign, per-process overhead)."""
    total = _int(rec.get("device_total_bytes"))
    if total is None:
        return None
    k = ranks if ranks is not None else max(_int(rec.get("shared_by")) or 1, 1)
    f = (_int(rec.get("foreign_planned_bytes")) or 0) if foreign is None else foreign
    ov = (_int(rec.get("overhead_bytes")) or 0) if overhead is None else overhead
    return total - (_int(rec.get("driver_reserved_bytes")) or 0) - (_int(rec.get("reserve_bytes")) or 0) - f - k * ov


def equal_share(rec: Record, ranks: Optional[int] = None, **kw: Any) -> Optional[int]:
    """Each of ``ranks`` processes' equal share of the rank's GPU, in whole MiB (None without figures)."""
    k = ranks if ranks is not None else max(_int(rec.get("shared_by")) or 1, 1)
    offer = gpu_offer(rec, k, **kw)
    return None if offer is None else max(offer // k // MiB * MiB, 0)


def rank_share(rec: Record) -> Optional[int]:
    """The most a plan gives this rank: the limit the job stated per rank (``limit=``), else for a
    pipeline rank what its GPU offers less the other stages' planned limits on it, else its equal share."""
    if rec.get("explicit_limit"):
        return _int(rec.get("limit_bytes"))
    if rec.get("stage") is not None and rec.get("stages"):
        k = max(_int(rec.get("shared_by")) or 1, 1)
        offer = gpu_offer(rec, k)
        if offer is None:
            return None
        others = sorted((_int(r.get("planned_bytes")) or 0 for r in rec["stages"] if r.get("stage") != rec["stage"]),
                        reverse=True)[:k - 1]
        return max(offer - sum(others), 0) // MiB * MiB
    return equal_share(rec)


def outside_bytes(rec: Record, reserved_of: Dict[int, int]) -> Dict[str, int]:
    """Per process of the job on the rank's GPU (``self``, ``rank N``): NVML's bytes for it less its
    allocator's pool (``reserved_of``: rank -> reserved bytes, from its record) less the plan's
    per-process overhead; only processes whose pool is known."""
    ov = _int(rec.get("overhead_bytes"))
    ov = defaults.OVERHEAD_BYTES if ov is None else ov
    out: Dict[str, int] = {}
    for p in rec.get("gpu_processes") or []:
        who, used = p.get("who"), _int(p.get("bytes"))
        if used is None:
            continue
        if who == "self":
            pool = _int(rec.get("reserved_bytes"))
        elif isinstance(who, str) and who.startswith("rank "):
            try:
                pool = reserved_of.get(int(who.split()[1]))
            except ValueError:
                pool = None
        else:
            continue
        if pool is not None:
            out[str(who)] = used - pool - ov
    return out


def device_short(rec: Record) -> Optional[int]:
    """By how much the device itself was short of the request (request - what the driver had free),
    where the record has both; > 0: the GPU was full, not the rank's limit."""
    free, req = _int(rec.get("device_free_bytes")), _int(rec.get("request_bytes"))
    if free is None or req is None:
        return None
    return req - free


# -- changes that let the step train -----------------------------------------------------------

def _fits(need: Optional[int], limit: Optional[int], margin: float) -> Optional[bool]:
    if need is None or limit is None:
        return None
    return need * (1 + margin) <= limit


def changes_for_need(rec: Record, need: StepNeed, peers: Sequence[Record] = (),
                     margin: float = defaults.FROM_REPORT_MARGIN) -> List[Dict[str, Any]]:
    """Changes that bring the step's need within what the rank is given, each with the figure it gives
    (``need_bytes`` against ``limit_bytes``) and whether that fits with ``margin`` to spare (``fits``;
    None where it cannot be priced): a smaller micro-batch, the batch balanced over the stage's
    ranks, fewer ranks per GPU, a larger limit within the rank's share, recompute."""
    limit = _int(rec.get("limit_bytes"))
    out: List[Dict[str, Any]] = []
    if need.bytes is None or limit is None:
        return out
    share = rank_share(rec)
    # the batch balanced over the stage's ranks: each its share of what they were fed together
    units = [u for u in [need.elements] + [_units(p)[0] for p in peers] if u]
    samples = [s for s in [need.samples] + [_units(p)[1] for p in peers] if s]
    if peers and len(units) == len(peers) + 1:
        even = sum(units) / len(units)
        figure = need.at_elements(even)
        if figure is not None and even < (need.elements or 0):
            each = (sum(samples) / len(samples)) if len(samples) == len(units) else None
            out.append({"change": "balance_batch", "elements_per_rank": int(even),
                        "samples_per_rank": round(each, 1) if each else None, "need_bytes": figure,
                        "limit_bytes": limit, "fits": _fits(figure, limit, margin),
                        "text": f"balance the batch over the {len(units)} ranks: each its share, {int(even)} elements"
                                + (f" ({each:.0f} samples)" if each else "") + f": about {_fmt(figure)}"})
    # a smaller micro-batch (gradient accumulation keeps the batch)
    if need.samples and need.samples > 1:
        best = None
        for m in sorted({max(need.samples >> i, 1) for i in range(1, 12)}, reverse=True):
            figure = need.at_samples(m)
            if figure is not None and _fits(figure, limit, margin):
                best = (m, figure)
                break
        if best is not None:
            m, figure = best
            acc = -(-need.samples // m)
            out.append({"change": "micro_batch", "micro_batch": m, "accumulation": acc, "need_bytes": figure,
                        "limit_bytes": limit, "fits": True,
                        "text": f"a micro-batch of {plural(m, 'sample')} with {acc} accumulation steps (the same batch): "
                                f"about {_fmt(figure)}"})
        else:
            smallest = need.at_samples(1)
            if smallest is not None:
                out.append({"change": "micro_batch", "micro_batch": 1, "accumulation": need.samples,
                            "need_bytes": smallest, "limit_bytes": limit, "fits": _fits(smallest, limit, margin),
                            "text": f"even a micro-batch of 1 sample needs about {_fmt(smallest)}"})
    # a larger limit, within the rank's share of its GPU
    hold = -(-int(need.bytes * (1 + margin)) // MiB) * MiB
    if share is not None and hold > limit:
        out.append({"change": "limit", "limit_bytes": hold, "share_bytes": share, "need_bytes": need.bytes,
                    "fits": hold <= share,
                    "text": (f"plan it at {_fmt(hold)} (its need + {margin:.0%}), within its share "
                             f"{_fmt(share)}: distmem plan --from RUN_DIR" if hold <= share else
                             f"a limit of {_fmt(hold)} is above its share of the GPU ({_fmt(share)})")})
    # fewer ranks per GPU (not where the job stated its own per-rank limit)
    k = max(_int(rec.get("shared_by")) or 1, 1)
    if k > 1 and not rec.get("explicit_limit"):
        fewer = equal_share(rec, k - 1)
        if fewer is not None:
            out.append({"change": "fewer_ranks", "ranks_per_gpu": k - 1, "share_bytes": fewer,
                        "need_bytes": need.bytes, "fits": _fits(need.bytes, fewer, margin),
                        "text": f"{plural(k - 1, 'rank')} on its GPU instead of {k}: each gets {_fmt(fewer)}"})
    # recompute: what it frees depends on the checkpoints; distmem fit prices it
    if need.per_element is not None and need.elements:
        acts = int((need.fixed_bytes or 0) + need.per_element * need.elements)
        out.append({"change": "recompute", "need_bytes": None, "limit_bytes": limit, "fits": None,
                    "activation_bytes": acts,
                    "text": f"recompute activations (checkpointing): up to {_fmt(acts)} of the step's activations are "
                            "kept for the backward; distmem fit prices the layout with recomputation"})
    return out
