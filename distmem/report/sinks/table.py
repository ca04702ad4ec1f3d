"""The report as a table: plain text readable in any job log, or rich on an interactive terminal."""
from __future__ import annotations

import shutil
import sys
from typing import IO, Any, List, Optional

from ... import settings
from ...console import text_table
from ...units import format_bytes, plural
from ..aggregate import Report

__all__ = ["table", "rich_table", "print_report", "source_note"]


def _b(n) -> str:
    return format_bytes(n) if n is not None else "-"


def source_note(report: Report) -> str:
    sources = sorted({s.plan_source for s in report.ranks if s.plan_source})
    dry = [src for src in sources if src != "nvml"]
    if not dry:
        return ""
    what = ", ".join(dry)
    return f"; devices from {what} (dry run: limits planned, not applied)" if what != "none" else "; no GPU (CPU mode)"


_HEAD = ["rank", "local", "host", "device", "stage", "mode", "planned", "current", "peak", "reserved", "nvml",
         "rss", "headroom"]


def _mode(s: Any) -> str:
    """The rank's mode; a limit that is only planned carries a star (the footer says what it means)."""
    mode = s.allocation.get("mode", "?") if s.allocation else "?"
    return mode + ("" if s.enforced or mode in ("cpu", "growth") else "*")


def _rows(report: Report) -> List[List[str]]:
    rows: List[List[str]] = []
    for s in report.ranks:
        peak = s.peak_or_current
        head_room = (s.limit_bytes - peak) if (s.limit_bytes and peak is not None) else None
        dev = ",".join(f"GPU{d}" for d in dict.fromkeys(s.devices)) or "CPU"  # tenants share one GPU
        rows.append([str(s.rank), str(s.local_rank), s.host[:16], dev, "-" if s.stage is None else str(s.stage),
                     _mode(s),
                     _b(s.limit_bytes), _b(s.current_bytes), _b(peak), _b(s.reserved_bytes), _b(s.nvml_total),
                     _b(s.rss_bytes), _b(head_room)])
    for r in report.missing:
        rows.append([str(r), "?", "(missing)", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"])
    return rows


def _title(report: Report) -> str:
    if report.detail == "summary":
        n = report.aggregates.get("ranks_reporting")
        return (f"distmem report (summary): {plural(report.world_size, 'rank')}, strategy {report.strategy}, "
                + ("reduction incomplete" if n is None else f"{n} reporting"))
    return (f"distmem report: {plural(report.world_size, 'rank')}, strategy {report.strategy}, "
            f"{len(report.ranks)} reporting" + (f", missing {report.missing}" if report.missing else "")
            + source_note(report))


def _ranks(ranks: List[int]) -> str:
    ranks = sorted(ranks)
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


def _footer(report: Report) -> List[str]:
    out: List[str] = []
    if any(_mode(s).endswith("*") for s in report.ranks):
        out.append("*: limit planned, not enforced (dry run, or a device the framework cannot cap)")
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
    hosts = a.get("hosts") or {}
    if len(hosts) > 1:
        for name, h in hosts.items():
            ranks = h.get("ranks") or []
            out.append(f"host {name}: {plural(len(ranks), 'rank')} ({_ranks(ranks)}) on {plural(h.get('gpus', 0), 'GPU')}, planned "
                       f"{_b(h.get('planned_bytes') or None)}, peak {_b(h.get('peak_bytes') or None)} (largest "
                       f"{_b(h.get('max_peak_bytes') or None)})")
    if report.timeline:
        first, last = report.timeline[0], report.timeline[-1]
        out.append(f"timeline: {plural(len(report.timeline), 'point')}, steps {first.get('step')}..{last.get('step')}")
    return out


def table(report: Report) -> str:
    """The per-rank table, planned beside actual, with totals, imbalance, headroom and warnings.

    Plain text with aligned columns, so it reads the same in a terminal and in a job log.
    """
    rows = _rows(report)
    out = [_title(report)]
    if rows:
        out += text_table(_HEAD, rows, [i >= 6 for i in range(len(_HEAD))], rule=True)
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
        from ...discover.identity import launcher_of

        use_rich = bool(getattr(file, "isatty", lambda: False)()) and launcher_of() == "none" \
            and not settings.plain()
    if use_rich:
        try:
            from rich.console import Console

            tty = bool(getattr(file, "isatty", lambda: False)())
            # A terminal's own width; into a pipe or file (``--color always``) the table's natural
            # width: a fixed one would cut its columns.
            width = shutil.get_terminal_size((120, 40)).columns if tty else 1000
            Console(file=file, width=width, force_terminal=True if not tty else None).print(rich_table(report))
            return
        except ImportError:
            pass
    # One write with its newline, then a flush: launchers that tag output per rank (mpirun's
    # --tag-output, horovodrun) cannot splice another rank's tag into the table's last line.
    file.write(table(report) + "\n")
    file.flush()


