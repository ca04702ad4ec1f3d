"""What the measuring child process runs for a model spec: rebuild the model there, on the device
the job will use, and measure its steps (``distmem.estimate.isolated.call`` starts it)."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence

__all__ = ["measure_spec"]


def measure_spec(model: str, framework: str, plan: Dict[str, Any], optimizer: Any, options: Dict[str, Any],
                 input_shape: Optional[Sequence[int]]) -> Dict[str, Any]:
    """Build ``model`` (a spec) here and return its measured peaks as ``plan`` says (``keras_steps`` /
    ``torch_steps``). ``optimizer`` and ``options`` come as ``measured.portable`` made them (an
    optimizer object as its class and configuration) and are rebuilt here. Keras on CPU counts every
    buffer, as distmem's TensorFlow adapter sets it up (``TF_CPU_ALLOCATOR_USE_BFC``); torch is built
    on the GPU with random weights."""
    if framework != "torch":  # before anything imports TensorFlow: it reads them when it loads
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from ..loader import load_model
    from .measured import MEASURE_STEPS, measure_keras
    from .portable import rebuild
    optimizer = rebuild(optimizer)
    options = rebuild(options)
    if framework == "torch":
        import torch
        from ...errors import ConfigError
        from ..torch.inputs import example_inputs
        from .torch_steps import torch_step_peaks
        if not torch.cuda.is_available():
            raise ConfigError("no CUDA device is visible to the measuring child, and torch's CPU allocator keeps "
                              "no statistics")
        built = load_model(model, input_shape, device="cuda")
        return torch_step_peaks(built, plan["batches"],
                                inputs=lambda b: example_inputs(built, None, input_shape, b, options.get("input_dtype")),
                                optimizer=optimizer, precision=options.get("precision"),
                                loss=options.get("loss", "auto"), steps=MEASURE_STEPS)
    precision = options.get("precision")
    if precision:
        import tensorflow as tf
        from ..precision import resolve_precision
        tf.keras.mixed_precision.set_global_policy(resolve_precision(precision).name)
    built = load_model(model, input_shape)
    return measure_keras(built, plan, optimizer, options, input_shape)
