"""Build a Keras model under a model-parallel placement: each layer's variables (and its forward
computation) land on the device the plan gave its layer group.

    plan = distmem.init(strategy="model", layers=costs, gpus_per_rank=2)
    with distmem.apply.placement.placement_scope(plan) as placed:
        model = build_model()            # any Keras style; layers are matched by name
    distmem.apply.placement.check_placement(model, plan)

Inside the scope every call of a layer named in the placement runs under ``tf.device(...)``: the
call that builds the layer creates its variables there, and the layer's ``call`` is wrapped so
later forward passes (``fit``, ``predict``) run there too; TensorFlow places each gradient beside
its forward op. Layers are matched by ``layer.name``: build the model with the same names the
estimate saw (name layers explicitly, or ``tf.keras.backend.clear_session()`` before both builds so
Keras' automatic names repeat). The device strings are TensorFlow's (``"/GPU:k"`` is the rank's
``k``-th visible GPU once distmem has pinned it; ``"/CPU:k"`` a logical CPU device).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, Iterator, List, Mapping, Tuple, Union

from ..errors import ConfigError, TooLateError

__all__ = ["placement_of", "placement_scope", "build_placed", "variable_devices", "verify_placement",
           "check_placement", "logical_cpu_devices", "same_device"]

PlacementLike = Union[Mapping[str, str], Any]  # a {layer name: device} map or a Plan of strategy "model"


def placement_of(source: PlacementLike) -> Dict[str, str]:
    """The layer name -> device map of a model-parallel Plan (``extras["model"]["placement"]``) or a map."""
    if isinstance(source, Mapping):
        return {str(k): str(v) for k, v in source.items()}
    extras = getattr(source, "extras", None)
    if isinstance(extras, dict) and "model" in extras and "placement" in extras["model"]:
        return dict(extras["model"]["placement"])
    raise ConfigError(f"no placement in {type(source).__name__}: pass a Plan from strategy='model' or a dict "
                      "{layer name: '/GPU:0', ...}")


def _tf() -> Any:
    try:
        import tensorflow as tf
    except ImportError as exc:
        raise ConfigError(f"placement needs TensorFlow ({exc}); pip install tensorflow") from None
    return tf


def same_device(actual: str, expected: str) -> bool:
    """True when TensorFlow device string ``actual`` (``/job:.../device:CPU:1``) is ``expected`` (``/CPU:1``)."""
    tf = _tf()
    a, e = tf.DeviceSpec.from_string(actual or ""), tf.DeviceSpec.from_string(expected)
    return (a.device_type or "").upper() == (e.device_type or "").upper() and (a.device_index or 0) == (
        e.device_index or 0)


def _pin_call(layer: Any, device: str, tf: Any) -> None:
    """Wrap this layer instance's ``call`` so every later forward pass runs on ``device``."""
    if getattr(layer, "_distmem_device", None) == device:
        return
    inner = layer.call

    @functools.wraps(inner)
    def call(*args: Any, **kwargs: Any) -> Any:
        with tf.device(device):
            return inner(*args, **kwargs)

    # object.__setattr__: Keras' attribute tracking has no business with a bound wrapper.
    object.__setattr__(layer, "call", call)
    object.__setattr__(layer, "_distmem_device", device)


@contextlib.contextmanager
def placement_scope(placement: PlacementLike, *, strict: bool = True) -> Iterator[Dict[str, Any]]:
    """Inside, layers named in ``placement`` build and run on their device. Yields ``{name: layer}``
    of the layers it placed. ``strict``: on exit, raise ConfigError if a named layer was never
    built inside the scope (a name mismatch, or a model without an input shape)."""
    tf = _tf()
    mapping = placement_of(placement)
    layer_cls = tf.keras.layers.Layer
    original = layer_cls.__call__
    placed: Dict[str, Any] = {}

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = mapping.get(getattr(self, "name", None))
        if device is None:
            return original(self, *args, **kwargs)
        placed[self.name] = self
        _pin_call(self, device, tf)
        with tf.device(device):
            return original(self, *args, **kwargs)

    layer_cls.__call__ = __call__
    try:
        yield placed
    finally:
        layer_cls.__call__ = original
    if strict:
        missing = [name for name in mapping if name not in placed]
        if missing:
            raise ConfigError(
                f"{len(missing)} of {len(mapping)} planned layer(s) were not built inside the placement scope "
                f"(first: {missing[:5]}); build the model with the same layer names as the estimate (name layers "
                "explicitly or call tf.keras.backend.clear_session() before building), and give it an input shape "
                "so its layers are built inside the scope")


def build_placed(build_fn: Any, placement: PlacementLike, *args: Any, **kwargs: Any) -> Any:
    """``build_fn(*args, **kwargs)`` under :func:`placement_scope`, then :func:`check_placement`."""
    with placement_scope(placement):
        model = build_fn(*args, **kwargs)
    check_placement(model, placement)
    return model


def variable_devices(model: Any) -> List[Tuple[str, str, str]]:
    """(layer name, variable name, device string) of every variable of ``model``'s layers."""
    out = []
    for layer in getattr(model, "layers", []):
        for v in layer.weights:
            # Keras 3 variables carry the device on their backing tf.Variable (.value).
            device = getattr(v, "device", None) or getattr(getattr(v, "value", None), "device", "")
            out.append((layer.name, v.name, device))
    return out


def verify_placement(model: Any, placement: PlacementLike) -> List[str]:
    """Descriptions of the variables not on their layer's planned device (empty when all are)."""
    mapping = placement_of(placement)
    bad = []
    for layer_name, var_name, device in variable_devices(model):
        want = mapping.get(layer_name)
        if want is not None and not same_device(device, want):
            bad.append(f"{var_name} of layer {layer_name} is on {device or '(unplaced)'}, planned {want}")
    return bad


def check_placement(model: Any, placement: PlacementLike) -> None:
    """Raise ConfigError listing every variable off its planned device."""
    bad = verify_placement(model, placement)
    if bad:
        raise ConfigError(f"{len(bad)} variable(s) are not on their planned device: " + "; ".join(bad[:8])
                          + "; build the model inside distmem.apply.placement.placement_scope(plan)")


def logical_cpu_devices(count: int) -> List[str]:
    """Split the CPU into ``count`` logical devices (``/CPU:0`` .. ``/CPU:count-1``) so the
    model-parallel flow runs without GPUs. Must run before TensorFlow's runtime starts; calling it
    again with the same count is fine. ``distmem.init(strategy="model")`` does it for you on CPU."""
    if count < 1:
        raise ConfigError(f"logical_cpu_devices({count}): need at least one device")
    tf = _tf()
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError:
        live = tf.config.list_logical_devices("CPU")
        if len(live) != count:
            raise TooLateError(f"TensorFlow already started with {len(live)} logical CPU device(s); {count} are "
                               "needed: call distmem.init(strategy='model') or logical_cpu_devices() before any "
                               "TensorFlow op or model build") from None
    return [d.name for d in tf.config.list_logical_devices("CPU")]
