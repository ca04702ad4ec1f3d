"""Prometheus text format, for node_exporter's textfile collector."""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...errors import ConfigError
from ..aggregate import Report
from .files import atomic_write

__all__ = ["prometheus_text", "prometheus"]


_PROM_RANK = [
    ("distmem_rank_current_bytes", "Framework allocator bytes in use (TensorFlow get_memory_info current, torch "
                                   "memory_allocated).", lambda s: s.current_bytes),
    ("distmem_rank_peak_bytes", "Framework allocator peak bytes since start or last reset.", lambda s: s.peak_or_current),
    ("distmem_rank_limit_bytes", "Bytes the plan gives the rank on its devices (hard limit or growth budget).",
     lambda s: s.limit_bytes),
    ("distmem_rank_reserved_bytes", "Bytes the allocator holds from the driver (torch memory_reserved).",
     lambda s: s.reserved_bytes),
    ("distmem_rank_nvml_bytes", "The process's GPU memory as NVML reports it (nvidia-smi process table).",
     lambda s: s.nvml_total),
    ("distmem_rank_rss_bytes", "Resident host memory of the rank's process.", lambda s: s.rss_bytes),
    ("distmem_rank_headroom_bytes", "Planned bytes minus peak (negative: above plan).",
     lambda s: (s.limit_bytes - s.peak_or_current) if (s.limit_bytes and s.peak_or_current is not None) else None),
]


def _esc(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(d: Dict[str, Any]) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in d.items()) + "}" if d else ""


def _num(v: float) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")
    return repr(int(v)) if float(v).is_integer() else repr(float(v))


_LABEL_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def prometheus_text(report: Report, labels: Optional[Dict[str, str]] = None, step: Optional[int] = None) -> str:
    """The report in Prometheus' text exposition format: one gauge per rank and figure, job gauges,
    and one ``distmem_warnings`` gauge per warning kind. ``labels`` (e.g. ``{"run": "resnet-7"}``) and
    the report's ``job_id`` go on every series, so several jobs on one node can share the textfile
    folder. No timestamps: the textfile collector does not accept them."""
    base = dict(labels or {})
    for k in base:
        if not k or not set(k) <= _LABEL_NAME_OK or k[0].isdigit() or k.startswith("__"):
            raise ConfigError(f"Prometheus label name {k!r} is invalid: use letters, digits and underscores, not "
                              "starting with a digit or '__'")
        if k in ("job", "instance"):
            raise ConfigError(f"Prometheus label {k!r} is set by the scraper (node_exporter would rename it "
                              "exported_" + k + "); call it e.g. 'run' instead")
    # The report's job id closes every series' labels: `distmem top` merges textfiles by job and rank.
    job = {"job_id": report.aggregates["job_id"]} if report.aggregates.get("job_id") and "job_id" not in base else {}
    lines: List[str] = []

    def gauge(name: str, helptext: str, series: Sequence[Tuple[Dict[str, Any], Optional[float]]]) -> None:
        series = [(lab, v) for lab, v in series if v is not None]
        if not series:
            return
        lines.append(f"# HELP {name} {helptext}")
        lines.append(f"# TYPE {name} gauge")
        for lab, v in series:
            lines.append(f"{name}{_labels({**base, **lab, **job})} {_num(v)}")

    def rank_labels(s: Any) -> Dict[str, Any]:
        out = {"rank": s.rank, "host": s.host, "local_rank": s.local_rank,
               "gpu": ",".join(map(str, s.devices)) or "cpu"}
        if getattr(s, "stage", None) is not None:  # a pipeline's stage: `distmem top` groups by it
            out["stage"] = s.stage
        return out

    up = [(rank_labels(s), 1) for s in report.ranks] + [({"rank": r, "host": "", "local_rank": "", "gpu": ""}, 0)
                                                         for r in report.missing]
    gauge("distmem_rank_up", "1 if the rank answered the last report, 0 if it was missing.", up)
    for name, helptext, fn in _PROM_RANK:
        gauge(name, helptext, [(rank_labels(s), fn(s)) for s in report.ranks])
    a = report.aggregates
    gauge("distmem_job_ranks", "Ranks in the job.", [({}, report.world_size)])
    gauge("distmem_job_ranks_reporting", "Ranks that answered the last report.", [({}, a.get("ranks_reporting"))])
    gauge("distmem_job_ranks_missing", "Ranks that did not answer within the timeout.",
          [({}, a.get("ranks_missing", len(report.missing)))])
    for key, name, helptext in (
            ("total_peak_bytes", "distmem_job_peak_bytes_total", "Sum of every rank's allocator peak."),
            ("max_peak_bytes", "distmem_job_peak_bytes_max", "Largest allocator peak of any rank."),
            ("mean_peak_bytes", "distmem_job_peak_bytes_mean", "Mean allocator peak over the ranks."),
            ("total_limit_bytes", "distmem_job_limit_bytes_total", "Sum of the planned bytes."),
            ("min_headroom_bytes", "distmem_job_headroom_bytes_min", "Smallest planned-minus-peak of any rank."),
            ("total_nvml_bytes", "distmem_job_nvml_bytes_total", "Sum of NVML per-process usage."),
            ("imbalance", "distmem_job_imbalance_ratio", "Largest peak over mean peak.")):
        gauge(name, helptext, [({}, a.get(key))])
    counts: Dict[str, int] = {}
    for f in report.findings:
        counts[f["kind"]] = counts.get(f["kind"], 0) + 1
    from ..findings import WARNING_KINDS

    gauge("distmem_warnings", "Warnings of each kind in the last report (see docs/observability.md).",
          [({"kind": k}, counts.get(k, 0)) for k in WARNING_KINDS])
    gauge("distmem_report_step", "Training step of the last report.", [({}, step)])
    gauge("distmem_report_timestamp_seconds", "Unix time the last report was made.",
          [({}, report.created or time.time())])
    return "\n".join(lines) + "\n"


def prometheus(report: Report, path: str, labels: Optional[Dict[str, str]] = None, step: Optional[int] = None) -> str:
    """Write :func:`prometheus_text` to ``path`` atomically (give it a ``.prom`` name inside
    node_exporter's ``--collector.textfile.directory``)."""
    return atomic_write(path, prometheus_text(report, labels, step), ".prom")


