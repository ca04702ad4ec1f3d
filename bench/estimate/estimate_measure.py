"""The one way the estimator's benchmarks measure a training step: the allocator peak of each of
``steps`` steps, the statistic reset before each (TensorFlow's ``get_memory_info(device)['peak']``,
torch's ``max_memory_allocated()``), the first step included. ``estimate_zoo``, ``estimate_accuracy``
and ``estimate_zoo_probe`` measure through it; the estimator's own measured path
(``distmem.estimate.measure``) is the product's, not a benchmark's, and is compared against these."""
from __future__ import annotations

import time
from typing import Any, Callable, Dict

__all__ = ["keras_train_peaks", "torch_train_peaks"]


def keras_train_peaks(model: Any, x: Any, y: Any, steps: int, device: str = "CPU:0") -> Dict[str, Any]:
    """``model.train_on_batch(x, y)`` ``steps`` times: each step's peak, what was in use before it,
    its seconds."""
    import tensorflow as tf
    info = tf.config.experimental.get_memory_info
    peaks, currents, times = [], [], []
    for _ in range(steps):
        tf.config.experimental.reset_memory_stats(device)
        currents.append(int(info(device)["current"]))
        t = time.time()
        model.train_on_batch(x, y)
        times.append(round(time.time() - t, 3))
        peaks.append(int(info(device)["peak"]))
    return {"peaks": peaks, "current_before": currents, "step_seconds": times}


def torch_train_peaks(step: Callable[[], None], steps: int) -> Dict[str, Any]:
    """``step()`` (one forward, backward, update on CUDA) ``steps`` times: each step's
    ``max_memory_allocated``, the largest ``max_memory_reserved``, the seconds, the GPU."""
    import torch
    peaks, reserved, times = [], [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.time()
        step()
        torch.cuda.synchronize()
        times.append(round(time.time() - t, 3))
        peaks.append(int(torch.cuda.max_memory_allocated()))
        reserved.append(int(torch.cuda.max_memory_reserved()))
    return {"peaks": peaks, "max_reserved": max(reserved), "step_seconds": times,
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
