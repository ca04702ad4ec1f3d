"""The report as a picture: planned beside actual per rank, and the timeline of the periodic reports.
The format follows the file's extension (``.png``, ``.svg``, ``.pdf``, ``.jpg``... what matplotlib
writes, :func:`plot_format`); any other name is refused before the work, with the list."""
from __future__ import annotations

import math
import os
import textwrap
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...errors import ConfigError
from ...observe.snapshot import plan_usage
from ...units import GiB, MiB, format_bytes, plural
from ..aggregate import WARN_NEAR_LIMIT, Report
from .files import atomic_file
from .table import source_note

__all__ = ["plot", "plot_format"]



#: Formats matplotlib lists that need more than matplotlib (pgf: a LaTeX installation).
_NEEDS_MORE = {"pgf"}


def plot_format(path: str, what: str = "plot") -> str:
    """The picture format ``path``'s extension names (``"png"`` for ``report.png``, ``"jpeg"`` is
    ``"jpeg"``): one matplotlib writes. ConfigError naming ``what``, the path and the formats
    otherwise (a name without an extension included), so ``out.jpg`` holds JPEG bytes, never PNG
    ones under a JPEG name. Needs matplotlib (ConfigError with the remedy without it)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise ConfigError(f"{what} {path!r} needs matplotlib: pip install matplotlib (or distmem[report])") from None
    formats = sorted(f for f in FigureCanvasAgg.get_supported_filetypes() if f not in _NEEDS_MORE)
    ext = os.path.splitext(str(path))[1].lower().lstrip(".")
    if ext not in formats:
        said = f"ends in .{ext}" if ext else "has no extension"
        raise ConfigError(f"{what} {path!r} {said}, not a picture format distmem can write; name the file with one "
                          f"of .{', .'.join(formats)} (e.g. {os.path.splitext(str(path))[0] or 'report'}.png)")
    return ext


def _unit(max_bytes: float) -> Tuple[float, str]:
    return (GiB, "GiB") if max_bytes >= GiB else (MiB, "MiB")


_OK, _WARN, _BAD, _CUR, _LIM, _NV = "#4C9BE8", "#F2A541", "#D64545", "#1F4E79", "#222222", "#7B3FA0"


def _legend_above(ax: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if len(handles) > 9:  # many ranks: a compact legend inside the axes, clear of the title
        ax.legend(handles, labels, loc="upper left", fontsize=7, ncol=min(len(handles), 9), framealpha=0.85)
        return
    if handles:
        ax.legend(handles, labels, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8,
                  ncol=min(len(handles), 9), frameon=False, borderaxespad=0.2)


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
        if many or peak is None or (len(ranks) > 32 and color == _OK):
            continue  # with many ranks only the ranks that need a look carry a figure
        label = format_bytes(peak)
        if lim and used is not None:
            label += f"\n{used / lim:.0%}" + (f" of {format_bytes(lim)}" if off_scale and not small else "")
        ax.annotate(label, (x, max(shown) / unit), xytext=(0, 4), textcoords="offset points", ha="center",
                    va="bottom", fontsize=8.5 if not small else 6.5, linespacing=1.1,
                    color=color if color != _OK else "#333333", fontweight="bold" if color != _OK else None)
    ticks = xs if not many else xs[:: max(1, len(xs) // 32)]
    ax.set_xticks(ticks)
    ax.set_xticklabels([_rank_label(by.get(ranks[i]), ranks[i], len(ranks)) for i in ticks],
                       fontsize=8 if len(ranks) <= 16 else 6)
    # Hosts side by side: a separator and the host's name over its ranks.
    hosts = [by[r].host if r in by else None for r in ranks]
    if len({h for h in hosts if h}) > 1:
        start = 0
        for i in range(1, len(hosts) + 1):
            if i == len(hosts) or hosts[i] != hosts[start]:
                if i < len(hosts):
                    ax.axvline(i - 0.5, color="#999999", linewidth=0.8, linestyle="-", zorder=1)
                ax.text((start + i - 1) / 2, 0.985, hosts[start] or "?", transform=ax.get_xaxis_transform(),
                        ha="center", va="top", fontsize=8, color="#555555")
                start = i
    ax.set_xlabel("rank" + ("  (GPU below)" if len(ranks) <= 16 else ""))
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


def _rank_label(s: Any, rank: int, n: int) -> str:
    """The tick under a bar: the rank, and with few ranks the GPU it used (and host when not shown above)."""
    if s is None or n > 16:
        return str(rank)
    gpus = ",".join(str(d) for d in s.devices) if s.devices else "cpu"
    return f"{rank}\nGPU {gpus}" if s.devices else f"{rank}\ncpu"


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
            # Ranks with equal figures would draw on top of each other: shift each rank's lines by a
            # sliver of the axis (said in the title) so that every rank stays visible.
            hi = max([v for p in points for key in ("current_bytes", "peak_bytes") for v in p.get(key, []) or []
                      if v is not None] or [0]) / unit
            shift = hi * 0.006
            for i, r in enumerate(ranks):
                xs, cur, pk = [], [], []
                for st, p in zip(steps, points):
                    if r in p.get("ranks", []):
                        j = p["ranks"].index(r)
                        xs.append(st)
                        cur.append(_get(p, "current_bytes", j) / unit)
                        pk.append(_get(p, "peak_bytes", j) / unit)
                c = cmap(i % cmap.N)
                off = (i - (len(ranks) - 1) / 2) * shift
                ax.plot(xs, [v + off for v in cur], "-", color=c, linewidth=1.6,
                        marker="o" if len(xs) < 30 else None, markersize=3, label=f"rank {r}")
                ax.plot(xs, [v + off for v in pk], ":", color=c, linewidth=1.2)
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
            ax.axvline(st, color=_BAD, alpha=0.4, linewidth=1, label="ranks missing" if k == 0 else None)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(uname)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1e-9) * (1.08 if len(ax.get_legend_handles_labels()[0]) <= 9
                                                                else 1.3))
    _legend_above(ax)
    per_rank = "summary" not in (points or [{}])[0]
    nr = len({r for p in points for r in p.get("ranks", [])}) if per_rank else 0
    ax.set_title("over time: current (solid) and peak (dotted)" + (
        " per rank (lines offset slightly so equal ranks stay visible)" if per_rank and nr <= 16 else
        f" of {nr} ranks" if per_rank else ""), fontsize=10, loc="left", pad=18)


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


def _nothing_to_draw(ax: Any, report: Report, limits: bool) -> None:
    """No rank reported a usage figure (torch on the CPU keeps no allocator statistics): say so on
    the panel instead of empty bars on a meaningless axis."""
    frameworks = sorted({s.framework for s in report.ranks if getattr(s, "framework", None)})
    if not limits:
        ax.set_ylim(0, 1)
        ax.set_yticks([])
    ax.text(0.5, 0.5, "no rank reported a memory figure" + (f" ({', '.join(frameworks)})" if frameworks else "")
            + (" - only the planned limits are drawn" if limits else "")
            + "\ntorch on the CPU keeps no allocator statistics: run on a GPU (or TensorFlow, whose CPU "
              "allocator counts) to see peaks here",
            transform=ax.transAxes, ha="center", va="center", fontsize=10, color="#8A4B00")


def plot(report: Report, path: str, timeline: Optional[Sequence[Dict[str, Any]]] = None, dpi: int = 110) -> str:
    """Draw the report as a picture in the format ``path``'s extension names (:func:`plot_format`):
    per-rank bars of limit / peak / current (and NVML), the timeline of
    every rank under it when there is one, and the warnings. Requires matplotlib; uses its Agg canvas
    directly, so it never touches pyplot's global state or a display."""
    fmt = plot_format(path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

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
        wrapped.append(f"... and {len(report.warnings) - n_warn} more {plural(len(report.warnings) - n_warn, 'warning', bare=True)} in the JSON report")
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
    if used_max <= 0:
        _nothing_to_draw(axes[0], report, limit_max > 0)
    if points:
        _timeline(axes[1], points, unit, uname, off_scale)
    a = report.aggregates
    hosts = sorted({s.host for s in report.ranks})
    sub = [f"{report.world_size} rank" + ("" if report.world_size == 1 else "s"), f"strategy {report.strategy}"]
    if hosts:
        sub.append(f"host{'s' if len(hosts) > 1 else ''} {', '.join(hosts[:3])}" + (" ..." if len(hosts) > 3 else ""))
    if report.missing:
        sub.append(f"missing {plural(len(report.missing), 'rank', bare=True)} {report.missing}")
    src = source_note(report).lstrip("; ")
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
    with atomic_file(path, "." + fmt) as f:
        fig.savefig(f, format=fmt)
    return path
