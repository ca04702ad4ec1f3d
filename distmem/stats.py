"""Old import path of Snapshot, Report, aggregate, kept for one release: import ``distmem.report.aggregate`` and
``distmem.observe.snapshot`` instead."""
from .observe.snapshot import *  # noqa: F401,F403
from .observe.snapshot import __all__ as _snapshot_all
from .report.aggregate import *  # noqa: F401,F403
from .report.aggregate import __all__ as _aggregate_all

__all__ = sorted(set(_snapshot_all) | set(_aggregate_all))
