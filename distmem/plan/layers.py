"""Per-layer costs for the planners from a model: the one adapter between the estimator and
``layers=`` (pipeline, model and auto strategies)."""
from __future__ import annotations

import importlib
from typing import Any, Dict, List, Optional, Sequence

from ..costs import LayerCost
from ..errors import ConfigError
from .partition import layers_from_dicts

__all__ = ["layers_from_model"]


def layers_from_model(model: Any, *, batch_size: Optional[int] = None, optimizer: Optional[str] = None,
                      input_shape: Optional[Sequence[int]] = None, **estimate_options: Any) -> List[LayerCost]:
    """Per-layer costs of ``model`` through ``distmem.estimate`` (a Keras model, or a spec such as
    ``"keras:ResNet50"``); a thin adapter so planners keep taking ``List[LayerCost]``."""
    if isinstance(model, (list, tuple)):
        return layers_from_dicts(model)
    if isinstance(model, str):
        from ..estimate import isolated

        if isolated.needs_child(model):
            # Building a Keras model here would start TensorFlow's GPUs before init() applies the plan.
            return isolated.call("distmem.plan.layers:layers_from_model",
                                 dict(model=model, batch_size=batch_size, optimizer=optimizer, input_shape=input_shape,
                                      **estimate_options))
    try:
        # import_module consults sys.modules first, unlike `from .. import estimate`, which would
        # return the package attribute even where the module has been replaced or removed.
        est = importlib.import_module("distmem.estimate")
    except ImportError as exc:
        raise ConfigError(f"model= needs distmem's per-layer estimator (distmem.estimate), which did not import "
                          f"({exc}); pass layers=[LayerCost(...), ...] or stages=['9GiB', ...] instead") from None
    if isinstance(model, str):
        try:
            from ..estimate.loader import load_model
        except ImportError as exc:
            raise ConfigError(f"model={model!r}: cannot load model specs ({exc}); build the model and pass it") from None
        model = load_model(model, input_shape)
    is_torch = type(model).__module__.startswith("torch") or hasattr(model, "named_modules")
    fn = getattr(est, "estimate_torch" if is_torch else "estimate_keras", None) or getattr(est, "estimate", None)
    if fn is None:
        raise ConfigError(f"distmem.estimate has no estimator for {type(model).__name__}; pass layers= instead")
    kwargs: Dict[str, Any] = dict(estimate_options)
    if batch_size is not None:
        kwargs["batch_size"] = batch_size
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
    result = fn(model, **kwargs)
    for attr in ("layer_costs", "to_layer_costs", "costs"):
        got = getattr(result, attr, None)
        if got is not None:
            result = got() if callable(got) else got
            break
    else:
        result = getattr(result, "layers", result)
    layers = layers_from_dicts(list(result))
    if not layers:
        raise ConfigError(f"the estimator found no layers in {type(model).__name__}; pass layers= instead")
    return layers
