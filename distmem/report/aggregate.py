"""Report (the job's memory, on rank 0) and :func:`aggregate`, which builds it from every rank's
:class:`~distmem.observe.snapshot.Snapshot`: the aggregates and every warning. Pure.

Every warning is computed on rank 0 from the whole job and carries its numbers. Each one is kept
twice: as a sentence in ``Report.warnings`` (for people and logs) and as a structured finding in
``Report.findings`` (``kind``, ``ranks`` and the figures, for alerting and tests). The rules
themselves (thresholds, sentences, remedies) live in :mod:`distmem.report.findings`, shared with
the summary path.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..observe.snapshot import Snapshot, allocator_pool_bytes, nvml_on_planned, outside_allocator_bytes, plan_usage
from . import findings as F
from .findings import (GROUP_ABOVE, WARN_IMBALANCE, WARN_IMBALANCE_MIN_BYTES, WARN_NEAR_LIMIT, WARNING_KINDS,
                       Findings)

__all__ = ["Report", "aggregate", "host_aggregates", "WARN_NEAR_LIMIT", "WARN_IMBALANCE", "WARN_IMBALANCE_MIN_BYTES", "WARNING_KINDS",
           "GROUP_ABOVE", "Snapshot"]


@dataclass
class Report:
    """The whole job as rank 0 sees it: one row per rank that answered, the missing ranks,
    aggregates, warnings (sentences) and findings (the same warnings as data).

    ``detail`` is ``"full"`` (a row per rank) or ``"summary"`` (all-reduced aggregates, no rows).
    ``timeline`` holds the periodic points of :class:`distmem.ReportEvery`, if any.
    """

    world_size: int
    strategy: str
    ranks: List[Snapshot]
    missing: List[int]
    aggregates: Dict[str, Any]
    warnings: List[str]
    created: float = field(default_factory=time.time)
    detail: str = "full"
    timeline: List[Dict[str, Any]] = field(default_factory=list)
    findings: List[Dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "distmem_report": 1,
            "created": self.created,
            "world_size": self.world_size,
            "strategy": self.strategy,
            "detail": self.detail,
            "ranks": [s.to_dict() for s in self.ranks],
            "missing": list(self.missing),
            "aggregates": dict(self.aggregates),
            "warnings": list(self.warnings),
            "findings": list(self.findings),
            "timeline": list(self.timeline),
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Report":
        return cls(world_size=d["world_size"], strategy=d.get("strategy", "?"),
                   ranks=[Snapshot.from_dict(r) for r in d.get("ranks", [])], missing=d.get("missing", []),
                   aggregates=d.get("aggregates", {}), warnings=d.get("warnings", []),
                   created=d.get("created", 0.0), detail=d.get("detail", "full"), timeline=d.get("timeline", []),
                   findings=d.get("findings", []))

    def kinds(self) -> List[str]:
        """The warning kinds present, in order of first appearance."""
        return list(dict.fromkeys(f["kind"] for f in self.findings))


def _limit_warnings(snaps: Sequence[Snapshot], out: Findings, near: float) -> None:
    above: List[Tuple[float, Snapshot, int]] = []
    close: List[Tuple[float, Snapshot, int]] = []
    for s in snaps:
        used = plan_usage(s)
        if not s.limit_bytes or used is None:
            continue
        if used > s.limit_bytes:
            above.append((used / s.limit_bytes, s, used))
        elif used > F.near_threshold(s.limit_bytes, (s.allocation or {}).get("demand_bytes"), near):
            close.append((used / s.limit_bytes, s, used))
    for group, build in ((above, F.above_plan), (close, F.near_limit)):
        extra = {} if build is F.above_plan else {"near": near}
        if len(group) <= GROUP_ABOVE:
            for ratio, s, used in group:
                kw = dict(extra, enforced=s.enforced) if build is F.above_plan else extra
                out.add(build(s.rank, used, s.limit_bytes, ratio, peak=s.peak_or_current,
                              reserved=s.reserved_bytes, **kw))
        else:
            ratio, s, used = max(group, key=lambda t: (t[0], -t[1].rank))
            kw = dict(extra, enforced=s.enforced) if build is F.above_plan else extra
            out.add(build(s.rank, used, s.limit_bytes, ratio, peak=s.peak_or_current, reserved=s.reserved_bytes,
                          count=len(group), ranks=[x.rank for _, x, _ in group], **kw))


GpuKey = Tuple[str, str]


def _gpu_keys(snaps: Sequence[Snapshot]):
    """A function naming a physical GPU from (snapshot, device ordinal): (host, UUID) where the UUID
    is known, else (host, '#ordinal'). An ordinal a rank saw without its UUID borrows the UUID other
    ranks of the host report for it, unless they disagree (per-rank CUDA_VISIBLE_DEVICES)."""
    by_host: Dict[Tuple[str, int], set] = {}
    for s in snaps:
        for dev, uuid in s.gpu_uuids.items():
            if uuid:
                by_host.setdefault((s.host, dev), set()).add(uuid)

    def key(s: Snapshot, dev: int) -> GpuKey:
        uuid = s.gpu_uuids.get(dev)
        if uuid:
            return (s.host, uuid)
        seen = by_host.get((s.host, dev), ())
        return (s.host, next(iter(seen)) if len(seen) == 1 else f"#{dev}")

    return key


def _gpu_warnings(snaps: Sequence[Snapshot], out: Findings) -> None:
    if not any(s.nvml_bytes or s.gpu_pids for s in snaps):
        return  # no rank has NVML figures (CPU, declared fleet): nothing can be crowded or foreign
    key = _gpu_keys(snaps)
    job_pids: Dict[Tuple[str, int], int] = {(s.host, s.pid): s.rank for s in snaps}
    planned: Dict[GpuKey, set] = {}
    label: Dict[GpuKey, int] = {}
    seen: Dict[GpuKey, Dict[int, Optional[int]]] = {}  # job rank -> bytes NVML gives it on the GPU
    foreign: Dict[GpuKey, Dict[int, Optional[int]]] = {}  # foreign pid -> bytes
    for s in snaps:
        for dev in s.devices:
            k = key(s, dev)
            planned.setdefault(k, set()).add(s.rank)
            label.setdefault(k, dev)
    for s in snaps:
        for dev, used in s.nvml_bytes.items():
            k = key(s, dev)
            seen.setdefault(k, {})[s.rank] = used
            label.setdefault(k, dev)
        for dev, pids in s.gpu_pids.items():
            if not pids:
                continue
            k = key(s, dev)
            sizes = s.gpu_process_bytes.get(dev) or {}
            on = seen.setdefault(k, {})
            for pid in pids:
                rank = job_pids.get((s.host, pid))
                if rank is not None:
                    on.setdefault(rank, sizes.get(pid))
                else:
                    foreign.setdefault(k, {})[pid] = sizes.get(pid)
    order = lambda k: (k[0], label.get(k, -1), k[1])  # noqa: E731
    crowded = [k for k, on in seen.items() if any(r not in planned.get(k, ()) for r in on)]
    for k in sorted(crowded, key=order):
        out.add(F.shared_gpu(k[0], k[1], label.get(k, "?"), sorted(planned.get(k, set())), seen[k],
                             {s.rank: s.pid for s in snaps}))
    keys = sorted(foreign, key=order)
    for k in keys[:GROUP_ABOVE]:
        users = sorted(planned.get(k, set()) | set(seen.get(k, {})))
        out.add(F.foreign_process(k[0], k[1], label.get(k, "?"), users, foreign[k]))
    if len(keys) > GROUP_ABOVE:
        rest = keys[GROUP_ABOVE:]
        users = sorted({r for k in rest for r in planned.get(k, set()) | set(seen.get(k, {}))})
        out.add(F.foreign_process_more([list(k) for k in rest], sorted({k[0] for k in rest}), users,
                                       sorted({p for k in rest for p in foreign[k]})))


def _imbalance_warnings(snaps: Sequence[Snapshot], out: Findings, ratio_limit: float,
                        min_bytes: int) -> Dict[str, float]:
    groups: Dict[Optional[int], List[Tuple[int, int]]] = {}  # stage -> (peak, rank), rank order
    for s in snaps:
        p = s.peak_or_current
        if p is not None:
            groups.setdefault(s.stage, []).append((p, s.rank))
    ratios: Dict[str, float] = {}
    for stage in sorted(groups, key=lambda x: -1 if x is None else x):
        group = groups[stage]
        if len(group) < 2:
            continue
        mean = sum(p for p, _ in group) / len(group)
        if not mean:
            continue
        top_peak, top_rank = max(group, key=lambda t: (t[0], -t[1]))
        low_peak, low_rank = min(group)
        ratio = top_peak / mean
        ratios["all" if stage is None else str(stage)] = ratio
        if ratio > ratio_limit and top_peak - mean > min_bytes:
            out.add(F.imbalance(stage, len(group), top_rank, top_peak, mean, low_rank, low_peak, ratio, ratio_limit,
                                ranks=[r for _, r in group]))
    return ratios


def _outside_warnings(snaps: Sequence[Snapshot], out: Findings) -> None:
    over: List[Tuple[int, Snapshot, int]] = []
    for s in snaps:
        outside = outside_allocator_bytes(s)
        if outside is not None and s.overhead_bytes is not None and outside > s.overhead_bytes:
            over.append((outside - s.overhead_bytes, s, outside))
    if not over:
        return
    _, s, outside = max(over, key=lambda t: (t[0], -t[1].rank))
    out.add(F.outside_allocator(s.rank, nvml_on_planned(s) or 0, allocator_pool_bytes(s) or 0, outside,
                                s.overhead_bytes or 0, reserved_known=s.reserved_bytes is not None, count=len(over),
                                ranks=[x.rank for _, x, _ in over] if len(over) > 1 else None))


def host_aggregates(snaps: Sequence[Snapshot]) -> Dict[str, Dict[str, Any]]:
    """Per host: its ranks, GPUs in use, planned bytes, peak bytes (sums) and the largest peak;
    the peaks are None on a host where no rank has allocator figures."""
    out: Dict[str, Dict[str, Any]] = {}
    for s in snaps:
        h = out.setdefault(s.host or "?", {"ranks": [], "gpus": set(), "planned_bytes": 0, "peak_bytes": None,
                                           "max_peak_bytes": None})
        h["ranks"].append(s.rank)
        h["gpus"].update(d.get("uuid") or s.gpu_uuids.get(d.get("index")) or f"#{d.get('index')}"
                         for d in (s.allocation or {}).get("devices", []))
        h["planned_bytes"] += s.limit_bytes or 0
        peak = s.peak_or_current
        if peak is not None:
            h["peak_bytes"] = (h["peak_bytes"] or 0) + peak
            h["max_peak_bytes"] = max(h["max_peak_bytes"] or 0, peak)
    for h in out.values():
        h["gpus"] = len(h["gpus"])
    return dict(sorted(out.items()))


def aggregate(snaps: Sequence[Snapshot], world_size: int, missing: Sequence[int] = (),
              strategy: str = "?", detail: str = "full", *, near_limit: float = WARN_NEAR_LIMIT,
              imbalance: float = WARN_IMBALANCE, imbalance_min_bytes: int = WARN_IMBALANCE_MIN_BYTES) -> Report:
    """Build the job's report from the snapshots rank 0 received: aggregates and every warning.

    Aggregates (bytes): ``total_current_bytes``, ``total_peak_bytes``, ``max/min/mean_peak_bytes``,
    ``max_peak_rank`` (lowest rank on a tie), ``imbalance`` (max / mean peak over all ranks),
    ``total_limit_bytes``, ``min_headroom_bytes`` (limit - peak) and its rank, ``total_nvml_bytes``;
    ``stage_imbalance`` maps each stage (``"all"`` without stages) to its max / mean peak.
    """
    snaps = sorted(snaps, key=lambda s: s.rank)
    all_peaks = [s.peak_or_current for s in snaps]
    peaks = [p for p in all_peaks if p is not None]
    agg: Dict[str, Any] = {"ranks_reporting": len(snaps), "ranks_missing": len(missing)}
    if peaks:
        mean = sum(peaks) / len(peaks)  # not statistics.fmean: 10x its cost on short lists
        top = max(peaks)
        agg.update(total_current_bytes=sum(s.current_bytes or 0 for s in snaps), total_peak_bytes=sum(peaks),
                   max_peak_bytes=top, min_peak_bytes=min(peaks), mean_peak_bytes=mean,
                   imbalance=(top / mean) if mean else None,
                   max_peak_rank=snaps[[(p or -1) for p in all_peaks].index(top or -1)].rank)
    if any(s.limit_bytes for s in snaps):
        agg["total_limit_bytes"] = sum(s.limit_bytes for s in snaps if s.limit_bytes)
    # Headroom only where the peak is known: a rank without allocator figures (torch on a CPU) has
    # no headroom to report, not all of its limit.
    limited = [(s.limit_bytes - p, s.rank) for s, p in zip(snaps, all_peaks) if s.limit_bytes and p is not None]
    if limited:
        head, r = min(limited)
        agg.update(min_headroom_bytes=head, min_headroom_rank=r)
    nv = [s.nvml_total for s in snaps if s.nvml_total is not None]
    if nv:
        agg["total_nvml_bytes"] = sum(nv)
    agg["hosts"] = host_aggregates(snaps)
    out = Findings()
    if missing:
        out.add(F.missing(list(missing)))
    prints = {s.plan_fingerprint for s in snaps if s.plan_fingerprint}
    host_prints: Dict[str, set] = {}
    for s in snaps:
        if s.host_fingerprint:
            host_prints.setdefault(s.host, set()).add(s.host_fingerprint)
    if len(prints) > 1 or any(len(v) > 1 for v in host_prints.values()):
        by: Dict[str, List[int]] = {}
        for s in snaps:
            key = s.plan_fingerprint if len(prints) > 1 else f"{s.host}/{s.host_fingerprint}"
            by.setdefault(key, []).append(s.rank)
        out.add(F.plan_mismatch(by))
    _limit_warnings(snaps, out, near_limit)
    _gpu_warnings(snaps, out)
    ratios = _imbalance_warnings(snaps, out, imbalance, imbalance_min_bytes)
    if ratios:
        agg["stage_imbalance"] = ratios
    _outside_warnings(snaps, out)
    return Report(world_size, strategy, list(snaps), sorted(missing), agg, out.sentences, detail=detail,
                  findings=out.items)
