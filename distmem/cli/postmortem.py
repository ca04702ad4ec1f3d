"""``distmem postmortem RUN_DIR``: after an out-of-memory error, every rank's record on one page -
which rank, by how much, why, and what to change (:mod:`distmem.report.postmortem`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict

from ..errors import ConfigError
from ..observe.oom_record import OOM_FOLDER
from ..plan.from_report import read_oom_records_noted, read_report_file
from ..report.postmortem import postmortem, render_text
from ..report.sinks.png import plot_format
from ..units import GiB, MiB

__all__ = ["add_arguments", "run", "plot"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="the run folder (DISTMEM_RUN_DIR; default the report's folder, else runs/last): its oom/ "
                        "holds one record per rank that ran out")
    p.add_argument("--json", action="store_true", help="the page as JSON")
    p.add_argument("--plot", metavar="PICTURE", help="draw each rank that ran out: held, free in its pool, asked for, "
                                                      "others on its GPU, against its planned limit (the extension "
                                                      "names the format: .png, .svg, .pdf, ...)")


def plot(page: Dict[str, Any], path: str) -> str:
    """A picture of the page, in the format ``path``'s extension names (:func:`plot_format`): one
    bar per rank that ran out (allocated, free in the pool, the request, other processes' bytes),
    beside it what its whole step needed, its planned limit and its peers' median, the causes
    written on it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(f"--plot needs matplotlib ({exc}); pip install matplotlib, or drop --plot") from None
    from ..report.sinks.files import atomic_file

    fmt = plot_format(path, "--plot")
    entries = page["entries"]
    top = max([1] + [max((e.get("reserved_bytes") or 0), (e.get("needed_bytes") or 0), e.get("limit_bytes") or 0,
                         e.get("step_need_bytes") or 0)
                     + sum(p.get("bytes") or 0 for p in e["gpu_processes"] if p.get("who") == "other")
                     for e in entries])
    unit, uname = (GiB, "GiB") if top >= GiB else (MiB, "MiB")
    fig, ax = plt.subplots(figsize=(10, 1.9 + 0.9 * max(len(entries), 1)))
    for y, e in enumerate(entries):
        alloc = (e.get("allocated_bytes") or 0) / unit
        free = max((e.get("reserved_bytes") or 0) - (e.get("allocated_bytes") or 0), 0) / unit
        req = (e.get("request_bytes") or 0) / unit
        other = sum(p.get("bytes") or 0 for p in e["gpu_processes"] if p.get("who") == "other") / unit
        first = y == 0
        ax.barh(y, alloc, color="#1F4E79", label="allocated" if first else None)
        ax.barh(y, free, left=alloc, color="#9BBBD9", label="free in its pool (reserved - allocated)" if first else None)
        ax.barh(y, req, left=alloc + free, color="#D64545", label="asked for" if first else None)
        if other:
            ax.barh(y, other, left=alloc + free + req, color="#7B3FA0", label="other processes" if first else None)
        if e.get("step_need_bytes"):
            ax.barh(y + 0.3, e["step_need_bytes"] / unit, height=0.16, color="#E8A33D",
                    label=f"the whole step needed ({e.get('step_need_source')})" if first else None)
        median = next((c.get("median_bytes") for c in e["causes"] if c.get("median_bytes")), None)
        if median:
            ax.vlines(median / unit, y - 0.45, y + 0.45, colors="#2E8B57", linestyles="dotted", linewidth=2,
                      label="its peers' median" if first else None)
        if e.get("limit_bytes"):
            ax.vlines(e["limit_bytes"] / unit, y - 0.45, y + 0.45, colors="#222222", linewidth=2.5,
                      label="planned limit" if first else None)
        kinds = ", ".join(c["kind"].replace("_", " ") for c in e["causes"])
        ax.text(0.01 * top / unit, y - 0.05, kinds, fontsize=8, va="center", color="white")
    ax.set_yticks(range(len(entries)))
    ax.set_yticklabels([f"rank {e['rank']}" + (f" / stage {e['stage']}" if e.get("stage") is not None else "")
                        for e in entries])
    ax.invert_yaxis()
    ax.set_xlabel(uname)
    ax.set_title(f"out of memory: {len(entries)} of {page.get('world_size') or '?'} ranks ({page['run_dir']})",
                 fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.4 / max(len(entries), 1)), fontsize=7, ncol=4,
              frameon=False)
    fig.tight_layout()
    with atomic_file(path, "." + fmt) as f:
        fig.savefig(f, format=fmt, dpi=110)
    plt.close(fig)
    return path


def _report(run_dir: str) -> Dict[str, Any] | None:
    """The run's report beside the records (its rows stand in for peers that wrote none); None
    where there is none or it is not a report."""
    path = os.path.join(run_dir, "report.json")
    if not os.path.lexists(path):
        return None
    try:  # checked: no link, no FIFO, bounded, this user's own in a folder others can write
        data = read_report_file(path)
    except (ConfigError, OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def run(args: argparse.Namespace) -> int:
    run_dir = args.run_dir
    if not os.path.isdir(run_dir):
        raise ConfigError(f"{run_dir!r} is not a folder; give the run folder whose {OOM_FOLDER}/ holds the records "
                          "(DISTMEM_RUN_DIR, default runs/last)")
    if args.plot:
        from .checks import output_file

        output_file(args.plot, "--plot")  # before the work it follows
        plot_format(args.plot, "--plot")  # the extension names the format: refused before the work
    records, ignored = read_oom_records_noted(run_dir)
    for line in ignored[:8]:  # what was not taken as this user's records, and why
        print(f"distmem postmortem: left out {line}", file=sys.stderr)
    size, report = None, _report(run_dir)
    if report is not None:
        try:
            size = int(report.get("world_size") or 0) or None
        except (ValueError, TypeError):
            size = None
    page = postmortem(records, run_dir=run_dir, world_size=size, report=report)
    if args.plot and page["entries"]:  # nothing to draw without a record: the page says so
        plot(page, args.plot)
    if args.json:
        print(json.dumps(page, indent=1, default=str))
    else:
        print(render_text(page), end="")
    return 0 if page["entries"] else 1
