"""The measured path: real training steps at small batches on the device the job will use, carried
to the target batch by the model (``extrapolate``); ``keras_steps`` and ``torch_steps`` run the
steps, ``child`` rebuilds a spec in a child process, ``cache`` keeps measurements by what
determines them, ``measured`` puts it together. Entry point: ``distmem.estimate.estimate(...,
method="auto" | "measure" | "model")``."""
from __future__ import annotations

from .extrapolate import RULE, measure_batches
from .measured import METHODS, measured_estimate, with_measurement

__all__ = ["METHODS", "RULE", "measure_batches", "measured_estimate", "with_measurement"]
