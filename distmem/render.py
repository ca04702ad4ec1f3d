"""Render a Report: a plain-text table readable in any log, and JSON written atomically."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, List

from .stats import Report
from .units import format_bytes

__all__ = ["table", "write_json", "read_json"]


def _b(n) -> str:
    return format_bytes(n) if n is not None else "-"


def _source_note(report: Report) -> str:
    sources = sorted({s.plan_source for s in report.ranks if s.plan_source})
    dry = [src for src in sources if src != "nvml"]
    if not dry:
        return ""
    what = ", ".join(dry)
    return f"; devices from {what} (dry run: limits planned, not applied)" if what != "none" else "; no GPU (CPU mode)"


def table(report: Report) -> str:
    """The per-rank table, planned beside actual, with totals, imbalance and headroom."""
    head = ["rank", "local", "host", "device", "stage", "mode", "planned", "current", "peak", "reserved",
            "nvml", "rss", "headroom"]
    rows: List[List[str]] = []
    for s in report.ranks:
        mode = s.allocation.get("mode", "?") if s.allocation else "?"
        peak = s.peak_bytes if s.peak_bytes is not None else s.current_bytes
        head_room = (s.limit_bytes - peak) if (s.limit_bytes and peak is not None) else None
        dev = ",".join(f"GPU{d}" for d in s.devices) or "CPU"
        rows.append([str(s.rank), str(s.local_rank), s.host[:16], dev, "-" if s.stage is None else str(s.stage),
                     mode + ("" if s.enforced or mode in ("cpu", "growth") else "*"),
                     _b(s.limit_bytes), _b(s.current_bytes), _b(peak), _b(s.reserved_bytes), _b(s.nvml_total),
                     _b(s.rss_bytes), _b(head_room)])
    for r in report.missing:
        rows.append([str(r), "?", "(missing)", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 6 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    out = [f"distmem report: {report.world_size} rank(s), strategy {report.strategy}, "
           f"{len(report.ranks)} reporting" + (f", missing {report.missing}" if report.missing else "")
           + _source_note(report),
           line(head), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    a = report.aggregates
    if "total_peak_bytes" in a:
        out.append(f"total: current {_b(a.get('total_current_bytes'))}, peak {_b(a['total_peak_bytes'])}"
                   + (f", planned {_b(a['total_limit_bytes'])}" if a.get("total_limit_bytes") else "")
                   + (f", nvml {_b(a['total_nvml_bytes'])}" if a.get("total_nvml_bytes") else ""))
        imb = a.get("imbalance")
        out.append(f"peak per rank: max {_b(a['max_peak_bytes'])} (rank {a.get('max_peak_rank')}), mean "
                   f"{_b(a['mean_peak_bytes'])}, min {_b(a['min_peak_bytes'])}"
                   + (f", imbalance max/mean {imb:.2f}" if imb else ""))
    if "min_headroom_bytes" in a:
        out.append(f"smallest headroom: {_b(a['min_headroom_bytes'])} on rank {a['min_headroom_rank']}")
    for w in report.warnings:
        out.append(f"WARNING: {w}")
    return "\n".join(out)


def write_json(report: Report | Dict[str, Any], path: str) -> str:
    """Write the report as JSON atomically (temporary file in the same folder, then rename)."""
    data = report.to_dict() if isinstance(report, Report) else report
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".distmem-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_json(path: str) -> Report:
    with open(path, encoding="utf-8") as f:
        return Report.from_dict(json.load(f))
