"""A layer the rules do not know (a custom layer, a ``Lambda``) read as the layers and ops it calls.

Its ``call`` is run on fresh symbolic inputs of the node's shapes, so the Keras layers it calls and
(tf.keras 2) the TensorFlow ops it applies become a small functional graph of their own, which the
model is estimated over instead of the whole layer being assumed to keep its inputs and outputs:
a residual block written as a ``Layer`` is its convolutions, normalisations and add. Nothing of the
user's model changes: the nodes and losses the call adds to its layers are taken off again. Where
the call cannot run symbolically (Keras 3 with TensorFlow ops on its inputs, a layer that needs
real values), the caller keeps the fallback rule.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, List, Optional, Tuple

from .access import flatten, model_io, node_inputs

__all__ = ["unrolled", "keras_package", "call_arguments", "left_as_it_was", "MAX_DEPTH"]

#: How deep custom layers inside custom layers are read.
MAX_DEPTH = 4

_STATE = ("_inbound_nodes_value", "_outbound_nodes_value", "_inbound_nodes", "_outbound_nodes", "_losses",
          "_callable_losses", "_metrics", "_eager_losses", "_self_tracked_trackables")


def keras_package(layer):
    """The Keras package ``layer`` belongs to (``keras``, or ``tf_keras`` for the legacy one): the
    first of its classes' modules that is one, a user's own layer class included."""
    import importlib
    for cls in type(layer).__mro__:
        top = str(getattr(cls, "__module__", "")).split(".")[0]
        if top in ("keras", "tf_keras"):
            return importlib.import_module(top)
    import tensorflow as tf
    return tf.keras


def _layers_within(layer) -> List[Any]:
    fl = getattr(layer, "_flatten_layers", None)
    if callable(fl):
        try:
            return list(fl(include_self=True, recursive=True))
        except TypeError:
            pass
    return [layer]


def _snapshot(layers) -> List[Tuple[list, list]]:
    saved = []
    seen = set()
    for lay in layers:
        for attr in _STATE:
            try:
                val = lay.__dict__.get(attr) if hasattr(lay, "__dict__") else None
            except Exception:  # noqa: BLE001 - a layer that guards its attributes
                val = None
            if isinstance(val, list) and id(val) not in seen:
                seen.add(id(val))
                saved.append((val, list(val)))
    return saved


def _restore(saved) -> None:
    for lst, items in saved:
        lst[:] = items


@contextlib.contextmanager
def left_as_it_was(layer):
    """Whatever a symbolic or traced call of ``layer`` adds to it and the layers within it (nodes,
    losses, metrics) is taken off again when the block ends."""
    saved = _snapshot(_layers_within(layer))
    try:
        yield
    finally:
        _restore(saved)


def call_arguments(node):
    """A layer node's call arguments ``(args, kwargs)`` as Keras recorded them (None, None where not)."""
    args = getattr(node, "call_args", None)  # tf.keras 2
    if args is not None:
        return list(args), dict(getattr(node, "call_kwargs", None) or {})
    arguments = getattr(node, "arguments", None)  # Keras 3
    if arguments is not None:
        return list(arguments.args), dict(arguments.kwargs)
    return None, None


def unrolled(layer, node, K) -> Optional[Tuple[Any, list]]:
    """``(functional model of what the layer's call does, its inputs in the order of the node's
    input tensors)``, or None where the call cannot be read so."""
    args, kwargs = call_arguments(node)
    if args is None:
        return None
    outer = node_inputs(node)
    if not outer:
        return None
    fresh = {}

    def swap(x):
        if hasattr(x, "_keras_history") or type(x).__name__ == "KerasTensor":
            if id(x) not in fresh:
                shape = tuple(x.shape)[1:]
                dtype = getattr(getattr(x, "dtype", None), "name", None) or str(getattr(x, "dtype", "float32"))
                fresh[id(x)] = K.Input(shape=shape, dtype=dtype)
            return fresh[id(x)]
        if isinstance(x, (list, tuple)):
            return type(x)(swap(v) for v in x)
        if isinstance(x, dict):
            return {k: swap(v) for k, v in x.items()}
        return x
    try:
        new_args = [swap(a) for a in args]
        new_kwargs = {k: swap(v) for k, v in kwargs.items() if k != "mask" or v is not None}
        try:
            if "training" in inspect.signature(layer.call).parameters:
                new_kwargs["training"] = True
        except (TypeError, ValueError):
            pass
        with left_as_it_was(layer):  # the graph is built while the call's nodes are on its layers
            out = layer.call(*new_args, **new_kwargs)
            inputs = [fresh[id(t)] for t in outer if id(t) in fresh]
            if len(inputs) != len(outer):
                return None
            outs = flatten(out)
            if not outs or not all(hasattr(o, "_keras_history") or type(o).__name__ == "KerasTensor" for o in outs):
                return None
            sub = K.Model(inputs, outs if len(outs) > 1 else outs[0])
        ins, _ = model_io(sub)
        if len(ins) != len(inputs):
            return None
        return sub, ins
    except Exception:  # noqa: BLE001 - a call that cannot run symbolically: the caller keeps the fallback
        return None
