"""Per-layer memory estimates of a training step: Keras models (analytic rules replayed over the
layer graph) and torch modules (one step simulated on the meta device). No GPU needed.

>>> est = estimate(model, batch_size=64, optimizer="adam")
>>> est.peak_bytes                        # allocator peak of one training step
>>> est.footprint_bytes("torch")          # what a GPU memory limit must allow
>>> est.layer_costs()                     # List[LayerCost] for the partitioners
"""
from __future__ import annotations

from typing import Any

from .keras import estimate_keras
from .torch import estimate_torch
from .loader import framework_of, load_model, parse_shape
from .precision import Precision, resolve_precision
from .table import Estimate, LayerEstimate

__all__ = ["estimate", "estimate_keras", "estimate_torch", "load_model", "Estimate", "LayerEstimate",
           "Precision", "resolve_precision"]


def estimate(model: Any, batch_size: int = 32, optimizer: Any = "adam", *, input_shape: Any = None,
             **options: Any) -> Estimate:
    """Estimate a Keras model, a ``torch.nn.Module`` or a spec (``"keras:ResNet50"``,
    ``"torchvision:resnet50"``, ``"module.path:factory"``) at ``batch_size``.

    Keyword options go to :func:`estimate_keras` or :func:`estimate_torch` (``precision=``,
    ``device=``, ``example_input=``...)."""
    shape = parse_shape(input_shape)
    model = load_model(model, shape)
    if framework_of(model) == "torch":
        return estimate_torch(model, batch_size=batch_size, optimizer=optimizer, input_shape=shape, **options)
    return estimate_keras(model, batch_size=batch_size, optimizer=optimizer, **options)
