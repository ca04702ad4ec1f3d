"""Snapshot (one rank's memory) and Report (the job's, on rank 0). Pure aggregation and warnings."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from .units import format_bytes

__all__ = ["Snapshot", "Report", "aggregate", "WARN_NEAR_LIMIT", "WARN_IMBALANCE"]

#: A rank whose peak passes this share of its limit is warned about: the next larger batch or
#: fragmentation spike will run it out of memory.
WARN_NEAR_LIMIT = 0.90
#: Ranks with the same role whose peaks differ by more than this ratio (max / mean) are flagged.
WARN_IMBALANCE = 1.25


@dataclass
class Snapshot:
    """One rank's memory at one moment. Bytes throughout; None where a figure is not available.

    ``current_bytes``/``peak_bytes``: the framework allocator's in-use and peak (TensorFlow
    ``get_memory_info``, torch ``memory_allocated``/``max_memory_allocated``), summed over the
    rank's devices (``CPU:0`` without a GPU). ``reserved_bytes``: what the allocator holds from the
    driver (torch ``memory_reserved``). ``nvml_bytes``: this process's usage as NVML reports it
    (``nvidia-smi``'s process table), by device ordinal. ``rss_bytes``: resident host memory.
    ``gpu_pids``: for each device this rank uses, every pid NVML lists on it.
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

    @property
    def nvml_total(self) -> Optional[int]:
        vals = [v for v in self.nvml_bytes.values() if v is not None]
        return sum(vals) if vals else None

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["nvml_bytes"] = {str(k): v for k, v in self.nvml_bytes.items()}
        d["gpu_pids"] = {str(k): v for k, v in self.gpu_pids.items()}
        d["gpu_uuids"] = {str(k): v for k, v in self.gpu_uuids.items()}
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Snapshot":
        d = dict(d)
        for key in ("nvml_bytes", "gpu_pids", "gpu_uuids"):
            d[key] = {int(k): v for k, v in (d.get(key) or {}).items()}
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Report:
    """The whole job as rank 0 sees it: one row per rank that answered, the missing ranks,
    aggregates and warnings."""

    world_size: int
    strategy: str
    ranks: List[Snapshot]
    missing: List[int]
    aggregates: Dict[str, Any]
    warnings: List[str]
    created: float = field(default_factory=time.time)
    detail: str = "full"
    timeline: List[Dict[str, Any]] = field(default_factory=list)

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
            "timeline": list(self.timeline),
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Report":
        return cls(world_size=d["world_size"], strategy=d.get("strategy", "?"),
                   ranks=[Snapshot.from_dict(r) for r in d.get("ranks", [])], missing=d.get("missing", []),
                   aggregates=d.get("aggregates", {}), warnings=d.get("warnings", []),
                   created=d.get("created", 0.0), detail=d.get("detail", "full"), timeline=d.get("timeline", []))


def _peak(s: Snapshot) -> Optional[int]:
    return s.peak_bytes if s.peak_bytes is not None else s.current_bytes


def _warnings(snaps: Sequence[Snapshot]) -> List[str]:
    out: List[str] = []
    for s in snaps:
        peak = _peak(s)
        if s.limit_bytes and peak is not None:
            if peak > s.limit_bytes:
                out.append(f"rank {s.rank} peaked at {format_bytes(peak)}, above its plan of "
                           f"{format_bytes(s.limit_bytes)} ({peak / s.limit_bytes:.0%})"
                           + ("" if s.enforced else "; it is not hard-limited, so a neighbour may run out"))
            elif peak > WARN_NEAR_LIMIT * s.limit_bytes:
                out.append(f"rank {s.rank} peaked at {format_bytes(peak)} = {peak / s.limit_bytes:.0%} of its "
                           f"limit {format_bytes(s.limit_bytes)} (warning above {WARN_NEAR_LIMIT:.0%}); a larger "
                           "batch will run out of memory")
    # Ranks the plan gave a GPU to exclusively, found sharing it: the every-rank-on-GPU-0 mistake.
    by_gpu: Dict[tuple, List[Snapshot]] = {}
    for s in snaps:
        for dev in s.devices:
            key = (s.host, s.gpu_uuids.get(dev, dev))
            by_gpu.setdefault(key, []).append(s)
    job_pids: Dict[tuple, int] = {(s.host, s.pid): s.rank for s in snaps}
    for s in snaps:
        for dev, pids in s.gpu_pids.items():
            others = sorted(job_pids[(s.host, p)] for p in pids if (s.host, p) in job_pids and p != s.pid)
            planned = {x.rank for x in by_gpu.get((s.host, s.gpu_uuids.get(dev, dev)), [])}
            intruders = [r for r in others if r not in planned]
            if intruders and s.rank == min(planned | {s.rank}):
                out.append(f"GPU {dev} on {s.host} was planned for rank(s) {sorted(planned)} but NVML also shows "
                           f"rank(s) {intruders} on it: ranks {sorted(set(intruders) | planned)} share it; pin each "
                           "rank before its framework starts (call distmem.init() first, before any GPU op)")
            foreign = [p for p in pids if (s.host, p) not in job_pids]
            if foreign and s.rank == min(planned | {s.rank}):
                out.append(f"GPU {dev} on {s.host} also runs {len(foreign)} process(es) outside this job "
                           f"(pid {', '.join(map(str, foreign[:5]))}); they take memory the plan counted as free")
    return out


def aggregate(snaps: Sequence[Snapshot], world_size: int, missing: Sequence[int] = (),
              strategy: str = "?", detail: str = "full") -> Report:
    """Build the job's report from the snapshots rank 0 received."""
    snaps = sorted(snaps, key=lambda s: s.rank)
    peaks = [p for p in (_peak(s) for s in snaps) if p is not None]
    agg: Dict[str, Any] = {"ranks_reporting": len(snaps), "ranks_missing": len(missing)}
    if peaks:
        mean = statistics.fmean(peaks)
        agg.update(total_current_bytes=sum(s.current_bytes or 0 for s in snaps), total_peak_bytes=sum(peaks),
                   max_peak_bytes=max(peaks), min_peak_bytes=min(peaks), mean_peak_bytes=mean,
                   imbalance=(max(peaks) / mean) if mean else None,
                   max_peak_rank=max(snaps, key=lambda s: _peak(s) or -1).rank)
    limited = [(s.limit_bytes - (_peak(s) or 0), s.rank) for s in snaps if s.limit_bytes]
    if limited:
        head, r = min(limited)
        agg.update(total_limit_bytes=sum(s.limit_bytes for s in snaps if s.limit_bytes),
                   min_headroom_bytes=head, min_headroom_rank=r)
    nv = [s.nvml_total for s in snaps if s.nvml_total is not None]
    if nv:
        agg["total_nvml_bytes"] = sum(nv)
    warnings = _warnings(snaps)
    if missing:
        warnings.insert(0, f"rank(s) {list(missing)} did not report within the timeout (crashed, hung, or never "
                           "called distmem.report()); their rows are missing")
    prints = {s.plan_fingerprint for s in snaps if s.plan_fingerprint}
    if len(prints) > 1:
        by = {}
        for s in snaps:
            by.setdefault(s.plan_fingerprint, []).append(s.rank)
        warnings.insert(0, "ranks computed different plans: " + "; ".join(f"{fp}: ranks {rs}" for fp, rs in by.items())
                        + " - pass the same options on every rank")
    if peaks and len(peaks) > 1 and agg.get("imbalance") and agg["imbalance"] > WARN_IMBALANCE:
        stages = {s.stage for s in snaps}
        if stages == {None}:
            warnings.append(f"memory imbalance: the largest peak (rank {agg['max_peak_rank']}, "
                            f"{format_bytes(agg['max_peak_bytes'])}) is {agg['imbalance']:.2f}x the mean "
                            f"{format_bytes(agg['mean_peak_bytes'])}")
    return Report(world_size, strategy, list(snaps), sorted(missing), agg, warnings, detail=detail)
