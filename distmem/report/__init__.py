"""Stage: report. Takes every rank's :class:`~distmem.observe.snapshot.Snapshot` - gathered to
rank 0 (:mod:`.collect`, the one gather path) or all-reduced (:mod:`.summary`) - and returns the
job's :class:`Report`: aggregates, and warnings from the rules in :mod:`.findings`, written once
and used by both paths. :mod:`.periodic` repeats it on a schedule (:class:`ReportEvery`),
:mod:`distmem.keras` drives that from Keras callbacks, and :mod:`.sinks` writes reports out (table, JSON,
PNG, TensorBoard, Prometheus).

Import from this package with ``from distmem.report.sinks import ...``: ``distmem.report`` the
attribute is the public ``report()`` function.
"""
from __future__ import annotations

from .aggregate import Report, aggregate

__all__ = ["Report", "aggregate"]
