"""Keras 2 (tf.keras 2.x) and Keras 3 read the same way: a layer graph's nodes, their input and
output tensors, shapes, dtypes and weights. Every other Keras module reads models through these."""
from __future__ import annotations

import math
from typing import Optional, Tuple

__all__ = ["layer_of", "node_inputs", "flatten", "node_outputs", "tensor_key", "tensor_shape", "dtype_name",
           "graph_nodes", "model_io", "is_graph_model", "all_weights", "trainable_weights", "numel",
           "activation_name"]


def layer_of(node):
    return getattr(node, "operation", None) or getattr(node, "layer")


def node_inputs(node) -> list:
    ins = getattr(node, "keras_inputs", None)  # Keras 2: a flat list
    if ins is None:
        ins = getattr(node, "input_tensors", None) or []  # Keras 3
    return flatten(ins)


def flatten(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in flatten(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in flatten(item)]
    return [x]


def node_outputs(node) -> list:
    outs = getattr(node, "output_tensors", None)
    if outs is None:
        outs = node.outputs
    return flatten(outs)


def tensor_key(t) -> Tuple[str, int, int]:
    h = t._keras_history
    return (h[0].name, int(h[1]), int(h[2]))


def tensor_shape(t) -> Tuple[Optional[int], ...]:
    shp = t.shape
    dims = getattr(shp, "dims", None)
    if dims is not None and not isinstance(shp, tuple):
        return tuple(getattr(d, "value", d) for d in shp)
    return tuple(shp)


def dtype_name(t) -> str:
    d = getattr(t, "dtype", "float32")
    return getattr(d, "name", None) or str(d)


def graph_nodes(model) -> Optional[list]:
    inner = getattr(model, "_functional", None)  # a built Keras 3 Sequential
    if inner is not None:
        model = inner
    by_depth = getattr(model, "_nodes_by_depth", None)
    if not by_depth:
        return None
    out = []
    for depth in sorted(by_depth, reverse=True):
        out.extend(by_depth[depth])
    return out


def model_io(model):
    inner = getattr(model, "_functional", None)
    m = inner if inner is not None else model
    return flatten(m.inputs), flatten(m.outputs)


def is_graph_model(layer) -> bool:
    return graph_nodes(layer) is not None and hasattr(layer, "inputs") and getattr(layer, "inputs", None)


def all_weights(layer):
    return list(getattr(layer, "weights", []) or [])


def trainable_weights(layer):
    return list(getattr(layer, "trainable_weights", []) or [])


def numel(shape) -> int:
    return int(math.prod(int(d) for d in shape)) if len(shape) else 1


def activation_name(fn) -> str:
    if fn is None:
        return "linear"
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return str(name).lower()
