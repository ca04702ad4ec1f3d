"""Snapshot (one rank's memory) and Report (the job's, on rank 0). Pure aggregation and warnings.

Every warning is computed on rank 0 from the whole job and carries its numbers. Each one is kept
twice: as a sentence in ``Report.warnings`` (for people and logs) and as a structured finding in
``Report.findings`` (``kind``, ``ranks`` and the figures, for alerting and tests). Kinds:

``missing``            ranks that did not report within the timeout
``plan_mismatch``      ranks that computed different plans
``above_plan``         a rank's allocator peak (or reserved pool, if larger) above its planned bytes
``near_limit``         the same above ``WARN_NEAR_LIMIT`` of its planned bytes
``shared_gpu``         more job ranks on a GPU than the plan put there (the every-rank-on-GPU-0 mistake)
``foreign_process``    processes outside the job on a GPU the job uses
``imbalance``          peaks of ranks with the same role (pipeline stage, or all ranks) far apart
``outside_allocator``  NVML usage minus allocator pool above the per-process overhead the plan assumed
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .units import MiB, format_bytes

__all__ = ["Snapshot", "Report", "aggregate", "WARN_NEAR_LIMIT", "WARN_IMBALANCE", "WARN_IMBALANCE_MIN_BYTES",
           "WARNING_KINDS", "allocator_pool_bytes", "outside_allocator_bytes", "plan_usage", "nvml_on_planned"]

#: A rank whose peak passes this share of its limit is warned about: the next larger batch or
#: fragmentation spike will run it out of memory.
WARN_NEAR_LIMIT = 0.90
#: Ranks with the same role whose peaks differ by more than this ratio (max / mean) are flagged.
WARN_IMBALANCE = 1.25
#: ... but only when the largest peak also exceeds the mean by this many bytes: a 2x spread of a
#: few MiB (CPU runs, tiny models) is noise, not a problem an operator can act on.
WARN_IMBALANCE_MIN_BYTES = 64 * MiB
#: Above this many ranks of one kind, a warning is one sentence naming the worst rank and a count,
#: not one sentence per rank (the findings still list every rank).
GROUP_ABOVE = 4

WARNING_KINDS = ("missing", "plan_mismatch", "above_plan", "near_limit", "shared_gpu", "foreign_process",
                 "imbalance", "outside_allocator")


@dataclass
class Snapshot:
    """One rank's memory at one moment. Bytes throughout; None where a figure is not available.

    ``current_bytes``/``peak_bytes``: the framework allocator's in-use and peak (TensorFlow
    ``get_memory_info``, torch ``memory_allocated``/``max_memory_allocated``), summed over the
    rank's devices (``CPU:0`` without a GPU). ``reserved_bytes``: what the allocator holds from the
    driver (torch ``memory_reserved``). ``nvml_bytes``: this process's usage as NVML reports it
    (``nvidia-smi``'s process table), by device ordinal. ``rss_bytes``: resident host memory.
    ``gpu_pids``: for each device this rank uses, every pid NVML lists on it.
    ``gpu_process_bytes``: for each device this rank uses, pid -> NVML used bytes (None where NVML
    cannot attribute memory); lets the report put numbers on foreign and mis-pinned processes.
    """

    rank: int
    size: int
    local_rank: int
    host: str
    pid: int
    framework: str
    strategy: str
    devices: List[int]
    allocation: Dict[str, Any]
    limit_bytes: Optional[int]
    enforced: bool
    current_bytes: Optional[int] = None
    peak_bytes: Optional[int] = None
    reserved_bytes: Optional[int] = None
    nvml_bytes: Dict[int, Optional[int]] = field(default_factory=dict)
    rss_bytes: Optional[int] = None
    gpu_pids: Dict[int, List[int]] = field(default_factory=dict)
    gpu_uuids: Dict[int, str] = field(default_factory=dict)
    stage: Optional[int] = None
    step: Optional[int] = None
    time: float = field(default_factory=time.time)
    plan_fingerprint: str = ""
    plan_source: str = ""
    overhead_bytes: Optional[int] = None
    native: Optional[Dict[str, Any]] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    gpu_process_bytes: Dict[int, Dict[int, Optional[int]]] = field(default_factory=dict)

    @property
    def nvml_total(self) -> Optional[int]:
        vals = [v for v in self.nvml_bytes.values() if v is not None]
        return sum(vals) if vals else None

    @property
    def peak_or_current(self) -> Optional[int]:
        """The allocator peak, or the current figure where no peak is kept."""
        return self.peak_bytes if self.peak_bytes is not None else self.current_bytes

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["nvml_bytes"] = {str(k): v for k, v in self.nvml_bytes.items()}
        d["gpu_pids"] = {str(k): v for k, v in self.gpu_pids.items()}
        d["gpu_uuids"] = {str(k): v for k, v in self.gpu_uuids.items()}
        d["gpu_process_bytes"] = {str(k): {str(p): b for p, b in v.items()} for k, v in self.gpu_process_bytes.items()}
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Snapshot":
        known = _SNAPSHOT_FIELDS
        kw = {k: v for k, v in d.items() if k in known}
        for key in ("nvml_bytes", "gpu_pids", "gpu_uuids"):
            m = kw.get(key)
            kw[key] = {int(k): v for k, v in m.items()} if m else {}
        m = kw.get("gpu_process_bytes")
        kw["gpu_process_bytes"] = {int(k): {int(p): b for p, b in (v or {}).items()} for k, v in m.items()} if m else {}
        return cls(**kw)


_SNAPSHOT_FIELDS = frozenset(Snapshot.__dataclass_fields__)


@dataclass
class Report:
    """The whole job as rank 0 sees it: one row per rank that answered, the missing ranks,
    aggregates, warnings (sentences) and findings (the same warnings as data).

    ``detail`` is ``"full"`` (a row per rank) or ``"summary"`` (all-reduced aggregates, no rows).
    ``timeline`` holds the periodic points of :class:`distmem.timeline.ReportEvery`, if any.
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


def _peak(s: Snapshot) -> Optional[int]:
    return s.peak_or_current


def allocator_pool_bytes(s: Snapshot) -> Optional[int]:
    """What the framework allocator holds from the driver, as best the snapshot tells.

    ``reserved_bytes`` where the framework reports it (torch); else the allocator peak, because
    TensorFlow's BFC allocator keeps every chunk it has grown to and never returns it, so its pool
    is its peak, not its current use (subtracting ``current`` would count the free part of the pool
    as memory outside the allocator); else the current figure.
    """
    if s.reserved_bytes is not None:
        return s.reserved_bytes
    return _peak(s)


def plan_usage(s: Snapshot) -> Optional[int]:
    """What counts against the rank's planned bytes: the larger of the allocator's peak and what it
    holds from the driver (torch's hard limit caps the reserved pool, not the allocated bytes; a
    pool at its cap means cache flushes, fragmentation and the next spike an OOM)."""
    vals = [v for v in (s.peak_or_current, s.reserved_bytes) if v is not None]
    return max(vals) if vals else None


def _usage_text(s: Snapshot, used: int) -> str:
    peak = s.peak_or_current
    if s.reserved_bytes is not None and used == s.reserved_bytes and peak is not None and peak < used:
        return f"holds {format_bytes(used)} in its allocator (reserved; peak allocated {format_bytes(peak)})"
    return f"peaked at {format_bytes(used)}"


def nvml_on_planned(s: Snapshot) -> Optional[int]:
    """NVML's bytes for this process on the devices its plan gave it (memory on other GPUs belongs to
    the shared-GPU warning, not to this rank's own overhead)."""
    if not s.devices:
        return s.nvml_total
    vals = [v for d, v in s.nvml_bytes.items() if d in s.devices and v is not None]
    return sum(vals) if vals else None


def outside_allocator_bytes(s: Snapshot) -> Optional[int]:
    """NVML's figure for this process on its planned devices minus the allocator pool: CUDA context,
    cuBLAS/cuDNN workspaces, NCCL buffers. None without NVML or allocator figures."""
    nv, pool = nvml_on_planned(s), allocator_pool_bytes(s)
    if nv is None or pool is None:
        return None
    return nv - pool


def _ranks_text(ranks: Sequence[int], limit: int = 12) -> str:
    ranks = sorted(ranks)
    text = ", ".join(map(str, ranks[:limit]))
    return text + (f", ... ({len(ranks)} ranks)" if len(ranks) > limit else "")


class _Out:
    """Collects warnings as sentences and findings side by side."""

    def __init__(self) -> None:
        self.sentences: List[str] = []
        self.findings: List[Dict[str, Any]] = []

    def add(self, kind: str, ranks: Iterable[int], message: str, **values: Any) -> None:
        self.sentences.append(message)
        self.findings.append(dict(kind=kind, ranks=sorted(set(ranks)), message=message, **values))


def _limit_warnings(snaps: Sequence[Snapshot], out: _Out, near: float) -> None:
    above: List[Tuple[float, Snapshot, int]] = []
    close: List[Tuple[float, Snapshot, int]] = []
    for s in snaps:
        used = plan_usage(s)
        if not s.limit_bytes or used is None:
            continue
        if used > s.limit_bytes:
            above.append((used / s.limit_bytes, s, used))
        elif used > near * s.limit_bytes:
            close.append((used / s.limit_bytes, s, used))
    if len(above) <= GROUP_ABOVE:
        for ratio, s, used in above:
            out.add("above_plan", [s.rank],
                    f"rank {s.rank} {_usage_text(s, used)}, above its plan of {format_bytes(s.limit_bytes)} "
                    f"({ratio:.0%})" + ("" if s.enforced else "; it is not hard-limited, so a neighbour may run out")
                    + "; give it a larger share (fewer ranks per GPU, limit=) or lower its batch size",
                    peak_bytes=s.peak_or_current, reserved_bytes=s.reserved_bytes, used_bytes=used,
                    limit_bytes=s.limit_bytes, ratio=ratio)
    else:
        ratio, s, used = max(above, key=lambda t: (t[0], -t[1].rank))
        out.add("above_plan", [x.rank for _, x, _ in above],
                f"{len(above)} ranks went above their plan (ranks {_ranks_text([x.rank for _, x, _ in above])}); "
                f"the worst, rank {s.rank}, {_usage_text(s, used)} = {ratio:.0%} of {format_bytes(s.limit_bytes)}; "
                "give them a larger share or lower the batch size",
                peak_bytes=s.peak_or_current, reserved_bytes=s.reserved_bytes, used_bytes=used,
                limit_bytes=s.limit_bytes, ratio=ratio, worst_rank=s.rank)
    if len(close) <= GROUP_ABOVE:
        for ratio, s, used in close:
            out.add("near_limit", [s.rank],
                    f"rank {s.rank} {_usage_text(s, used)} = {ratio:.0%} of its limit {format_bytes(s.limit_bytes)} "
                    f"(warning above {near:.0%}); a larger batch or a fragmentation spike will run out of memory",
                    peak_bytes=s.peak_or_current, reserved_bytes=s.reserved_bytes, used_bytes=used,
                    limit_bytes=s.limit_bytes, ratio=ratio)
    elif close:
        ratio, s, used = max(close, key=lambda t: (t[0], -t[1].rank))
        out.add("near_limit", [x.rank for _, x, _ in close],
                f"{len(close)} ranks went above {near:.0%} of their limit (ranks "
                f"{_ranks_text([x.rank for _, x, _ in close])}); the highest, rank {s.rank}, {_usage_text(s, used)} = "
                f"{ratio:.0%} of {format_bytes(s.limit_bytes)}; a larger batch will run out of memory",
                peak_bytes=s.peak_or_current, reserved_bytes=s.reserved_bytes, used_bytes=used,
                limit_bytes=s.limit_bytes, ratio=ratio, worst_rank=s.rank)


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


def _gpu_warnings(snaps: Sequence[Snapshot], out: _Out) -> None:
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
        on = seen[k]
        mine = planned.get(k, set())
        intruders = sorted(set(on) - mine)
        host, uuid = k
        everyone = sorted(set(on) | mine)
        sizes = ", ".join(f"rank {r}: {format_bytes(on.get(r))}" for r in everyone if r in on)
        plan_text = (f"planned for rank {min(mine)} alone" if len(mine) == 1 else
                     f"planned for ranks {_ranks_text(sorted(mine))}" if mine else "planned for no rank")
        out.add("shared_gpu", everyone,
                f"GPU {label.get(k, '?')} on {host} ({uuid}) was {plan_text}, but NVML shows ranks "
                f"{_ranks_text(everyone)} on it ({sizes}); ranks {_ranks_text(intruders)} took a GPU the plan gave to "
                "another: pin each rank to its own device before its framework starts (call distmem.init() first, "
                "before any GPU op; never hard-code cuda:0 or /GPU:0)",
                host=host, gpu=uuid, planned_ranks=sorted(mine), ranks_on_gpu=everyone,
                bytes_by_rank={str(r): on.get(r) for r in everyone if r in on})
    keys = sorted(foreign, key=order)
    for k in keys[:GROUP_ABOVE]:
        procs = foreign[k]
        host, uuid = k
        known = [b for b in procs.values() if b is not None]
        total = sum(known) if known else None
        users = sorted(planned.get(k, set()) | set(seen.get(k, {})))
        listed = ", ".join(f"pid {p} ({format_bytes(b)})" for p, b in sorted(procs.items())[:5])
        out.add("foreign_process", users,
                f"GPU {label.get(k, '?')} on {host} ({uuid}), used by rank(s) {_ranks_text(users)}, also runs "
                f"{len(procs)} process(es) outside this job holding {format_bytes(total)}: {listed}; they take memory "
                "the plan counted as free: pass foreign='" + (format_bytes(total) if total else "<bytes>")
                + "' to distmem.init() or move the job to a free GPU",
                host=host, gpu=uuid, pids=sorted(procs), foreign_bytes=total)
    if len(keys) > GROUP_ABOVE:
        rest = keys[GROUP_ABOVE:]
        users = sorted({r for k in rest for r in planned.get(k, set()) | set(seen.get(k, {}))})
        hosts = sorted({k[0] for k in rest})
        out.add("foreign_process", users,
                f"{len(rest)} more GPU(s) on {len(hosts)} host(s) ({', '.join(hosts[:5])}"
                + (", ..." if len(hosts) > 5 else "") + f") also run processes outside this job (ranks "
                f"{_ranks_text(users)}); the JSON report's findings list each",
                gpus=[list(k) for k in rest], pids=sorted({p for k in rest for p in foreign[k]}))


def _imbalance_warnings(snaps: Sequence[Snapshot], out: _Out, ratio_limit: float,
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
        mean = statistics.fmean([p for p, _ in group])
        if not mean:
            continue
        top_peak, top_rank = max(group, key=lambda t: (t[0], -t[1]))
        low_peak, low_rank = min(group)
        ratio = top_peak / mean
        ratios["all" if stage is None else str(stage)] = ratio
        if ratio > ratio_limit and top_peak - mean > min_bytes:
            where = f"across the {len(group)} ranks" if stage is None else f"in stage {stage} ({len(group)} ranks)"
            out.add("imbalance", [r for _, r in group],
                    f"memory imbalance {where}: rank {top_rank} peaked at {format_bytes(top_peak)}, {ratio:.2f}x the "
                    f"mean {format_bytes(mean)} (lowest: rank {low_rank} at {format_bytes(low_peak)}; warning above "
                    f"{ratio_limit:.2f}x); uneven batches or sequence lengths, or a rank holding extra state",
                    stage=stage, max_rank=top_rank, max_peak_bytes=top_peak, mean_peak_bytes=mean,
                    min_rank=low_rank, min_peak_bytes=low_peak, ratio=ratio)
    return ratios


def _outside_warnings(snaps: Sequence[Snapshot], out: _Out) -> None:
    over: List[Tuple[int, Snapshot, int]] = []
    for s in snaps:
        outside = outside_allocator_bytes(s)
        if outside is not None and s.overhead_bytes is not None and outside > s.overhead_bytes:
            over.append((outside - s.overhead_bytes, s, outside))
    if not over:
        return
    excess, s, outside = max(over, key=lambda t: (t[0], -t[1].rank))
    want = -(-outside // (64 * MiB)) * 64 * MiB
    pool = allocator_pool_bytes(s)
    what = "reserved" if s.reserved_bytes is not None else "peak"
    who = (f"rank {s.rank}" if len(over) == 1 else
           f"{len(over)} ranks (ranks {_ranks_text([x.rank for _, x, _ in over])}); the worst, rank {s.rank},")
    out.add("outside_allocator", [x.rank for _, x, _ in over],
            f"{who} holds {format_bytes(nvml_on_planned(s))} on its GPU per NVML but its allocator {what} is "
            f"{format_bytes(pool)}: {format_bytes(outside)} outside the allocator (CUDA context, cuBLAS/cuDNN "
            f"workspaces, NCCL buffers) against the {format_bytes(s.overhead_bytes)} per process the plan assumed; "
            f"pass overhead='{format_bytes(want, 0).replace(' ', '')}' to distmem.init() so the plan leaves room for it",
            worst_rank=s.rank, nvml_bytes=nvml_on_planned(s), pool_bytes=pool, outside_bytes=outside,
            assumed_bytes=s.overhead_bytes, suggested_overhead_bytes=want)


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
        mean = statistics.fmean(peaks)
        top = max(peaks)
        agg.update(total_current_bytes=sum(s.current_bytes or 0 for s in snaps), total_peak_bytes=sum(peaks),
                   max_peak_bytes=top, min_peak_bytes=min(peaks), mean_peak_bytes=mean,
                   imbalance=(top / mean) if mean else None,
                   max_peak_rank=snaps[[(p or -1) for p in all_peaks].index(top or -1)].rank)
    limited = [(s.limit_bytes - (p or 0), s.rank) for s, p in zip(snaps, all_peaks) if s.limit_bytes]
    if limited:
        head, r = min(limited)
        agg.update(total_limit_bytes=sum(s.limit_bytes for s in snaps if s.limit_bytes),
                   min_headroom_bytes=head, min_headroom_rank=r)
    nv = [s.nvml_total for s in snaps if s.nvml_total is not None]
    if nv:
        agg["total_nvml_bytes"] = sum(nv)
    out = _Out()
    if missing:
        out.add("missing", missing,
                f"rank(s) {_ranks_text(list(missing))} did not report within the timeout (crashed, hung, or never "
                "called distmem.report()); their rows are missing", count=len(missing))
    prints = {s.plan_fingerprint for s in snaps if s.plan_fingerprint}
    if len(prints) > 1:
        by: Dict[str, List[int]] = {}
        for s in snaps:
            by.setdefault(s.plan_fingerprint, []).append(s.rank)
        out.add("plan_mismatch", [s.rank for s in snaps],
                "ranks computed different plans: " + "; ".join(f"{fp}: ranks {_ranks_text(rs)}" for fp, rs in by.items())
                + " - pass the same options (and DISTMEM_FLEET) on every rank", fingerprints=by)
    _limit_warnings(snaps, out, near_limit)
    _gpu_warnings(snaps, out)
    ratios = _imbalance_warnings(snaps, out, imbalance, imbalance_min_bytes)
    if ratios:
        agg["stage_imbalance"] = ratios
    _outside_warnings(snaps, out)
    return Report(world_size, strategy, list(snaps), sorted(missing), agg, out.sentences, detail=detail,
                  findings=out.findings)
