"""The one gather path: every report (``distmem.report()``, periodic reports, the Keras callback)
is a :func:`collect` - each rank's :func:`~distmem.observe.snapshot.take`, gathered to rank 0
(``"full"``) or all-reduced (``"summary"``) - and rank 0 builds the job's Report."""
from __future__ import annotations

import time
from typing import Optional

from ..comm import get_comm, resolve_timeout
from ..errors import ConfigError
from ..observe.snapshot import Snapshot, take, take_row
from .aggregate import Report, aggregate
from .summary import summary_report

__all__ = ["collect", "DETAILS", "job_id"]

DETAILS = ("full", "summary")


def collect(step: Optional[int] = None, timeout: Optional[float] = None, detail: str = "full",
            snapshot: Optional[Snapshot] = None) -> Optional[Report]:
    """Collective: gather (``"full"``) or all-reduce (``"summary"``) every rank's snapshot - ``snapshot``
    when given (one taken earlier: both details see the same figures), else one taken now; rank 0
    gets the Report, the others None. Prints and writes nothing."""
    if detail not in DETAILS:
        raise ConfigError(f"detail={detail!r} is not 'full' or 'summary'")
    timeout = resolve_timeout(timeout)
    c = get_comm()
    if detail == "summary":
        rep = summary_report(snapshot if snapshot is not None else take(step), c, timeout)
        if rep is not None:
            rep.aggregates["job_id"] = job_id()
        return rep
    t0 = time.monotonic()
    if c.rank != 0:  # the row alone: no Snapshot to build and convert on the sending ranks
        c.gather(snapshot.to_dict() if snapshot is not None else take_row(step), 0, timeout)
        return None
    snap = snapshot if snapshot is not None else take(step)
    rows, missing = c.gather(snap.to_dict(), 0, timeout)
    if rows is None:
        return None
    # Rank 0's own row is the snapshot it already holds; the others arrive as plain data.
    snaps = [snap if i == c.rank else Snapshot.from_dict(r) for i, r in enumerate(rows) if r is not None]
    rep = aggregate(snaps, c.size, missing, strategy=snap.strategy)
    rep.aggregates["gather_seconds"] = time.monotonic() - t0
    rep.aggregates["transport"] = c.name
    rep.aggregates["job_id"] = job_id()
    return rep


def job_id() -> str:
    """This job's id in its reports (``aggregates["job_id"]``): the launch's key, which every rank of
    one launch shares and no other launch alive has (:func:`distmem.discover.identity.job_key`); a
    single process: its host and pid. ``distmem top`` merges rows by it and rank."""
    import hashlib
    import os
    import socket

    from ..discover.identity import job_key

    return job_key() or hashlib.sha256(f"{socket.gethostname()}:{os.getpid()}".encode()).hexdigest()[:16]
