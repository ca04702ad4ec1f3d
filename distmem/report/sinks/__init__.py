"""Where reports go. Every output is a :class:`Sink` - ``write(report, step)`` then ``close()`` - so
the periodic reporter holds a list of sinks and adding an output adds a class, not a branch.

==================  ==========================================================================
:class:`TableSink`  the table on stdout (plain in job logs, rich on a terminal)
:class:`JsonSink`   the report JSON, rewritten atomically (every ``flush_seconds`` and at close)
:class:`PngSink`    the PNG (planned beside actual per rank, and the timeline), drawn at close
:class:`TensorBoardSink`  scalars per rank and for the job at every write
:class:`PrometheusSink`   a ``.prom`` file for node_exporter's textfile collector, every write
==================  ==========================================================================

An output must never stop training: a sink that fails logs a warning and carries on.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

from ..aggregate import Report
from .files import atomic_file, atomic_write, read_json, write_json
from .png import plot
from .prometheus import prometheus, prometheus_text
from .table import print_report, rich_table, table
from .tensorboard import TensorBoard

__all__ = ["Sink", "TableSink", "JsonSink", "PngSink", "TensorBoardSink", "PrometheusSink", "write_all", "flush_all", "close_all",
           "table", "rich_table", "print_report", "write_json", "read_json", "plot", "prometheus",
           "prometheus_text", "TensorBoard", "atomic_file", "atomic_write"]

log = logging.getLogger("distmem")


class Sink:
    """One output of reports. ``write`` is called on rank 0 with each report (and its step);
    ``close`` once at the end with the final report (which carries the timeline)."""

    name = "sink"

    def write(self, report: Report, step: Optional[int]) -> None:
        """Take one report."""

    def flush(self, report: Optional[Report] = None) -> None:
        """Bring the output up to date with ``report`` now (JSON rewritten, picture drawn)."""

    def close(self, report: Optional[Report] = None) -> None:
        """Finish: flush with the final report, then release files and writers."""
        self.flush(report)


class TableSink(Sink):
    name = "table"

    def write(self, report: Report, step: Optional[int]) -> None:
        print_report(report)


class JsonSink(Sink):
    """The report JSON at ``path``; rewritten at a write when ``flush_seconds`` have passed, and at close."""

    name = "json"

    def __init__(self, path: str, flush_seconds: float = 60.0):
        self.path, self.flush_seconds = path, flush_seconds
        self._last = time.monotonic()

    def write(self, report: Report, step: Optional[int]) -> None:
        if time.monotonic() - self._last >= self.flush_seconds:
            self.flush(report)

    def flush(self, report: Optional[Report] = None) -> None:
        if report is None:
            return
        try:
            write_json(report, self.path)
        except OSError as exc:
            log.warning("distmem: report JSON not written to %s: %s", self.path, exc)
        self._last = time.monotonic()


class PngSink(Sink):
    """The PNG at ``path``, drawn from the final report (and its timeline) at close."""

    name = "png"

    def __init__(self, path: str):
        import importlib.util

        if importlib.util.find_spec("matplotlib") is not None:  # without it, flush says so (never stops training)
            from .png import plot_format

            plot_format(path, "plot=")  # a name whose format is unknown is refused now, not after training
        self.path = path

    def flush(self, report: Optional[Report] = None) -> None:
        if report is None:
            return
        try:
            plot(report, self.path)
        except Exception as exc:  # noqa: BLE001 - an output must never stop training
            log.warning("distmem: plot not written to %s: %s", self.path, exc)


class TensorBoardSink(Sink):
    """Scalars under ``log_dir`` at every write (see :class:`TensorBoard`)."""

    name = "tensorboard"

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self._tb: Any = None

    def write(self, report: Report, step: Optional[int]) -> None:
        try:
            if self._tb is None:
                self._tb = TensorBoard(self.log_dir)
            self._tb.write(report, step or 0)
        except Exception as exc:  # noqa: BLE001 - an output must never stop training
            log.warning("distmem: TensorBoard scalars not written to %s: %s", self.log_dir, exc)

    def flush(self, report: Optional[Report] = None) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self, report: Optional[Report] = None) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class PrometheusSink(Sink):
    """``path`` (a ``.prom`` file) rewritten at every write, with ``labels`` on every series."""

    name = "prometheus"

    def __init__(self, path: str, labels: Optional[Dict[str, str]] = None):
        self.path, self.labels = path, labels

    def write(self, report: Report, step: Optional[int]) -> None:
        try:
            prometheus(report, self.path, self.labels, step=step)
        except Exception as exc:  # noqa: BLE001
            log.warning("distmem: Prometheus file %s not written: %s", self.path, exc)


def write_all(sinks: List[Sink], report: Report, step: Optional[int]) -> None:
    for sink in sinks:
        sink.write(report, step)


def flush_all(sinks: List[Sink], report: Optional[Report]) -> None:
    for sink in sinks:
        sink.flush(report)


def close_all(sinks: List[Sink], report: Optional[Report]) -> None:
    for sink in sinks:
        sink.close(report)
