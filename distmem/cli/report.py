"""``distmem report FILE.json``: render a saved report (or a MemoryReport timeline file).

    distmem report runs/last/report.json                      # the table
    distmem report runs/last/timeline.json --plot report.png  # and a PNG with the timeline
    distmem report runs/last/report.json --json               # the JSON, normalised, on stdout
    distmem report runs/last/report.json --prometheus /var/lib/node_exporter/job.prom --label run=resnet
    distmem report runs/last/report.json --fail-on-warnings   # exit 1 when the report has warnings (CI)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Dict

from ..errors import ConfigError
from ..units import plural
from ..report.aggregate import Report
from ..report.sinks import plot, print_report, prometheus
from ..report.sinks.files import read_report_dict
from ..report.sinks.png import plot_format
from .checks import input_file, output_file

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a report JSON written by distmem.report(path=...) or MemoryReport(path=...)")
    p.add_argument("--plot", metavar="FILE", help="draw per-rank bars and the timeline to this picture; its extension "
                                                  "names the format (.png, .svg, .pdf, .jpg...)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.add_argument("--prometheus", metavar="PROM", help="write a Prometheus text file (node_exporter textfile "
                                                        "collector), atomically")
    p.add_argument("--label", action="append", default=[], metavar="NAME=VALUE",
                   help="extra Prometheus label on every series (repeatable), e.g. run=resnet-7")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                   help="rich table on a terminal (auto), always or never")
    p.add_argument("--fail-on-warnings", action="store_true", help="exit with status 1 when the report has warnings")


def _labels(items) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--label {item!r}: write NAME=VALUE, e.g. --label run=resnet-7")
        out[name] = value
    return out


_SIZES = ("limit_bytes", "current_bytes", "peak_bytes", "reserved_bytes", "rss_bytes", "overhead_bytes")


def _check_ranks(path: str, data: Dict[str, Any]) -> None:
    ranks = data.get("ranks", [])
    if not isinstance(ranks, list):
        raise ConfigError(f"report file {path!r}: 'ranks' is {type(ranks).__name__} {ranks!r}, not a list of "
                          "ranks; was it written by distmem.report(path=...)?")
    for i, r in enumerate(ranks):
        if not isinstance(r, dict):
            raise ConfigError(f"report file {path!r}: rank entry {i} is {r!r}, not an object")
        for key in _SIZES:
            v = r.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"report file {path!r}: rank {r.get('rank', i)} {key} is {v!r}, not a number of "
                                  "bytes; the file was changed or damaged: write it again with distmem.report(path=...)")


def run(args: argparse.Namespace) -> int:
    input_file(args.file, "report file")
    if args.plot:
        plot_format(args.plot, "--plot")  # the extension names the format: refused before the work
        output_file(args.plot, "--plot")
    if args.prometheus:
        output_file(args.prometheus, "--prometheus")
    labels = _labels(args.label)
    raw = read_report_dict(args.file)  # checked: no link, no FIFO, bounded, this user's in a shared folder
    _check_ranks(args.file, raw)
    try:
        rep = Report.from_dict(raw)
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise ConfigError(f"report file {args.file!r} is not a report distmem can read ({type(exc).__name__}: "
                          f"{exc}); write it again with distmem.report(path=...)") from None
    if args.json:
        # One write: under a launcher that tags each write (horovodrun), json.dump's many small ones shred it.
        sys.stdout.write(json.dumps(rep.to_dict(), indent=1, sort_keys=True, default=str) + "\n")
        sys.stdout.flush()
    else:
        print_report(rep, use_rich={"auto": None, "always": True, "never": False}[args.color])
    if args.plot:
        plot(rep, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if args.prometheus:
        last = rep.timeline[-1].get("step") if rep.timeline else None
        prometheus(rep, args.prometheus, labels, step=last)
        print(f"Prometheus metrics written to {args.prometheus}", file=sys.stderr)
    if args.fail_on_warnings and rep.warnings:
        print(f"{plural(len(rep.warnings), 'warning')} in {args.file}", file=sys.stderr)
        return 1
    return 0
