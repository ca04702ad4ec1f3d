"""``report(detail="summary")``: the job's aggregates by all-reduce, for jobs of thousands of ranks.

Instead of gathering one row per rank to rank 0, every rank contributes a fixed-size vector of its
figures and the transport all-reduces it, so the message size and rank 0's memory do not grow
with the job. Extremes carry the rank that holds them: a second reduction takes, for every
extreme, the lowest rank whose own value equals it (the same tie rule as the full report). The
aggregates equal those of ``aggregate()`` over the same snapshots, key for key.

Rounds (every rank enters all of them, in this order; the number of rounds depends only on reduced
values, so it is the same on every rank):

1. ``sum`` of counts and totals, ``max`` of maxima (minima as negated maxima) and, for each
   extreme, its lowest holder: :meth:`Comm.allreduce_sum_maxloc` - under MPI one round (SUM and
   MAXLOC posted together), elsewhere a ``sum``, a ``max`` and a ``max`` of ``-rank`` over the ranks
   whose value equals the maximum;
2. only when a warning needs them: ``sum`` of the figures the unique lowest holders contribute
   (their peak and limit, NVML and pool bytes), zero from everyone else.

:func:`reduce_locally` is the same reduction over a list of snapshots in one process (tests).

A rank that never arrives makes the all-reduce time out on every rank that did; rank 0 then returns
a report that says so (a summary cannot name the missing rank: use ``detail="full"``).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..comm.base import reduce_sum_maxloc
from ..errors import GatherTimeoutError
from ..observe.snapshot import Snapshot, allocator_pool_bytes, nvml_on_planned, outside_allocator_bytes, plan_usage
from . import findings as F
from .aggregate import Report
from .findings import WARN_IMBALANCE, WARN_IMBALANCE_MIN_BYTES, WARN_NEAR_LIMIT, Findings

__all__ = ["summary_report", "local_vectors", "reduce_locally", "build_report", "STAGE_SLOTS", "SUM_AT", "MAX_AT",
           "HOLDERS", "DETAIL_AT"]

log = logging.getLogger("distmem")

#: Stage groups kept apart in the reduction: slot 0 for ranks without a stage, then one slot per
#: pipeline stage up to this count; deeper stages share the last slot (and the report says so).
STAGE_SLOTS = 33
_NEG = -math.inf

# The reduced vectors are indexed by name through these maps (SUM_AT: round-1 sums, MAX_AT: round-1
# maxima, HOLDERS: the extremes whose lowest holder round 2 finds, DETAIL_AT: round-3 figures).
# Round 1, sum: index of each field.
SUM_AT = {k: i for i, k in enumerate([
    "count", "current", "has_peak", "peak", "has_limit", "limit", "has_nvml", "nvml", "n_above", "n_near",
    "n_outside", "n_intruder", "n_crowded", "has_rss", "rss", "has_reserved", "reserved"])}
# Round 1, max (minima negated): index of each field.
MAX_AT = {k: i for i, k in enumerate([
    "peak", "neg_peak", "neg_head", "above_ratio", "near_ratio", "excess", "fp", "neg_fp", "nvml", "current",
    "crowd", "intruder"])}
# Extremes whose lowest holder round 2 finds, in vector order: (round-1 max index, name).
HOLDERS = ["peak", "neg_peak", "neg_head", "above_ratio", "near_ratio", "excess", "fp", "neg_fp", "crowd", "intruder"]
# Round 3: figures of a unique holder.
DETAIL_AT = {k: i for i, k in enumerate([
    "above_peak", "above_limit", "above_enforced", "near_peak", "near_limit", "x_nvml", "x_pool", "x_outside",
    "x_overhead", "x_reserved", "crowd_dev", "crowd_pids", "crowd_shared", "intr_dev", "intr_bytes",
    "above_alloc", "above_res", "near_alloc", "near_res"])}


def _slot(stage: Optional[int]) -> int:
    if stage is None:
        return 0
    return min(int(stage) + 1, STAGE_SLOTS - 1)


def _fp(s: Snapshot) -> float:
    """The plan fingerprint as an integer that float64 carries exactly (48 bits of the hash)."""
    return float(int(s.plan_fingerprint[:12], 16)) if s.plan_fingerprint else _NEG


def _crowd(s: Snapshot) -> Tuple[int, int, int, int]:
    """(extra processes, device, pids listed, ranks planned) for this rank's most crowded GPU: NVML lists
    more processes on it than the plan put ranks there."""
    shared = {d.get("index"): int(d.get("shared_by") or 1) for d in (s.allocation or {}).get("devices", [])}
    best = (0, -1, 0, 0)
    for dev, pids in s.gpu_pids.items():
        k = shared.get(dev, 1)
        extra = len(set(pids)) - k
        if extra > best[0]:
            best = (extra, dev, len(set(pids)), k)
    return best


def _intrusion(s: Snapshot) -> Tuple[int, Optional[int]]:
    """(device, bytes) of a GPU NVML shows this rank on although the plan did not give it: -1 if none."""
    for dev, used in sorted(s.nvml_bytes.items()):
        if dev not in s.devices:
            return dev, used
    return -1, None


def local_vectors(s: Snapshot, near: float = WARN_NEAR_LIMIT) -> Tuple[List[float], List[float]]:
    """This rank's round-1 contributions: (sum vector, max vector). Fixed length for every rank."""
    peak, cur, lim, nv = s.peak_or_current, s.current_bytes, s.limit_bytes or None, s.nvml_total
    used = plan_usage(s)
    outside = outside_allocator_bytes(s)
    excess = outside - s.overhead_bytes if (outside is not None and s.overhead_bytes is not None) else None
    ratio = used / lim if (lim and used is not None) else None
    crowd = _crowd(s)[0]
    intr_dev = _intrusion(s)[0]
    sv = [0.0] * len(SUM_AT) + [0.0] * (2 * STAGE_SLOTS)
    sv[SUM_AT["count"]] = 1
    sv[SUM_AT["current"]] = cur or 0
    if peak is not None:
        sv[SUM_AT["has_peak"]], sv[SUM_AT["peak"]] = 1, peak
        base = len(SUM_AT) + 2 * _slot(s.stage)
        sv[base], sv[base + 1] = 1, peak
    if lim:
        sv[SUM_AT["has_limit"]], sv[SUM_AT["limit"]] = 1, lim
    if nv is not None:
        sv[SUM_AT["has_nvml"]], sv[SUM_AT["nvml"]] = 1, nv
    above = ratio is not None and ratio > 1
    is_near = ratio is not None and not above and used > F.near_threshold(  # type: ignore[operator]
        lim, (s.allocation or {}).get("demand_bytes"), near)
    sv[SUM_AT["n_above"]], sv[SUM_AT["n_near"]] = float(above), float(is_near)
    sv[SUM_AT["n_outside"]] = float(excess is not None and excess > 0)
    sv[SUM_AT["n_intruder"]] = float(intr_dev >= 0)
    sv[SUM_AT["n_crowded"]] = float(crowd > 0)
    if s.rss_bytes is not None:
        sv[SUM_AT["has_rss"]], sv[SUM_AT["rss"]] = 1, s.rss_bytes
    if s.reserved_bytes is not None:
        sv[SUM_AT["has_reserved"]], sv[SUM_AT["reserved"]] = 1, s.reserved_bytes
    mv = [_NEG] * len(MAX_AT) + [_NEG] * (2 * STAGE_SLOTS)
    if peak is not None:
        mv[MAX_AT["peak"]], mv[MAX_AT["neg_peak"]] = peak, -peak
        base = len(MAX_AT) + 2 * _slot(s.stage)
        mv[base], mv[base + 1] = peak, -peak
    if lim and peak is not None:
        mv[MAX_AT["neg_head"]] = -(lim - peak)
    if above:
        mv[MAX_AT["above_ratio"]] = ratio  # type: ignore[assignment]
    if is_near:
        mv[MAX_AT["near_ratio"]] = ratio  # type: ignore[assignment]
    if excess is not None and excess > 0:
        mv[MAX_AT["excess"]] = excess
    fp = _fp(s)
    mv[MAX_AT["fp"]], mv[MAX_AT["neg_fp"]] = fp, (-fp if fp != _NEG else _NEG)
    if nv is not None:
        mv[MAX_AT["nvml"]] = nv
    if cur is not None:
        mv[MAX_AT["current"]] = cur
    if crowd > 0:
        mv[MAX_AT["crowd"]] = crowd
    if intr_dev >= 0:
        mv[MAX_AT["intruder"]] = 1
    return sv, mv


def _detail_vector(s: Snapshot, holders: Dict[str, Optional[int]]) -> List[float]:
    """Round 3: the figures behind the extremes this rank is the lowest holder of; zeros otherwise."""
    d = [0.0] * len(DETAIL_AT)
    peak, lim = plan_usage(s), s.limit_bytes
    alloc = s.peak_or_current
    res = s.reserved_bytes
    if holders.get("above_ratio") == s.rank:
        d[DETAIL_AT["above_peak"]], d[DETAIL_AT["above_limit"]] = peak or 0, lim or 0
        d[DETAIL_AT["above_enforced"]] = float(s.enforced)
        d[DETAIL_AT["above_alloc"]] = -1 if alloc is None else alloc
        d[DETAIL_AT["above_res"]] = -1 if res is None else res
    if holders.get("near_ratio") == s.rank:
        d[DETAIL_AT["near_peak"]], d[DETAIL_AT["near_limit"]] = peak or 0, lim or 0
        d[DETAIL_AT["near_alloc"]] = -1 if alloc is None else alloc
        d[DETAIL_AT["near_res"]] = -1 if res is None else res
    if holders.get("excess") == s.rank:
        d[DETAIL_AT["x_nvml"]] = nvml_on_planned(s) or 0
        d[DETAIL_AT["x_pool"]] = allocator_pool_bytes(s) or 0
        d[DETAIL_AT["x_outside"]] = outside_allocator_bytes(s) or 0
        d[DETAIL_AT["x_overhead"]] = s.overhead_bytes or 0
        d[DETAIL_AT["x_reserved"]] = float(s.reserved_bytes is not None)
    if holders.get("crowd") == s.rank:
        extra, dev, n, k = _crowd(s)
        d[DETAIL_AT["crowd_dev"]], d[DETAIL_AT["crowd_pids"]], d[DETAIL_AT["crowd_shared"]] = dev, n, k
    if holders.get("intruder") == s.rank:
        dev, used = _intrusion(s)
        d[DETAIL_AT["intr_dev"]], d[DETAIL_AT["intr_bytes"]] = dev, (used if used is not None else -1)
    return d


def _named(lowest: Sequence[Optional[int]]) -> Tuple[Dict[str, Optional[int]], List[Optional[int]]]:
    """The lowest holder of each named extreme, and of each stage slot's max and min."""
    return {name: lowest[MAX_AT[name]] for name in HOLDERS}, list(lowest[len(MAX_AT):])


def _needs_details(rs: Sequence[float]) -> bool:
    return any(rs[SUM_AT[k]] > 0 for k in ("n_above", "n_near", "n_outside", "n_crowded", "n_intruder"))


def build_report(world_size: int, strategy: str, rs: Sequence[float], rm: Sequence[float],
                 holders: Dict[str, Optional[int]], stage_holders: Sequence[Optional[int]],
                 details: Optional[Sequence[float]], *, near: float = WARN_NEAR_LIMIT,
                 imbalance: float = WARN_IMBALANCE, imbalance_min_bytes: int = WARN_IMBALANCE_MIN_BYTES) -> Report:
    """Turn the reduced vectors into a Report with the same aggregates as ``aggregate()``."""
    count = int(rs[SUM_AT["count"]])
    agg: Dict[str, Any] = {"ranks_reporting": count, "ranks_missing": world_size - count}
    n_peak = int(rs[SUM_AT["has_peak"]])
    if n_peak:
        mean = rs[SUM_AT["peak"]] / n_peak
        mx, mn = rm[MAX_AT["peak"]], -rm[MAX_AT["neg_peak"]]
        agg.update(total_current_bytes=int(rs[SUM_AT["current"]]), total_peak_bytes=int(rs[SUM_AT["peak"]]),
                   max_peak_bytes=int(mx), min_peak_bytes=int(mn), mean_peak_bytes=mean,
                   imbalance=(mx / mean) if mean else None, max_peak_rank=holders["peak"])
    if rs[SUM_AT["has_limit"]]:
        agg["total_limit_bytes"] = int(rs[SUM_AT["limit"]])
    if rm[MAX_AT["neg_head"]] != _NEG:
        agg.update(min_headroom_bytes=int(-rm[MAX_AT["neg_head"]]), min_headroom_rank=holders["neg_head"])
    if rs[SUM_AT["has_nvml"]]:
        agg["total_nvml_bytes"] = int(rs[SUM_AT["nvml"]])
    extra = {"max_current_bytes": int(rm[MAX_AT["current"]]) if rm[MAX_AT["current"]] != _NEG else None,
             "max_nvml_bytes": int(rm[MAX_AT["nvml"]]) if rm[MAX_AT["nvml"]] != _NEG else None,
             "total_rss_bytes": int(rs[SUM_AT["rss"]]) if rs[SUM_AT["has_rss"]] else None,
             "total_reserved_bytes": int(rs[SUM_AT["reserved"]]) if rs[SUM_AT["has_reserved"]] else None,
             "min_peak_rank": holders["neg_peak"]}
    agg["summary"] = {k: v for k, v in extra.items() if v is not None}

    out = Findings()
    det = details or [0.0] * len(DETAIL_AT)
    fig = lambda name: None if det[DETAIL_AT[name]] < 0 else det[DETAIL_AT[name]]  # noqa: E731
    if rm[MAX_AT["fp"]] != _NEG and rm[MAX_AT["fp"]] != -rm[MAX_AT["neg_fp"]]:
        out.add(F.plan_mismatch(pair=(holders["neg_fp"], holders["fp"])))
    n_above = int(rs[SUM_AT["n_above"]])
    if n_above:
        out.add(F.above_plan(holders["above_ratio"], det[DETAIL_AT["above_peak"]], det[DETAIL_AT["above_limit"]],
                             rm[MAX_AT["above_ratio"]], peak=fig("above_alloc"), reserved=fig("above_res"),
                             enforced=bool(det[DETAIL_AT["above_enforced"]]), count=n_above))
    n_near = int(rs[SUM_AT["n_near"]])
    if n_near:
        out.add(F.near_limit(holders["near_ratio"], det[DETAIL_AT["near_peak"]], det[DETAIL_AT["near_limit"]],
                             rm[MAX_AT["near_ratio"]], near=near, peak=fig("near_alloc"), reserved=fig("near_res"),
                             count=n_near))
    n_intr = int(rs[SUM_AT["n_intruder"]])
    if n_intr:
        owner = holders["crowd"]
        out.add(F.shared_gpu_summary(n_intr, holders["intruder"], int(det[DETAIL_AT["intr_dev"]]),
                                     det[DETAIL_AT["intr_bytes"]], owner, int(det[DETAIL_AT["crowd_dev"]]),
                                     int(det[DETAIL_AT["crowd_pids"]]), int(det[DETAIL_AT["crowd_shared"]])))
    elif int(rs[SUM_AT["n_crowded"]]):
        out.add(F.foreign_process_summary(int(rs[SUM_AT["n_crowded"]]), holders["crowd"],
                                          int(det[DETAIL_AT["crowd_dev"]]), int(det[DETAIL_AT["crowd_pids"]]),
                                          int(det[DETAIL_AT["crowd_shared"]]), int(rm[MAX_AT["crowd"]])))
    ratios: Dict[str, float] = {}
    folded = False
    for j in range(STAGE_SLOTS):
        n = int(rs[len(SUM_AT) + 2 * j])
        if n < 2:
            continue
        total = rs[len(SUM_AT) + 2 * j + 1]
        mean = total / n
        mx, mn = rm[len(MAX_AT) + 2 * j], -rm[len(MAX_AT) + 2 * j + 1]
        if not mean:
            continue
        folded = folded or j == STAGE_SLOTS - 1
        name = "all" if j == 0 else str(j - 1)
        ratio = mx / mean
        ratios[name] = ratio
        if ratio > imbalance and mx - mean > imbalance_min_bytes:
            out.add(F.imbalance(None if j == 0 else j - 1, n, stage_holders[2 * j], int(mx), mean,
                                stage_holders[2 * j + 1], int(mn), ratio, imbalance))
    if ratios:
        agg["stage_imbalance"] = ratios
    if folded:
        agg["summary"]["stages_folded_from"] = STAGE_SLOTS - 2
    n_out = int(rs[SUM_AT["n_outside"]])
    if n_out:
        out.add(F.outside_allocator(holders["excess"], det[DETAIL_AT["x_nvml"]], det[DETAIL_AT["x_pool"]],
                                    det[DETAIL_AT["x_outside"]], det[DETAIL_AT["x_overhead"]],
                                    reserved_known=bool(det[DETAIL_AT["x_reserved"]]), count=n_out))
    return Report(world_size, strategy, [], [], agg, out.sentences, detail="summary", findings=out.items)


def reduce_locally(snaps: Sequence[Snapshot], world_size: int, strategy: str = "?") -> Report:
    """The summary report of the given snapshots, reduced in this process (tests, benchmarks, and the
    proof that the protocol's arithmetic matches ``aggregate()``)."""
    rs, rm, lowest = reduce_sum_maxloc([local_vectors(s) for s in snaps], [s.rank for s in snaps])
    holders, stage_holders = _named(lowest)
    details = None
    if _needs_details(rs):
        details = [sum(col) for col in zip(*[_detail_vector(s, holders) for s in snaps])]
    return build_report(world_size, strategy, rs, rm, holders, stage_holders, details)


def summary_report(snap: Snapshot, comm: Any, timeout: float) -> Optional[Report]:
    """Collective: every rank calls it with its own snapshot. Rank 0 gets the job's summary Report,
    every other rank None. Bounded by ``timeout`` seconds in total (all rounds together)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    left = lambda: max(deadline - time.monotonic(), 0.001)  # noqa: E731
    try:
        sv, mv = local_vectors(snap)
        rs, rm, lowest = comm.allreduce_sum_maxloc(sv, mv, left())
        holders, stage_holders = _named(lowest)
        details = None
        if _needs_details(rs):
            details = comm.allreduce(_detail_vector(snap, holders), "sum", left())
    except GatherTimeoutError as exc:
        log.warning("distmem: summary report: %s", exc)
        if comm.rank != 0:
            return None
        found = F.missing_summary(timeout, comm.size)
        rep = Report(comm.size, snap.strategy, [], [], {"ranks_reporting": None, "ranks_missing": None,
                                                         "complete": False, "transport": comm.name,
                                                         "gather_seconds": time.monotonic() - t0},
                     [found["message"]], detail="summary", findings=[found])
        return rep
    if comm.rank != 0:
        return None
    rep = build_report(comm.size, snap.strategy, rs, rm, holders, stage_holders, details)
    rep.aggregates["gather_seconds"] = time.monotonic() - t0
    rep.aggregates["transport"] = comm.name
    return rep
