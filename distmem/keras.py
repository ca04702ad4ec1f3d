"""Keras callbacks. ``MemoryReport`` gathers memory from every rank on a schedule during ``fit``.

    model.fit(..., callbacks=[distmem.keras.MemoryReport(every_n_batches=100, path="runs/x/timeline.json",
                                                         plot="runs/x/memory.png", log_dir="runs/x/tb")])

Importing this module does not import TensorFlow; the class is built on first access, on the
callback base class of the Keras that ``tf.keras`` names (Keras 2 in TF <= 2.15, Keras 3 after).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["MemoryReport"]

_built: Dict[str, Any] = {}


def _base() -> Any:
    import tensorflow as tf

    return tf.keras.callbacks.Callback


def _build() -> type:
    from .report.periodic import ReportEvery

    Base = _base()

    class MemoryReport(Base):  # type: ignore[misc, valid-type]
        """Every ``every_n_batches`` training batches, gather every rank's memory (a collective: every
        rank must run the same number of batches) and keep the timeline on rank 0; at the end of
        ``fit``, a last gather, then rank 0 writes ``path`` (JSON: last report + timeline), ``plot``
        (PNG), TensorBoard scalars under ``log_dir`` and the Prometheus file ``prometheus``.

        Other arguments as :class:`distmem.ReportEvery`. ``points`` is the timeline (rank 0),
        ``last`` the latest Report (rank 0).
        """

        # Keras 2: the hook never reads logs, so tensors need not be converted to numpy every batch
        # (that conversion is a device sync that would cost throughput).
        _supports_tf_logs = True
        # Keras 3: an async-safe callback runs in a thread pool whose calls can overlap and reorder;
        # a collective must run in the same order on every rank, so this one stays synchronous.
        async_safe = False

        def __init__(self, every_n_batches: int = 100, log_dir: Optional[str] = None, path: Optional[str] = None,
                     plot: Optional[str] = None, prometheus: Optional[str] = None, *, detail: str = "full",
                     timeout: Optional[float] = None, final: bool = True, **options: Any):
            super().__init__()
            self.every = ReportEvery(every_n_batches, path=path, plot=plot, log_dir=log_dir, prometheus=prometheus,
                                     detail=detail, timeout=timeout, **options)
            self.final = final
            self._epoch_base = self._seen = 0
            self._epoch_end: Optional[int] = None
            self._due = every_n_batches

        @property
        def points(self):
            return self.every.points

        @property
        def last(self):
            return self.every.last

        def report(self):
            """The latest report with its timeline (rank 0), else None."""
            return self.every.report()

        def on_train_begin(self, logs: Any = None) -> None:
            from . import session
            from .errors import DistmemError

            if session.current_plan() is None:
                raise DistmemError("distmem.keras.MemoryReport needs a plan: call distmem.init() at the top of the "
                                   "script, before TensorFlow touches a GPU")
            self._epoch_base = self._seen = self.every.current_step
            self._arm()

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._epoch_base = self._seen
            self._arm()

        def _arm(self) -> None:
            # The step at which on_train_batch_end must leave its fast path: the next gather, or a
            # batch index past the epoch's end (Keras 3 reports the last execution of an epoch as if
            # it were whole, index 5 of a 5-step epoch), whichever comes first.
            per_epoch = (getattr(self, "params", None) or {}).get("steps")
            self._epoch_end = self._epoch_base + per_epoch if per_epoch else None
            due = self.every.next_gather_step
            self._due = min(due, self._epoch_end + 1) if self._epoch_end is not None else due

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            # Runs after every batch and Keras times it: between two reports it is one addition and
            # one comparison. ``batch`` restarts each epoch and, with steps_per_execution > 1,
            # advances by more than one per call: the global step is the epoch's base plus the index.
            seen = self._epoch_base + batch + 1
            self._seen = seen
            if seen >= self._due:
                self._reached(seen)

        def _reached(self, seen: int) -> None:
            if self._epoch_end is not None and seen > self._epoch_end:
                seen = self._seen = self._epoch_end
            self.every.step(seen)  # gathers when a multiple of every_n_batches was reached or passed
            self._arm()

        def on_train_end(self, logs: Any = None) -> None:
            self.every.step(self._seen)  # the counter the fast path kept: no gather is due here
            self.every.close(final=self.final)

    MemoryReport.__module__ = __name__
    MemoryReport.__qualname__ = "MemoryReport"
    return MemoryReport


def __getattr__(name: str) -> Any:
    if name == "MemoryReport":
        if "MemoryReport" not in _built:
            _built["MemoryReport"] = _build()
        return _built["MemoryReport"]
    raise AttributeError(f"module 'distmem.keras' has no attribute {name!r}")
