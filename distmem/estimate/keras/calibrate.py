"""Measure one small-batch Keras training step on CPU, for calibrating the analytic estimate.

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

from typing import Any, Dict, List

from ...errors import ConfigError

__all__ = ["CALIBRATION_STEPS", "calibration_batch", "measure_keras_step"]

#: Steps measured per calibration: one that creates the optimizer's slots, then three whose
#: median peak is used.
CALIBRATION_STEPS = 4


def calibration_batch(batch_size: int) -> int:
    """The small batch a calibration step runs at: a quarter of the target (2 to 8), so it costs
    a fraction of a full step while still pushing the largest activations over TensorFlow's
    256 KiB accounting threshold as the full batch does."""
    return max(1, min(8, max(2, batch_size // 4), batch_size))


def _random_inputs(model, batch: int):
    import numpy as np
    rng = np.random.default_rng(0)
    xs = []
    for t in model.inputs:
        shape = [batch] + [int(d) for d in tuple(t.shape)[1:]]
        dtype = getattr(t.dtype, "name", None) or str(t.dtype)
        if "int" in dtype:
            xs.append(rng.integers(0, 2, shape).astype(dtype))
        else:
            xs.append(rng.random(shape, dtype=np.float32).astype(dtype))
    return xs[0] if len(xs) == 1 else xs


def measure_keras_step(model: Any, batch: int, optimizer: Any = "adam", *, steps: int = CALIBRATION_STEPS,
                       loss: Any = None) -> Dict[str, Any]:
    """Peak bytes TensorFlow's CPU allocator reports for a training step of a copy of ``model``
    (same architecture, fresh weights; the model itself is not touched) at ``batch``: the median
    of ``steps - 1`` steps after a first one (all are listed under ``"steps"``), less what the
    process held before the copy was made.

    Resets the CPU:0 peak statistic of this process (``reset_memory_stats``)."""
    import gc

    import tensorflow as tf
    K = tf.keras
    info = tf.config.experimental.get_memory_info
    gc.collect()
    # whatever this process already holds (the model itself, earlier copies) is not the step's
    before = int(info("CPU:0")["current"])
    try:
        twin = K.models.clone_model(model)
    except Exception as exc:
        raise ConfigError(f"cannot copy model {getattr(model, 'name', '?')} to measure a calibration step "
                          f"({type(exc).__name__}: {exc}); estimate without calibration") from None
    if isinstance(optimizer, str) or optimizer is None:
        opt = K.optimizers.get(optimizer or "adam")
    else:
        opt = type(optimizer).from_config(optimizer.get_config())
    outs = twin.outputs
    if loss is None:
        act = getattr(twin.layers[-1], "activation", None)
        probs = getattr(act, "__name__", "") == "softmax"
        loss = K.losses.SparseCategoricalCrossentropy(from_logits=not probs)
    twin.compile(optimizer=opt, loss=loss)
    x = _random_inputs(twin, batch)
    classes = int(tuple(outs[0].shape)[-1] or 1)
    import numpy as np
    y = np.random.default_rng(1).integers(0, max(classes, 1), (batch,))
    x = [tf.constant(a) for a in x] if isinstance(x, list) else tf.constant(x)
    y = tf.constant(y)
    peaks: List[int] = []
    for _ in range(max(1, steps)):
        tf.config.experimental.reset_memory_stats("CPU:0")
        twin.train_on_batch(x, y)
        peaks.append(max(0, int(info("CPU:0")["peak"]) - before))
    del twin, x, y
    gc.collect()
    steady = sorted(peaks[1:]) or peaks
    return {"batch": batch, "peak": steady[len(steady) // 2], "steps": peaks}
