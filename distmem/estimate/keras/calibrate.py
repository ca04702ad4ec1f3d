"""Measure one small-batch Keras training step (on the device TensorFlow uses here), for calibrating
the analytic estimate.

The hybrid method: the analytic table (``keras.estimate``) is exact about what each layer keeps, but
a few effects sit outside any layer's rule — TensorFlow's executor running loop iterations and
updates in parallel, per-timestep weight-gradient partials of a recurrent layer, a sparse
embedding update's temporaries. A real step at a small batch shows them: the part of the measured
peak the analytic replay (modelling the same CPU allocator) does not explain is added to the
estimate at the full batch. Only a positive residual is added, so calibration can raise an
estimate but never lower it. The residual is taken from the median of the steps after the
first: the first also creates the optimizer's slots (a one-off), and single steps spike when the
executor happens to overlap large temporaries, which a larger batch does not repeat reliably.
"""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["CALIBRATION_STEPS", "calibration_batch", "measure_keras_step"]

#: Steps measured per calibration: one that creates the optimizer's slots, then three whose
#: median peak is used.
CALIBRATION_STEPS = 4


def calibration_batch(batch_size: int) -> int:
    """The small batch a calibration step runs at: a quarter of the target (2 to 8), so it costs
    a fraction of a full step while still pushing the largest activations over TensorFlow's
    256 KiB accounting threshold as the full batch does."""
    return max(1, min(8, max(2, batch_size // 4), batch_size))


def measure_keras_step(model: Any, batch: int, optimizer: Any = "adam", *,
                       steps: int = CALIBRATION_STEPS) -> Dict[str, Any]:
    """Peak bytes TensorFlow's CPU allocator reports for training steps of ``model`` itself at
    ``batch`` (the measured path's step: its compiled loss, or a loss that fits any output; no
    copy, so a ``Lambda`` or a custom layer runs as in training; the weights are put back): the
    median of ``steps - 1`` steps after a first one (all are listed under ``"steps"``), less what
    the process held before beyond the model's weights."""
    from ..measure.keras_steps import keras_step_peaks
    got = keras_step_peaks(model, [int(batch)], optimizer, steps=max(1, steps))
    peaks = list(got["steps"][int(batch)])
    steady = sorted(peaks[1:]) or peaks
    return {"batch": int(batch), "peak": steady[len(steady) // 2], "steps": peaks, "loss": got["loss"],
            "floor": got["floor"], "device": got["device"]}
