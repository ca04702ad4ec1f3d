"""Periodic reports from every rank for hand-written training loops (PyTorch, custom TF loops).

    import distmem
    distmem.init(strategy="data")
    every = distmem.ReportEvery(100, path="runs/x/timeline.json", plot="runs/x/memory.png",
                                         log_dir="runs/x/tb", prometheus="/var/lib/node_exporter/x.prom")
    for step, batch in enumerate(loader):
        train_step(batch)
        every.step()            # collective every 100th call: every rank must call it at the same steps
    every.close()               # collective: a last point, then rank 0 writes JSON and PNG

Each gather is a :func:`~distmem.report.collect.collect`, the same collective as
:func:`distmem.report`; rank 0 appends a point to the timeline (step, time, and per rank current /
peak / limit / reserved / NVML bytes) and hands the report to its sinks (distmem.report.sinks):
TensorBoard and the Prometheus file at every gather, the JSON now and then (``flush_seconds``) so
a crash loses little, the PNG at the end. The other ranks keep nothing. :class:`distmem.keras.MemoryReport` is this
class driven by Keras' callback hooks.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

from .. import session
from ..errors import ConfigError
from .aggregate import Report
from .collect import DETAILS, collect
from .sinks import (JsonSink, PngSink, PrometheusSink, Sink, TableSink, TensorBoardSink, close_all, flush_all,
                    write_all)

__all__ = ["ReportEvery", "collect", "point"]

log = logging.getLogger("distmem")


def point(report: Report, step: Optional[int]) -> Dict[str, Any]:
    """One timeline point from a report: columns by rank (compact in JSON), or the summary figures."""
    if report.detail == "summary":
        a = report.aggregates
        keep = ("max_peak_bytes", "min_peak_bytes", "mean_peak_bytes", "total_peak_bytes", "total_current_bytes",
                "min_headroom_bytes", "total_nvml_bytes")
        return {"step": step, "time": report.created, "summary": {k: a.get(k) for k in keep if k in a},
                "warnings": len(report.warnings)}
    rs = report.ranks
    return {"step": step, "time": report.created, "ranks": [s.rank for s in rs],
            "current_bytes": [s.current_bytes for s in rs], "peak_bytes": [s.peak_or_current for s in rs],
            "limit_bytes": [s.limit_bytes for s in rs], "reserved_bytes": [s.reserved_bytes for s in rs],
            "nvml_bytes": [s.nvml_total for s in rs], "missing": list(report.missing),
            "warnings": len(report.warnings)}


class ReportEvery:
    """Gather from every rank every ``n`` steps and keep a timeline on rank 0.

    n: steps between gathers (every rank must call :meth:`step` the same number of times: the gather
       is collective).
    path: rank 0 writes the last report plus the timeline here as JSON (``distmem report PATH`` renders it).
    plot: rank 0 draws the PNG here on :meth:`close` (and :meth:`save`).
    log_dir: TensorBoard scalars per rank at every gather.
    prometheus: a ``.prom`` file for node_exporter's textfile collector, rewritten at every gather;
       ``prometheus_labels`` adds labels such as ``{"run": "resnet-7"}``.
    detail: ``"full"`` (a row per rank) or ``"summary"`` (all-reduced; constant size at any scale).
    timeout: seconds a gather may wait for late ranks (default ``DISTMEM_TIMEOUT`` or 60).
    max_points: rank 0 keeps at most this many points; beyond, every other point is dropped (the
       first and the latest always stay), so memory stays bounded on long runs.
    flush_seconds: rank 0 rewrites ``path`` at a gather if this long has passed since the last write.
    print_table: rank 0 prints the table at every gather.
    """

    def __init__(self, n: int = 100, *, path: Optional[str] = None, plot: Optional[str] = None,
                 log_dir: Optional[str] = None, prometheus: Optional[str] = None,
                 prometheus_labels: Optional[Dict[str, str]] = None, detail: str = "full",
                 timeout: Optional[float] = None, max_points: int = 10_000, flush_seconds: float = 60.0,
                 print_table: bool = False):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"ReportEvery(n={n!r}): n is the number of steps between gathers, a whole number >= 1")
        if detail not in DETAILS:
            raise ConfigError(f"detail={detail!r} is not 'full' or 'summary'")
        if max_points < 2:
            raise ConfigError(f"max_points={max_points} must be at least 2 (the first and the latest point)")
        self.n = n
        self.path, self.plot_path, self.log_dir, self.prometheus_path = path, plot, log_dir, prometheus
        self.detail, self.timeout = detail, timeout
        self.max_points = max_points
        self.sinks: List[Sink] = []
        if print_table:
            self.sinks.append(TableSink())
        if log_dir:
            self.sinks.append(TensorBoardSink(log_dir))
        if prometheus:
            self.sinks.append(PrometheusSink(prometheus, prometheus_labels))
        if path:
            self.sinks.append(JsonSink(path, flush_seconds))
        if plot:
            self.sinks.append(PngSink(plot))
        self.points: List[Dict[str, Any]] = []
        self.last: Optional[Report] = None
        self.gathers = 0
        self.seconds = 0.0  # time spent in gathers and outputs, on this rank
        self._step = 0
        self._last_gather_step: Optional[int] = None

    @property
    def current_step(self) -> int:
        return self._step

    @property
    def next_gather_step(self) -> int:
        """The first step number at which :meth:`step` gathers (the next multiple of ``n``): a caller
        that counts steps itself (the Keras callback) needs to call :meth:`step` only from there."""
        return ((self._last_gather_step or 0) // self.n + 1) * self.n

    def step(self, step: Optional[int] = None) -> Optional[Report]:
        """Count one training step (or set the step number); gather when a multiple of ``n`` is reached
        or passed. Returns the Report on rank 0 at a gather, else None."""
        self._step = self._step + 1 if step is None else int(step)
        if self._step // self.n > (self._last_gather_step or 0) // self.n:
            return self.gather(self._step)
        return None

    def gather(self, step: Optional[int] = None) -> Optional[Report]:
        """Collective now, whatever the schedule: every rank must call it."""
        t0 = time.perf_counter()
        step = self._step if step is None else step
        self._last_gather_step = step
        rep = collect(step=step, timeout=self.timeout, detail=self.detail)
        self.gathers += 1
        if rep is not None:
            self.last = rep
            self.points.append(point(rep, step))
            if len(self.points) > self.max_points:
                self.points = self.points[:-1:2] + [self.points[-1]]
            # The process's latest timeline, for a later distmem.report() to carry (rank 0 only has one).
            session.state.extra["timeline"] = self.points
            write_all(self.sinks, self.report() or rep, step)
        self.seconds += time.perf_counter() - t0
        return rep

    def report(self) -> Optional[Report]:
        """The latest report with the timeline attached (rank 0), else None."""
        if self.last is None:
            return None
        return Report(**{**self.last.__dict__, "timeline": list(self.points)})

    def save(self) -> Optional[Report]:
        """Rank 0: bring every output up to date now - JSON, PNG, TensorBoard (not collective)."""
        rep = self.report()
        if rep is None:
            return None
        flush_all(self.sinks, rep)
        return rep

    def close(self, final: bool = True) -> Optional[Report]:
        """Collective when ``final``: a last gather unless one just happened at this step; then rank 0
        saves every output. Returns the final Report with its timeline on rank 0, else None.

        Safe to call again (after more steps it gathers again; otherwise it only saves)."""
        if final and self._last_gather_step != self._step:
            self.gather(self._step)
        rep = self.report()
        close_all(self.sinks, rep)
        return rep

    def __enter__(self) -> "ReportEvery":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        # On an exception the ranks may not all reach this point: no collective then, only save.
        self.close(final=exc_type is None)

    def __repr__(self) -> str:
        return f"<ReportEvery n={self.n} step={self._step} gathers={self.gathers} points={len(self.points)}>"
