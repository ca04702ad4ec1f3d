"""TensorBoard scalars per rank and for the job."""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Dict, Optional

from ...units import MiB
from ..aggregate import Report

__all__ = ["TensorBoard"]

log = logging.getLogger("distmem")


class TensorBoard:
    """Scalars per rank under ``log_dir/rank_<r>`` (TensorBoard overlays the ranks in one chart per
    tag) and job scalars under ``log_dir/job``. Tags: ``memory/{current,peak,limit,reserved,nvml}_mib``
    (MiB, so the axis reads without conversion).

    Backend: ``tf.summary`` when TensorFlow is already imported in this process; else
    ``torch.utils.tensorboard`` when torch and tensorboard are; else nothing, with one note in the log
    (importing TensorFlow into a PyTorch job only for this would start its GPU runtime there).
    Beyond ``max_ranks`` ranks only the job scalars are written.
    """

    def __init__(self, log_dir: str, max_ranks: int = 64):
        self.log_dir = log_dir
        self.max_ranks = max_ranks
        self.backend = self._pick()
        self._writers: Dict[str, Any] = {}
        if self.backend == "none":
            self.note = ("TensorBoard scalars skipped: the tensorboard package is not installed, or neither "
                         "TensorFlow nor torch is loaded in this process (pip install tensorboard)")
            log.warning("distmem: %s", self.note)
        else:
            self.note = ""

    @staticmethod
    def _pick() -> str:
        import importlib.util

        if "tensorflow" in sys.modules and importlib.util.find_spec("tensorboard") is not None:
            return "tf"  # tf.summary writes through the tensorboard package (not a dependency of TF >= 2.16)
        if "torch" in sys.modules:
            try:
                import torch.utils.tensorboard  # noqa: F401

                return "torch"
            except ImportError:
                return "none"
        return "none"

    def _writer(self, name: str) -> Any:
        if name not in self._writers:
            path = os.path.join(self.log_dir, name)
            if self.backend == "tf":
                import tensorflow as tf

                self._writers[name] = tf.summary.create_file_writer(path)
            else:
                from torch.utils.tensorboard import SummaryWriter

                self._writers[name] = SummaryWriter(path)
        return self._writers[name]

    def _scalars(self, name: str, values: Dict[str, Optional[float]], step: int) -> None:
        values = {k: v for k, v in values.items() if v is not None}
        if not values:
            return
        w = self._writer(name)
        if self.backend == "tf":
            import tensorflow as tf

            with w.as_default(step=step):
                for tag, v in values.items():
                    tf.summary.scalar(tag, float(v))
        else:
            for tag, v in values.items():
                w.add_scalar(tag, float(v), step)

    def write(self, report: Report, step: int) -> None:
        """Add one point per rank (and the job figures) at ``step``."""
        if self.backend == "none":
            return
        mib = lambda v: None if v is None else v / MiB  # noqa: E731
        if len(report.ranks) <= self.max_ranks:
            for s in report.ranks:
                self._scalars(f"rank_{s.rank}", {
                    "memory/current_mib": mib(s.current_bytes), "memory/peak_mib": mib(s.peak_or_current),
                    "memory/limit_mib": mib(s.limit_bytes), "memory/reserved_mib": mib(s.reserved_bytes),
                    "memory/nvml_mib": mib(s.nvml_total)}, step)
        a = report.aggregates
        self._scalars("job", {"memory/max_peak_mib": mib(a.get("max_peak_bytes")),
                              "memory/mean_peak_mib": mib(a.get("mean_peak_bytes")),
                              "memory/min_peak_mib": mib(a.get("min_peak_bytes")),
                              "memory/min_headroom_mib": mib(a.get("min_headroom_bytes")),
                              "ranks/missing": a.get("ranks_missing"),
                              "ranks/warnings": float(len(report.warnings))}, step)

    def flush(self) -> None:
        for w in self._writers.values():
            w.flush()

    def close(self) -> None:
        for w in self._writers.values():
            w.close() if self.backend == "torch" else w.flush()
        self._writers.clear()


