"""``report(detail="summary")``: the job's aggregates by all-reduce, for jobs of thousands of ranks.

Instead of gathering one row per rank to rank 0, every rank contributes a fixed-size vector of its
figures and the transport all-reduces it, so the message size and rank 0's memory do not grow
with the job. Extremes carry the rank that holds them: a second reduction takes, for every
extreme, the lowest rank whose own value equals it (the same tie rule as the full report). The
aggregates equal those of ``aggregate()`` over the same snapshots, key for key.

Rounds (every rank enters all of them, in this order; the number of rounds depends only on reduced
values, so it is the same on every rank):

1. ``sum`` of counts and totals, then ``max`` of maxima (minima as negated maxima);
2. ``max`` of ``-rank`` for the holders of each extreme, i.e. the lowest holder;
3. only when a warning needs them: ``sum`` of the figures the unique lowest holders contribute
   (their peak and limit, NVML and pool bytes), zero from everyone else.

A rank that never arrives makes the all-reduce time out on every rank that did; rank 0 then returns
a report that says so (a summary cannot name the missing rank: use ``detail="full"``).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .errors import GatherTimeoutError
from .stats import (Report, Snapshot, WARN_IMBALANCE, WARN_IMBALANCE_MIN_BYTES, WARN_NEAR_LIMIT,
                    allocator_pool_bytes, nvml_on_planned, outside_allocator_bytes, plan_usage)
from .units import MiB, format_bytes

__all__ = ["summary_report", "local_vectors", "reduce_locally", "build_report", "STAGE_SLOTS"]

log = logging.getLogger("distmem")

#: Stage groups kept apart in the reduction: slot 0 for ranks without a stage, then one slot per
#: pipeline stage up to this count; deeper stages share the last slot (and the report says so).
STAGE_SLOTS = 33
_NEG = -math.inf

# Round 1, sum: index of each field.
_S = {k: i for i, k in enumerate([
    "count", "current", "has_peak", "peak", "has_limit", "limit", "has_nvml", "nvml", "n_above", "n_near",
    "n_outside", "n_intruder", "n_crowded", "has_rss", "rss", "has_reserved", "reserved"])}
# Round 1, max (minima negated): index of each field.
_M = {k: i for i, k in enumerate([
    "peak", "neg_peak", "neg_head", "above_ratio", "near_ratio", "excess", "fp", "neg_fp", "nvml", "current",
    "crowd", "intruder"])}
# Extremes whose lowest holder round 2 finds, in vector order: (round-1 max index, name).
_HOLD = ["peak", "neg_peak", "neg_head", "above_ratio", "near_ratio", "excess", "fp", "neg_fp", "crowd", "intruder"]
# Round 3: figures of a unique holder.
_D = {k: i for i, k in enumerate([
    "above_peak", "above_limit", "above_enforced", "near_peak", "near_limit", "x_nvml", "x_pool", "x_outside",
    "x_overhead", "x_reserved", "crowd_dev", "crowd_pids", "crowd_shared", "intr_dev", "intr_bytes"])}


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
    sv = [0.0] * len(_S) + [0.0] * (2 * STAGE_SLOTS)
    sv[_S["count"]] = 1
    sv[_S["current"]] = cur or 0
    if peak is not None:
        sv[_S["has_peak"]], sv[_S["peak"]] = 1, peak
        base = len(_S) + 2 * _slot(s.stage)
        sv[base], sv[base + 1] = 1, peak
    if lim:
        sv[_S["has_limit"]], sv[_S["limit"]] = 1, lim
    if nv is not None:
        sv[_S["has_nvml"]], sv[_S["nvml"]] = 1, nv
    above = ratio is not None and ratio > 1
    is_near = ratio is not None and not above and used > near * lim  # type: ignore[operator]
    sv[_S["n_above"]], sv[_S["n_near"]] = float(above), float(is_near)
    sv[_S["n_outside"]] = float(excess is not None and excess > 0)
    sv[_S["n_intruder"]] = float(intr_dev >= 0)
    sv[_S["n_crowded"]] = float(crowd > 0)
    if s.rss_bytes is not None:
        sv[_S["has_rss"]], sv[_S["rss"]] = 1, s.rss_bytes
    if s.reserved_bytes is not None:
        sv[_S["has_reserved"]], sv[_S["reserved"]] = 1, s.reserved_bytes
    mv = [_NEG] * len(_M) + [_NEG] * (2 * STAGE_SLOTS)
    if peak is not None:
        mv[_M["peak"]], mv[_M["neg_peak"]] = peak, -peak
        base = len(_M) + 2 * _slot(s.stage)
        mv[base], mv[base + 1] = peak, -peak
    if lim:
        mv[_M["neg_head"]] = -(lim - (peak or 0))
    if above:
        mv[_M["above_ratio"]] = ratio  # type: ignore[assignment]
    if is_near:
        mv[_M["near_ratio"]] = ratio  # type: ignore[assignment]
    if excess is not None and excess > 0:
        mv[_M["excess"]] = excess
    fp = _fp(s)
    mv[_M["fp"]], mv[_M["neg_fp"]] = fp, (-fp if fp != _NEG else _NEG)
    if nv is not None:
        mv[_M["nvml"]] = nv
    if cur is not None:
        mv[_M["current"]] = cur
    if crowd > 0:
        mv[_M["crowd"]] = crowd
    if intr_dev >= 0:
        mv[_M["intruder"]] = 1
    return sv, mv


def _holder_vector(s: Snapshot, mv: Sequence[float], red_max: Sequence[float]) -> List[float]:
    """Round 2: -rank where this rank holds an extreme (its value equals the reduced one), else -inf."""
    out: List[float] = []
    for name in _HOLD:
        i = _M[name]
        out.append(-float(s.rank) if (mv[i] != _NEG and mv[i] == red_max[i]) else _NEG)
    for j in range(2 * STAGE_SLOTS):
        i = len(_M) + j
        out.append(-float(s.rank) if (mv[i] != _NEG and mv[i] == red_max[i]) else _NEG)
    return out


def _detail_vector(s: Snapshot, holders: Dict[str, Optional[int]]) -> List[float]:
    """Round 3: the figures behind the extremes this rank is the lowest holder of; zeros otherwise."""
    d = [0.0] * len(_D)
    peak, lim = plan_usage(s), s.limit_bytes
    if holders.get("above_ratio") == s.rank:
        d[_D["above_peak"]], d[_D["above_limit"]], d[_D["above_enforced"]] = peak or 0, lim or 0, float(s.enforced)
    if holders.get("near_ratio") == s.rank:
        d[_D["near_peak"]], d[_D["near_limit"]] = peak or 0, lim or 0
    if holders.get("excess") == s.rank:
        d[_D["x_nvml"]] = nvml_on_planned(s) or 0
        d[_D["x_pool"]] = allocator_pool_bytes(s) or 0
        d[_D["x_outside"]] = outside_allocator_bytes(s) or 0
        d[_D["x_overhead"]] = s.overhead_bytes or 0
        d[_D["x_reserved"]] = float(s.reserved_bytes is not None)
    if holders.get("crowd") == s.rank:
        extra, dev, n, k = _crowd(s)
        d[_D["crowd_dev"]], d[_D["crowd_pids"]], d[_D["crowd_shared"]] = dev, n, k
    if holders.get("intruder") == s.rank:
        dev, used = _intrusion(s)
        d[_D["intr_dev"]], d[_D["intr_bytes"]] = dev, (used if used is not None else -1)
    return d


def _holders(red2: Sequence[float]) -> Tuple[Dict[str, Optional[int]], List[Optional[int]]]:
    rank = lambda v: None if v == _NEG else int(-v)  # noqa: E731
    named = {name: rank(red2[i]) for i, name in enumerate(_HOLD)}
    stages = [rank(v) for v in red2[len(_HOLD):]]
    return named, stages


def _needs_details(rs: Sequence[float]) -> bool:
    return any(rs[_S[k]] > 0 for k in ("n_above", "n_near", "n_outside", "n_crowded", "n_intruder"))


def build_report(world_size: int, strategy: str, rs: Sequence[float], rm: Sequence[float],
                 holders: Dict[str, Optional[int]], stage_holders: Sequence[Optional[int]],
                 details: Optional[Sequence[float]], *, near: float = WARN_NEAR_LIMIT,
                 imbalance: float = WARN_IMBALANCE, imbalance_min_bytes: int = WARN_IMBALANCE_MIN_BYTES) -> Report:
    """Turn the reduced vectors into a Report with the same aggregates as ``aggregate()``."""
    count = int(rs[_S["count"]])
    agg: Dict[str, Any] = {"ranks_reporting": count, "ranks_missing": world_size - count}
    n_peak = int(rs[_S["has_peak"]])
    if n_peak:
        mean = rs[_S["peak"]] / n_peak
        mx, mn = rm[_M["peak"]], -rm[_M["neg_peak"]]
        agg.update(total_current_bytes=int(rs[_S["current"]]), total_peak_bytes=int(rs[_S["peak"]]),
                   max_peak_bytes=int(mx), min_peak_bytes=int(mn), mean_peak_bytes=mean,
                   imbalance=(mx / mean) if mean else None, max_peak_rank=holders["peak"])
    if rs[_S["has_limit"]]:
        agg.update(total_limit_bytes=int(rs[_S["limit"]]), min_headroom_bytes=int(-rm[_M["neg_head"]]),
                   min_headroom_rank=holders["neg_head"])
    if rs[_S["has_nvml"]]:
        agg["total_nvml_bytes"] = int(rs[_S["nvml"]])
    extra = {"max_current_bytes": int(rm[_M["current"]]) if rm[_M["current"]] != _NEG else None,
             "max_nvml_bytes": int(rm[_M["nvml"]]) if rm[_M["nvml"]] != _NEG else None,
             "total_rss_bytes": int(rs[_S["rss"]]) if rs[_S["has_rss"]] else None,
             "total_reserved_bytes": int(rs[_S["reserved"]]) if rs[_S["has_reserved"]] else None,
             "min_peak_rank": holders["neg_peak"]}
    agg["summary"] = {k: v for k, v in extra.items() if v is not None}

    out_w: List[str] = []
    findings: List[Dict[str, Any]] = []

    def add(kind: str, ranks: List[Optional[int]], message: str, **values: Any) -> None:
        out_w.append(message)
        findings.append(dict(kind=kind, ranks=sorted({r for r in ranks if r is not None}), message=message, **values))

    det = details or [0.0] * len(_D)
    if rm[_M["fp"]] != _NEG and rm[_M["fp"]] != -rm[_M["neg_fp"]]:
        add("plan_mismatch", [holders["fp"], holders["neg_fp"]],
            f"ranks computed different plans (at least rank {holders['neg_fp']} and rank {holders['fp']} differ); "
            "pass the same options (and DISTMEM_FLEET) on every rank; detail='full' lists every rank's plan")
    n_above = int(rs[_S["n_above"]])
    if n_above:
        r, peak, lim = holders["above_ratio"], det[_D["above_peak"]], det[_D["above_limit"]]
        who = f"rank {r}" if n_above == 1 else f"{n_above} ranks went above their plan; the worst, rank {r},"
        add("above_plan", [r], f"{who} peaked at (or its allocator holds) {format_bytes(peak)}, above its plan of {format_bytes(lim)} "
            f"({rm[_M['above_ratio']]:.0%})" + ("" if det[_D["above_enforced"]] else
                                                "; it is not hard-limited, so a neighbour may run out")
            + "; give it a larger share (fewer ranks per GPU, limit=) or lower its batch size",
            count=n_above, worst_rank=r, used_bytes=int(peak), limit_bytes=int(lim), ratio=rm[_M["above_ratio"]])
    n_near = int(rs[_S["n_near"]])
    if n_near:
        r, peak, lim = holders["near_ratio"], det[_D["near_peak"]], det[_D["near_limit"]]
        who = f"rank {r}" if n_near == 1 else f"{n_near} ranks went above {near:.0%} of their limit; the highest, rank {r},"
        add("near_limit", [r], f"{who} peaked at (or its allocator holds) {format_bytes(peak)} = "
            f"{rm[_M['near_ratio']]:.0%} of its limit "
            f"{format_bytes(lim)} (warning above {near:.0%}); a larger batch will run out of memory",
            count=n_near, worst_rank=r, used_bytes=int(peak), limit_bytes=int(lim), ratio=rm[_M["near_ratio"]])
    n_intr = int(rs[_S["n_intruder"]])
    if n_intr:
        r, dev, used = holders["intruder"], int(det[_D["intr_dev"]]), det[_D["intr_bytes"]]
        owner = holders["crowd"]
        add("shared_gpu", [r, owner],
            f"{n_intr} rank(s) run on a GPU the plan gave to another rank: rank {r} holds "
            f"{format_bytes(used) if used >= 0 else 'memory'} on GPU {dev}"
            + (f", whose GPU (rank {owner}'s GPU {int(det[_D['crowd_dev']])}) lists {int(det[_D['crowd_pids']])} "
               f"processes for {int(det[_D['crowd_shared']])} planned rank(s)" if owner is not None else "")
            + "; pin each rank to its own device before its framework starts (call distmem.init() first, before "
              "any GPU op; never hard-code cuda:0 or /GPU:0); detail='full' names every rank on each GPU",
            count=n_intr, intruder_rank=r, gpu=dev, owner_rank=owner)
    elif int(rs[_S["n_crowded"]]):
        r = holders["crowd"]
        add("foreign_process", [r],
            f"{int(rs[_S['n_crowded']])} rank(s) share their GPU with processes outside the plan: rank {r}'s GPU "
            f"{int(det[_D['crowd_dev']])} lists {int(det[_D['crowd_pids']])} processes for "
            f"{int(det[_D['crowd_shared']])} planned rank(s); they take memory the plan counted as free: pass "
            "foreign= to distmem.init() or move to a free GPU; detail='full' lists their pids and bytes",
            count=int(rs[_S["n_crowded"]]), worst_rank=r, extra_processes=int(rm[_M["crowd"]]))
    ratios: Dict[str, float] = {}
    folded = False
    for j in range(STAGE_SLOTS):
        n = int(rs[len(_S) + 2 * j])
        if n < 2:
            continue
        total = rs[len(_S) + 2 * j + 1]
        mean = total / n
        mx, mn = rm[len(_M) + 2 * j], -rm[len(_M) + 2 * j + 1]
        if not mean:
            continue
        folded = folded or j == STAGE_SLOTS - 1
        name = "all" if j == 0 else str(j - 1)
        ratio = mx / mean
        ratios[name] = ratio
        if ratio > imbalance and mx - mean > imbalance_min_bytes:
            top, low = stage_holders[2 * j], stage_holders[2 * j + 1]
            where = f"across the {n} ranks" if j == 0 else f"in stage {j - 1} ({n} ranks)"
            add("imbalance", [top, low],
                f"memory imbalance {where}: rank {top} peaked at {format_bytes(mx)}, {ratio:.2f}x the mean "
                f"{format_bytes(mean)} (lowest: rank {low} at {format_bytes(mn)}; warning above {imbalance:.2f}x); "
                "uneven batches or sequence lengths, or a rank holding extra state",
                stage=None if j == 0 else j - 1, max_rank=top, max_peak_bytes=int(mx), mean_peak_bytes=mean,
                min_rank=low, min_peak_bytes=int(mn), ratio=ratio)
    if ratios:
        agg["stage_imbalance"] = ratios
    if folded:
        agg["summary"]["stages_folded_from"] = STAGE_SLOTS - 2
    n_out = int(rs[_S["n_outside"]])
    if n_out:
        r = holders["excess"]
        outside = det[_D["x_outside"]]
        want = -(-int(outside) // (64 * MiB)) * 64 * MiB
        who = f"rank {r}" if n_out == 1 else f"{n_out} ranks hold more outside the allocator than planned; the worst, rank {r},"
        what = "reserved" if det[_D["x_reserved"]] else "peak"
        add("outside_allocator", [r],
            f"{who} holds {format_bytes(det[_D['x_nvml']])} on its GPU per NVML but its allocator {what} is "
            f"{format_bytes(det[_D['x_pool']])}: {format_bytes(outside)} outside the allocator (CUDA context, "
            f"cuBLAS/cuDNN workspaces, NCCL buffers) against the {format_bytes(det[_D['x_overhead']])} per process the "
            f"plan assumed; pass overhead='{format_bytes(want, 0).replace(' ', '')}' to distmem.init() so the plan "
            "leaves room for it", count=n_out, worst_rank=r, outside_bytes=int(outside),
            assumed_bytes=int(det[_D["x_overhead"]]), suggested_overhead_bytes=want)
    return Report(world_size, strategy, [], [], agg, out_w, detail="summary", findings=findings)


def reduce_locally(snaps: Sequence[Snapshot], world_size: int, strategy: str = "?") -> Report:
    """The summary report of the given snapshots, reduced in this process (tests, benchmarks, and the
    proof that the protocol's arithmetic matches ``aggregate()``)."""
    vecs = [(s, *local_vectors(s)) for s in snaps]
    rs = [sum(col) for col in zip(*[v[1] for v in vecs])]
    rm = [max(col) for col in zip(*[v[2] for v in vecs])]
    red2 = [max(col) for col in zip(*[_holder_vector(s, mv, rm) for s, _, mv in vecs])]
    holders, stage_holders = _holders(red2)
    details = None
    if _needs_details(rs):
        details = [sum(col) for col in zip(*[_detail_vector(s, holders) for s, _, _ in vecs])]
    return build_report(world_size, strategy, rs, rm, holders, stage_holders, details)


def summary_report(snap: Snapshot, comm: Any, timeout: float) -> Optional[Report]:
    """Collective: every rank calls it with its own snapshot. Rank 0 gets the job's summary Report,
    every other rank None. Bounded by ``timeout`` seconds in total (all rounds together)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    left = lambda: max(deadline - time.monotonic(), 0.001)  # noqa: E731
    try:
        sv, mv = local_vectors(snap)
        rs = comm.allreduce(sv, "sum", left())
        rm = comm.allreduce(mv, "max", left())
        red2 = comm.allreduce(_holder_vector(snap, mv, rm), "max", left())
        holders, stage_holders = _holders(red2)
        details = None
        if _needs_details(rs):
            details = comm.allreduce(_detail_vector(snap, holders), "sum", left())
    except GatherTimeoutError as exc:
        log.warning("distmem: summary report: %s", exc)
        if comm.rank != 0:
            return None
        msg = (f"the summary all-reduce did not complete within {timeout:.1f} s: at least one of {comm.size} ranks "
               "never entered distmem.report() (crashed, hung, or took another code path); a summary cannot name "
               "it: call distmem.report(detail='full') to list missing ranks. Until that rank arrives, later "
               "collectives of distmem on this job may pair up out of step")
        rep = Report(comm.size, snap.strategy, [], [], {"ranks_reporting": None, "ranks_missing": None,
                                                         "complete": False, "transport": comm.name,
                                                         "gather_seconds": time.monotonic() - t0},
                     [msg], detail="summary", findings=[{"kind": "missing", "ranks": [], "message": msg}])
        return rep
    if comm.rank != 0:
        return None
    rep = build_report(comm.size, snap.strategy, rs, rm, holders, stage_holders, details)
    rep.aggregates["gather_seconds"] = time.monotonic() - t0
    rep.aggregates["transport"] = comm.name
    return rep
