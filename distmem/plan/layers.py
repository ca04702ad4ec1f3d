"""Per-layer costs for the planners from a model: the one adapter between the estimator and
``layers=`` (pipeline, model and auto strategies)."""
from __future__ import annotations

import importlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..costs import LayerCost
from ..errors import ConfigError
from .partition import layers_from_dicts

__all__ = ["layers_from_model", "estimate_layers"]


def layers_from_model(model: Any, *, batch_size: Optional[int] = None, optimizer: Optional[str] = None,
                      input_shape: Optional[Sequence[int]] = None, method: str = "auto",
                      measurement: Optional[Dict[str, Any]] = None, **estimate_options: Any) -> List[LayerCost]:
    """Per-layer costs of ``model`` through ``distmem.estimate`` (a torch module, a Keras model, or a
    spec such as ``"keras:ResNet50"``); a thin adapter so planners keep taking ``List[LayerCost]``.
    ``method``/``measurement``: as :func:`distmem.estimate.estimate` takes them."""
    return estimate_layers(model, batch_size=batch_size, optimizer=optimizer, input_shape=input_shape, method=method,
                           measurement=measurement, **estimate_options)[0]


def estimate_layers(model: Any, *, batch_size: Optional[int] = None, optimizer: Optional[str] = None,
                    input_shape: Optional[Sequence[int]] = None, method: str = "auto",
                    measurement: Optional[Dict[str, Any]] = None,
                    **estimate_options: Any) -> Tuple[List[LayerCost], Optional[Dict[str, Any]]]:
    """:func:`layers_from_model` and the measurement behind it (``Estimate.measurement``: what
    another rank passes back as ``measurement=`` to plan the same bytes; None for the model alone)."""
    if isinstance(model, (list, tuple)):
        return layers_from_dicts(model), None
    if isinstance(model, str):
        from ..estimate import isolated

        if isolated.needs_child(model):
            # Building a Keras model here would start TensorFlow's GPUs before init() applies the plan.
            return isolated.call("distmem.plan.layers:estimate_layers",
                                 dict(model=model, batch_size=batch_size, optimizer=optimizer, input_shape=input_shape,
                                      method=method, measurement=measurement, **estimate_options),
                                 # a measurement runs on the GPUs this process would use (its child inherits
                                 # this one's devices); the model alone needs none
                                 hide_gpus=method == "model")
    try:
        # import_module consults sys.modules first, unlike `from .. import estimate`, which would
        # return the package attribute even where the module has been replaced or removed.
        est = importlib.import_module("distmem.estimate")
    except ImportError as exc:
        raise ConfigError(f"model= needs distmem's per-layer estimator (distmem.estimate), which did not import "
                          f"({exc}); pass layers=[LayerCost(...), ...] or stages=['9GiB', ...] instead") from None
    kwargs: Dict[str, Any] = dict(estimate_options, input_shape=input_shape, method=method, measurement=measurement)
    if batch_size is not None:
        kwargs["batch_size"] = batch_size
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
    result = est.estimate(model, **kwargs)
    layers = layers_from_dicts(list(result.layer_costs()))
    if not layers:
        raise ConfigError(f"the estimator found no layers in {model if isinstance(model, str) else type(model).__name__}; "
                          "pass layers= instead")
    return layers, getattr(result, "measurement", None)
