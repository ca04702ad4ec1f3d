"""The measured path: real training steps on the device the job will use — Keras at the target batch
where it fits the memory at hand (``memory``), a ladder of batches chosen by ``extrapolate`` —
carried to other batches (``carry``); ``keras_steps`` and ``torch_steps`` run the steps, ``child``
rebuilds a spec in a child process (its arguments made ``portable``), ``cache`` keeps measurements
by what determines them, ``measured`` puts it together. Entry point:
``distmem.estimate.estimate(..., method="auto" | "measure" | "model")``."""
from __future__ import annotations

from .carry import with_measurement
from .extrapolate import RULE, measure_batches
from .measured import METHODS, measured_estimate

__all__ = ["METHODS", "RULE", "measure_batches", "measured_estimate", "with_measurement"]
