"""Render a Report: a table (plain text readable in any log, or rich on a terminal), JSON, a PNG,
TensorBoard scalars and a Prometheus text file. Every output is opt-in and written atomically.

Nothing here imports a plotting or ML library at import time: matplotlib, rich and the TensorBoard
writer are imported by the function that needs them.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import textwrap
import time
from typing import IO, Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .errors import ConfigError
from .stats import WARN_NEAR_LIMIT, Report, plan_usage
from .units import GiB, MiB, format_bytes

__all__ = ["table", "rich_table", "print_report", "write_json", "read_json", "plot", "prometheus",
           "prometheus_text", "TensorBoard"]

log = logging.getLogger("distmem")


def _b(n) -> str:
    return format_bytes(n) if n is not None else "-"


def _source_note(report: Report) -> str:
    sources = sorted({s.plan_source for s in report.ranks if s.plan_source})
    dry = [src for src in sources if src != "nvml"]
    if not dry:
        return ""
    what = ", ".join(dry)
    return f"; devices from {what} (dry run: limits planned, not applied)" if what != "none" else "; no GPU (CPU mode)"


_HEAD = ["rank", "local", "host", "device", "stage", "mode", "planned", "current", "peak", "reserved", "nvml",
         "rss", "headroom"]


def _rows(report: Report) -> List[List[str]]:
    rows: List[List[str]] = []
    for s in report.ranks:
        mode = s.allocation.get("mode", "?") if s.allocation else "?"
        peak = s.peak_or_current
        head_room = (s.limit_bytes - peak) if (s.limit_bytes and peak is not None) else None
        dev = ",".join(f"GPU{d}" for d in dict.fromkeys(s.devices)) or "CPU"  # tenants share one GPU
        rows.append([str(s.rank), str(s.local_rank), s.host[:16], dev, "-" if s.stage is None else str(s.stage),
                     mode + ("" if s.enforced or mode in ("cpu", "growth") else "*"),
                     _b(s.limit_bytes), _b(s.current_bytes), _b(peak), _b(s.reserved_bytes), _b(s.nvml_total),
                     _b(s.rss_bytes), _b(head_room)])
    for r in report.missing:
        rows.append([str(r), "?", "(missing)", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"])
    return rows


def _title(report: Report) -> str:
    if report.detail == "summary":
        n = report.aggregates.get("ranks_reporting")
        return (f"distmem report (summary): {report.world_size} rank(s), strategy {report.strategy}, "
                + ("reduction incomplete" if n is None else f"{n} reporting"))
    return (f"distmem report: {report.world_size} rank(s), strategy {report.strategy}, "
            f"{len(report.ranks)} reporting" + (f", missing {report.missing}" if report.missing else "")
            + _source_note(report))


def _footer(report: Report) -> List[str]:
    out: List[str] = []
    for s in report.ranks:
        if s.strategy == "tenants":
            out += [f"rank {s.rank} {note}" for note in (s.allocation or {}).get("notes", [])]
    a = report.aggregates
    if "total_peak_bytes" in a:
        out.append(f"total: current {_b(a.get('total_current_bytes'))}, peak {_b(a['total_peak_bytes'])}"
                   + (f", planned {_b(a['total_limit_bytes'])}" if a.get("total_limit_bytes") else "")
                   + (f", nvml {_b(a['total_nvml_bytes'])}" if a.get("total_nvml_bytes") else ""))
        imb = a.get("imbalance")
        low = (a.get("summary") or {}).get("min_peak_rank")
        out.append(f"peak per rank: max {_b(a['max_peak_bytes'])} (rank {a.get('max_peak_rank')}), mean "
                   f"{_b(a['mean_peak_bytes'])}, min {_b(a['min_peak_bytes'])}"
                   + (f" (rank {low})" if low is not None else "")
                   + (f", imbalance max/mean {imb:.2f}" if imb else ""))
    if "min_headroom_bytes" in a:
        out.append(f"smallest headroom: {_b(a['min_headroom_bytes'])} on rank {a['min_headroom_rank']}")
    if report.timeline:
        first, last = report.timeline[0], report.timeline[-1]
        out.append(f"timeline: {len(report.timeline)} point(s), steps {first.get('step')}..{last.get('step')}")
    return out


def table(report: Report) -> str:
    """The per-rank table, planned beside actual, with totals, imbalance, headroom and warnings.

    Plain text with aligned columns, so it reads the same in a terminal and in a job log.
    """
    rows = _rows(report)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(_HEAD)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 6 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    out = [_title(report)]
    if rows:
        out += [line(_HEAD), line(["-" * w for w in widths])]
        out += [line(r) for r in rows]
    out += _footer(report)
    for w in report.warnings:
        out.append(f"WARNING: {w}")
    return "\n".join(out)


def rich_table(report: Report) -> Any:
    """The same content as :func:`table` as a ``rich`` renderable (requires ``rich``)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = Table(title=_title(report), title_justify="left", header_style="bold")
    for i, h in enumerate(_HEAD):
        t.add_column(h, justify="right" if i >= 6 else "left", no_wrap=True)
    ratio = {s.rank: (s.peak_or_current / s.limit_bytes) for s in report.ranks
             if s.limit_bytes and s.peak_or_current is not None}
    for row in _rows(report):
        style = None
        if row[2] == "(missing)":
            style = "red"
        elif row[0].isdigit() and int(row[0]) in ratio:
            r = ratio[int(row[0])]
            style = "bold red" if r > 1 else ("yellow" if r > 0.9 else None)
        t.add_row(*row, style=style)
    parts: List[Any] = [t] if report.ranks or report.missing else [Text(_title(report), style="bold")]
    parts += [Text(line) for line in _footer(report)]
    parts += [Text(f"WARNING: {w}", style="yellow") for w in report.warnings]
    return Group(*parts)


def print_report(report: Report, file: Optional[IO[str]] = None, use_rich: Optional[bool] = None) -> None:
    """Print the table: rich colours on a terminal when ``rich`` is installed, plain text otherwise
    (job logs, pipes). ``use_rich`` forces either."""
    file = file or sys.stdout
    if use_rich is None:
        # Launchers (mpirun, horovodrun) prefix every line with the rank and may hand ranks a
        # pseudo-terminal: boxes and colours would only garble the job log there.
        from .topology import launcher_of

        use_rich = bool(getattr(file, "isatty", lambda: False)()) and launcher_of() == "none" \
            and os.environ.get("DISTMEM_PLAIN") != "1"
    if use_rich:
        try:
            from rich.console import Console

            Console(file=file, width=max(120, 0)).print(rich_table(report))
            return
        except ImportError:
            pass
    print(table(report), file=file, flush=True)


@contextlib.contextmanager
def _atomic_path(path: str, suffix: str, mode: int = 0o644) -> Iterator[str]:
    """Yield a temporary path in ``path``'s folder; once the body wrote it, rename it onto ``path``.
    Readers never see half a file; on an error the temporary file is removed."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".distmem-", suffix=suffix + ".tmp", dir=folder)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _atomic_write(path: str, data: str, suffix: str, mode: int = 0o644) -> str:
    """Write through a temporary file in the same folder, then rename: readers never see half a file.

    The temporary name starts with a dot and does not end in the final suffix, so collectors that
    glob (node_exporter reads ``*.prom``) skip it; ``mode`` makes the result readable to them (a
    temporary file is created 0600).
    """
    with _atomic_path(path, suffix, mode) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(data)
    return path


def write_json(report: Report | Dict[str, Any], path: str) -> str:
    """Write the report as JSON atomically (temporary file in the same folder, then rename)."""
    data = report.to_dict() if isinstance(report, Report) else report
    return _atomic_write(path, json.dumps(data, indent=1, sort_keys=True, default=str) + "\n", ".json")


def read_json(path: str) -> Report:
    """Read a report written by :func:`write_json` (or a timeline file of ``ReportEvery``)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"report file {path!r} does not exist; distmem.report(path=...) or "
                          "DISTMEM_REPORT names where rank 0 writes it") from None
    except ValueError as exc:
        raise ConfigError(f"report file {path!r} is not JSON ({exc}); was the job killed while writing it?") from None
    if not isinstance(data, dict) or "world_size" not in data:
        raise ConfigError(f"{path!r} is JSON but not a distmem report (no 'world_size' key); expected the file "
                          "distmem.report(path=...) or MemoryReport(path=...) wrote")
    return Report.from_dict(data)


# ---------------------------------------------------------------------------------------------------------
# Prometheus text format, for node_exporter's textfile collector.

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
    and one ``distmem_warnings`` gauge per warning kind. ``labels`` (e.g. ``{"run": "resnet-7"}``) go on
    every series, so several jobs on one node can share the textfile folder. No timestamps: the
    textfile collector does not accept them."""
    base = dict(labels or {})
    for k in base:
        if not k or not set(k) <= _LABEL_NAME_OK or k[0].isdigit() or k.startswith("__"):
            raise ConfigError(f"Prometheus label name {k!r} is invalid: use letters, digits and underscores, not "
                              "starting with a digit or '__'")
        if k in ("job", "instance"):
            raise ConfigError(f"Prometheus label {k!r} is set by the scraper (node_exporter would rename it "
                              "exported_" + k + "); call it e.g. 'run' instead")
    lines: List[str] = []

    def gauge(name: str, helptext: str, series: Sequence[Tuple[Dict[str, Any], Optional[float]]]) -> None:
        series = [(lab, v) for lab, v in series if v is not None]
        if not series:
            return
        lines.append(f"# HELP {name} {helptext}")
        lines.append(f"# TYPE {name} gauge")
        for lab, v in series:
            lines.append(f"{name}{_labels({**base, **lab})} {_num(v)}")

    def rank_labels(s: Any) -> Dict[str, Any]:
        return {"rank": s.rank, "host": s.host, "local_rank": s.local_rank,
                "gpu": ",".join(map(str, s.devices)) or "cpu"}

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
    from .stats import WARNING_KINDS

    gauge("distmem_warnings", "Warnings of each kind in the last report (see docs/observability.md).",
          [({"kind": k}, counts.get(k, 0)) for k in WARNING_KINDS])
    gauge("distmem_report_step", "Training step of the last report.", [({}, step)])
    gauge("distmem_report_timestamp_seconds", "Unix time the last report was made.",
          [({}, report.created or time.time())])
    return "\n".join(lines) + "\n"


def prometheus(report: Report, path: str, labels: Optional[Dict[str, str]] = None, step: Optional[int] = None) -> str:
    """Write :func:`prometheus_text` to ``path`` atomically (give it a ``.prom`` name inside
    node_exporter's ``--collector.textfile.directory``)."""
    return _atomic_write(path, prometheus_text(report, labels, step), ".prom")


# ---------------------------------------------------------------------------------------------------------
# TensorBoard scalars.

class TensorBoard:
    """Scalars per rank under ``log_dir/rank_<r>`` (TensorBoard overlays the ranks in one chart per
    tag) and job scalars under ``log_dir/job``. Tags: ``memory/{current,peak,limit,reserved,nvml}_mib``
    (MiB, so the axis reads without conversion).

    Backend: ``tf.summary`` when TensorFlow is already imported in this process; else
    ``torch.utils.tensorboard`` when torch and tensorboard are; else nothing, with one note in the log
    (importing TensorFlow into a PyTorch job only for this would start its GPU runtime there).
    Beyond ``max_ranks`` ranks only the job scalars are written.
    """

    def __init__(self, log_dir: str, max_ranks: int = 64):
        self.log_dir = log_dir
        self.max_ranks = max_ranks
        self.backend = self._pick()
        self._writers: Dict[str, Any] = {}
        if self.backend == "none":
            self.note = ("TensorBoard scalars skipped: the tensorboard package is not installed, or neither "
                         "TensorFlow nor torch is loaded in this process (pip install tensorboard)")
            log.warning("distmem: %s", self.note)
        else:
            self.note = ""

    @staticmethod
    def _pick() -> str:
        import importlib.util

        if "tensorflow" in sys.modules and importlib.util.find_spec("tensorboard") is not None:
            return "tf"  # tf.summary writes through the tensorboard package (not a dependency of TF >= 2.16)
        if "torch" in sys.modules:
            try:
                import torch.utils.tensorboard  # noqa: F401

                return "torch"
            except ImportError:
                return "none"
        return "none"

    def _writer(self, name: str) -> Any:
        if name not in self._writers:
            path = os.path.join(self.log_dir, name)
            if self.backend == "tf":
                import tensorflow as tf

                self._writers[name] = tf.summary.create_file_writer(path)
            else:
                from torch.utils.tensorboard import SummaryWriter

                self._writers[name] = SummaryWriter(path)
        return self._writers[name]

    def _scalars(self, name: str, values: Dict[str, Optional[float]], step: int) -> None:
        values = {k: v for k, v in values.items() if v is not None}
        if not values:
            return
        w = self._writer(name)
        if self.backend == "tf":
            import tensorflow as tf

            with w.as_default(step=step):
                for tag, v in values.items():
                    tf.summary.scalar(tag, float(v))
        else:
            for tag, v in values.items():
                w.add_scalar(tag, float(v), step)

    def write(self, report: Report, step: int) -> None:
        """Add one point per rank (and the job figures) at ``step``."""
        if self.backend == "none":
            return
        mib = lambda v: None if v is None else v / MiB  # noqa: E731
        if len(report.ranks) <= self.max_ranks:
            for s in report.ranks:
                self._scalars(f"rank_{s.rank}", {
                    "memory/current_mib": mib(s.current_bytes), "memory/peak_mib": mib(s.peak_or_current),
                    "memory/limit_mib": mib(s.limit_bytes), "memory/reserved_mib": mib(s.reserved_bytes),
                    "memory/nvml_mib": mib(s.nvml_total)}, step)
        a = report.aggregates
        self._scalars("job", {"memory/max_peak_mib": mib(a.get("max_peak_bytes")),
                              "memory/mean_peak_mib": mib(a.get("mean_peak_bytes")),
                              "memory/min_peak_mib": mib(a.get("min_peak_bytes")),
                              "memory/min_headroom_mib": mib(a.get("min_headroom_bytes")),
                              "ranks/missing": a.get("ranks_missing"),
                              "ranks/warnings": float(len(report.warnings))}, step)

    def flush(self) -> None:
        for w in self._writers.values():
            w.flush()

    def close(self) -> None:
        for w in self._writers.values():
            w.close() if self.backend == "torch" else w.flush()
        self._writers.clear()


# ---------------------------------------------------------------------------------------------------------
# PNG.

def _unit(max_bytes: float) -> Tuple[float, str]:
    return (GiB, "GiB") if max_bytes >= GiB else (MiB, "MiB")


_OK, _WARN, _BAD, _CUR, _LIM, _NV = "#4C9BE8", "#F2A541", "#D64545", "#1F4E79", "#222222", "#7B3FA0"


def _legend_above(ax: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncol=len(handles),
                  frameon=False, borderaxespad=0.2)


def _bars(ax: Any, report: Report, unit: float, uname: str, off_scale: bool) -> None:
    ranks = sorted([s.rank for s in report.ranks] + list(report.missing))
    by = {s.rank: s for s in report.ranks}
    many = len(ranks) > 64
    small = len(ranks) > 12
    xs = list(range(len(ranks)))
    top = 0.0
    for x, r in zip(xs, ranks):
        s = by.get(r)
        if s is None:
            ax.bar(x, 1, width=0.8, color="none", edgecolor=_BAD, hatch="//", linewidth=1,
                   transform=ax.get_xaxis_transform(), label="missing" if not any(
                       lab == "missing" for lab in ax.get_legend_handles_labels()[1]) else None)
            if not many:
                ax.text(x, 0.5, "missing", rotation=90, ha="center", va="center", color=_BAD, fontsize=9,
                        transform=ax.get_xaxis_transform())
            continue
        peak, cur, lim, nv, res = s.peak_or_current, s.current_bytes, s.limit_bytes, s.nvml_total, s.reserved_bytes
        used = plan_usage(s)
        color = _OK
        if lim and used is not None:
            color = _BAD if used > lim else (_WARN if used > WARN_NEAR_LIMIT * lim else _OK)
        first = x == min(xs[i] for i, rr in enumerate(ranks) if rr in by)
        if res is not None:
            ax.bar(x, res / unit, width=0.78, fill=False, edgecolor="#666666", linestyle="--", linewidth=1.0,
                   label="reserved (allocator pool)" if first else None, zorder=2.5)
        if peak is not None:
            ax.bar(x, peak / unit, width=0.7, color=color, label="peak" if first else None, zorder=2)
        if cur is not None:
            ax.bar(x, cur / unit, width=0.36, color=_CUR, label="current" if first else None, zorder=3)
        if lim and not off_scale:
            ax.hlines(lim / unit, x - 0.45, x + 0.45, colors=_LIM, linewidth=2.2, zorder=4,
                      label="limit (plan)" if first else None)
        if nv is not None:
            ax.plot([x], [nv / unit], marker="D", color=_NV, markersize=6, linestyle="none", zorder=5,
                    label="NVML (process)" if first else None)
        shown = [v for v in (peak, cur, nv, res) + ((lim,) if not off_scale else ()) if v is not None]
        top = max([top] + [v / unit for v in shown])
        if many or peak is None:
            continue
        label = format_bytes(peak)
        if lim and used is not None:
            label += f"\n{used / lim:.0%}" + (f" of {format_bytes(lim)}" if off_scale and not small else "")
        ax.annotate(label, (x, max(shown) / unit), xytext=(0, 4), textcoords="offset points", ha="center",
                    va="bottom", fontsize=8.5 if not small else 6.5, linespacing=1.1,
                    color=color if color != _OK else "#333333", fontweight="bold" if color != _OK else None)
    ticks = xs if not many else xs[:: max(1, len(xs) // 32)]
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(ranks[i]) for i in ticks])
    ax.set_xlabel("rank")
    ax.set_ylabel(uname)
    ax.set_ylim(0, top * 1.25 if top else 1)
    ax.set_xlim(-0.6, len(ranks) - 0.4)
    ax.grid(axis="y", alpha=0.3, zorder=0)
    ax.set_axisbelow(True)
    _legend_above(ax)
    has_limits = any(s.limit_bytes for s in report.ranks)
    title = ("per rank: % of plan = max(peak, reserved) / planned bytes (orange above 90%, red above 100%)"
             if has_limits else
             "per rank: allocator peak (bar), current (dark); no planned limit (CPU mode)")
    if has_limits and off_scale:
        lims = sorted({s.limit_bytes for s in report.ranks if s.limit_bytes})
        title += f"; planned {', '.join(format_bytes(v) for v in lims[:3])} per rank, off this scale"
    ax.set_title(title, fontsize=10, loc="left", pad=18)


def _summary_bars(ax: Any, report: Report, unit: float, uname: str) -> None:
    a = report.aggregates
    names, vals = [], []
    for key, name in (("min_peak_bytes", "min peak"), ("mean_peak_bytes", "mean peak"), ("max_peak_bytes", "max peak")):
        if a.get(key) is not None:
            names.append(name)
            vals.append(a[key] / unit)
    ax.bar(range(len(vals)), vals, color=[_OK, _OK, _WARN][: len(vals)])
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels(names)
    ax.set_ylabel(uname)
    ax.set_title(f"summary of {a.get('ranks_reporting')} ranks (max on rank {a.get('max_peak_rank')})",
                 fontsize=10, loc="left")
    ax.grid(axis="y", alpha=0.3)


def _timeline(ax: Any, points: Sequence[Dict[str, Any]], unit: float, uname: str, off_scale: bool) -> None:
    import matplotlib

    steps = [p.get("step") or 0 for p in points]
    if points and "summary" in points[0]:
        for key, style, name in (("max_peak_bytes", "-", "max peak"), ("mean_peak_bytes", "--", "mean peak"),
                                 ("min_peak_bytes", ":", "min peak")):
            ys = [(p["summary"].get(key) or math.nan) / unit for p in points]
            ax.plot(steps, ys, style, color=_CUR, label=name)
    else:
        ranks = sorted({r for p in points for r in p.get("ranks", [])})
        cmap = matplotlib.colormaps["tab10" if len(ranks) <= 10 else "tab20"]
        if len(ranks) <= 16:
            for i, r in enumerate(ranks):
                xs, cur, pk = [], [], []
                for st, p in zip(steps, points):
                    if r in p.get("ranks", []):
                        j = p["ranks"].index(r)
                        xs.append(st)
                        cur.append(_get(p, "current_bytes", j) / unit)
                        pk.append(_get(p, "peak_bytes", j) / unit)
                c = cmap(i % cmap.N)
                ax.plot(xs, cur, "-", color=c, linewidth=1.6, marker="o" if len(xs) < 30 else None, markersize=3,
                        label=f"rank {r}")
                ax.plot(xs, pk, ":", color=c, linewidth=1.2)
        else:
            for key, style, name in (("current_bytes", "-", "current"), ("peak_bytes", ":", "peak")):
                lo, mid, hi = [], [], []
                for p in points:
                    vals = [v for v in p.get(key, []) if v is not None]
                    lo.append(min(vals) / unit if vals else math.nan)
                    hi.append(max(vals) / unit if vals else math.nan)
                    mid.append(sum(vals) / len(vals) / unit if vals else math.nan)
                ax.fill_between(steps, lo, hi, alpha=0.2, color=_OK if key == "current_bytes" else _WARN)
                ax.plot(steps, mid, style, color=_CUR, label=f"mean {name} ({len(ranks)} ranks; band min..max)")
        if not off_scale:
            limits = sorted({v for p in points for v in p.get("limit_bytes", []) if v})
            for k, lim in enumerate(limits[:4]):
                ax.axhline(lim / unit, color=_LIM, linestyle="--", linewidth=1.2,
                           label="limit (plan)" if k == 0 else None)
        missing = [st for st, p in zip(steps, points) if p.get("missing")]
        for k, st in enumerate(missing):
            ax.axvline(st, color=_BAD, alpha=0.4, linewidth=1, label="rank(s) missing" if k == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(uname)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1e-9) * 1.08)
    _legend_above(ax)
    ax.set_title("over time: current (solid) and peak (dotted)" + (" per rank" if "summary" not in (points or [{}])[0]
                                                                   else ""), fontsize=10, loc="left", pad=18)


def _get(p: Dict[str, Any], key: str, j: int) -> float:
    vals = p.get(key) or []
    v = vals[j] if j < len(vals) else None
    return math.nan if v is None else float(v)


def _extent(report: Report, points: Sequence[Dict[str, Any]]) -> Tuple[float, float]:
    """(largest usage figure, largest planned figure) over the rows, the aggregates and the timeline."""
    use: List[float] = []
    lim: List[float] = []
    for s in report.ranks:
        use += [v for v in (s.peak_or_current, s.current_bytes, s.nvml_total, s.reserved_bytes) if v is not None]
        lim += [s.limit_bytes] if s.limit_bytes else []
    for p in points:
        for key in ("current_bytes", "peak_bytes"):
            use += [v for v in p.get(key, []) if v is not None]
        lim += [v for v in p.get("limit_bytes", []) if v]
        use += [v for v in (p.get("summary") or {}).values() if isinstance(v, (int, float))]
    for k in ("max_peak_bytes", "mean_peak_bytes"):
        v = report.aggregates.get(k)
        use += [v] if isinstance(v, (int, float)) else []
    return max(use, default=0.0), max(lim, default=0.0)


def plot(report: Report, path: str, timeline: Optional[Sequence[Dict[str, Any]]] = None, dpi: int = 110) -> str:
    """Draw the report as a PNG: per-rank bars of limit / peak / current (and NVML), the timeline of
    every rank under it when there is one, and the warnings. Requires matplotlib; uses its Agg canvas
    directly, so it never touches pyplot's global state or a display."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plot() needs matplotlib: pip install matplotlib (or distmem[report])") from None
    points = list(timeline if timeline is not None else report.timeline)
    used_max, limit_max = _extent(report, points)
    # Usage far below the plan (a dry run, or a small model on a big GPU) would be a flat line under
    # the limit: scale to the usage and name the limit in the titles instead.
    off_scale = used_max > 0 and limit_max > 5 * used_max
    unit, uname = _unit(used_max if off_scale else max(used_max, limit_max))
    n_ranks = len(report.ranks) + len(report.missing)
    width = min(max(11.0, 0.35 * n_ranks + 4), 22.0)
    fs_warn = 8.5
    chars = int((width - 1.0) * 72 / (fs_warn * 0.56))
    n_warn = min(len(report.warnings), 6)
    wrapped = [textwrap.fill(f"\u26a0 {w}", chars, subsequent_indent="    ") for w in report.warnings[:n_warn]]
    if len(report.warnings) > n_warn:
        wrapped.append(f"... and {len(report.warnings) - n_warn} more warning(s) in the JSON report")
    warn_lines = sum(w.count("\n") + 1 for w in wrapped) if wrapped else 1
    panels = 2 if points else 1
    # Layout in inches, converted to figure fractions: header, panels, x labels, warnings.
    head_in, panel_in, gap_in, foot_in = 1.45, 3.2, 1.15, 0.75 + 0.16 * warn_lines
    height = head_in + panels * panel_in + (panels - 1) * gap_in + foot_in
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    frac = lambda inches: inches / height  # noqa: E731
    left, right = 0.75 / width, 1 - 0.25 / width
    axes = []
    for i in range(panels):
        top = head_in + i * (panel_in + gap_in)
        axes.append(fig.add_axes([left, 1 - frac(top + panel_in), right - left, frac(panel_in)]))
    if report.ranks or report.missing:
        _bars(axes[0], report, unit, uname, off_scale)
    else:
        _summary_bars(axes[0], report, unit, uname)
    if points:
        _timeline(axes[1], points, unit, uname, off_scale)
    a = report.aggregates
    hosts = sorted({s.host for s in report.ranks})
    sub = [f"{report.world_size} rank(s)", f"strategy {report.strategy}"]
    if hosts:
        sub.append(f"host{'s' if len(hosts) > 1 else ''} {', '.join(hosts[:3])}" + (" ..." if len(hosts) > 3 else ""))
    if report.missing:
        sub.append(f"missing rank(s) {report.missing}")
    src = _source_note(report).lstrip("; ")
    if src:
        sub.append(src)
    sub.append(time.strftime("%Y-%m-%d %H:%M", time.localtime(report.created or time.time())))
    fig.text(left, 1 - frac(0.12), "distmem memory report", ha="left", va="top", fontsize=14, fontweight="bold")
    totals = []
    if a.get("total_peak_bytes") is not None:
        totals.append(f"peak total {format_bytes(a['total_peak_bytes'])}")
    if a.get("total_limit_bytes"):
        totals.append(f"planned {format_bytes(a['total_limit_bytes'])}")
    if a.get("min_headroom_bytes") is not None:
        totals.append(f"least headroom {format_bytes(a['min_headroom_bytes'])} (rank {a.get('min_headroom_rank')})")
    if a.get("imbalance"):
        totals.append(f"peak max/mean {a['imbalance']:.2f}")
    fig.text(left, 1 - frac(0.45), " \u00b7 ".join(sub) + ("\n" + " \u00b7 ".join(totals) if totals else ""),
             ha="left", va="top", fontsize=9, color="#444444", linespacing=1.5)
    foot_top = 1 - frac(head_in + panels * panel_in + (panels - 1) * gap_in + 0.62)
    if wrapped:
        fig.text(left, foot_top, "\n".join(wrapped), ha="left", va="top", fontsize=fs_warn, color="#8A4B00",
                 linespacing=1.35)
    else:
        fig.text(left, foot_top, "\u2713 no warnings", ha="left", va="top", fontsize=9, color="#2E7D32")
    with _atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, format="png")
    return path
