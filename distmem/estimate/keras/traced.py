"""What a layer without a rule keeps, read from TensorFlow's own gradient of its call.

The layer's forward and backward (``GradientTape`` over its call, with respect to its inputs and
weights) are traced into a graph at batch 1 and 2 — traced, never run — and the forward tensors
that an op of the gradient consumes are what TensorFlow keeps for the backward pass: the same
question the per-type rules answer by hand, asked of TensorFlow itself. Inputs among them are kept
inputs, the call's outputs kept outputs, the others kept buffers of their own; the largest forward
tensor not kept is the call's temporary, the largest set of gradient tensors one op reads (an AddN
summing a tensor's many readers' gradients) its backward's. What grows
with the batch (batch 2 minus batch 1) is per sample; weights read by the gradient are counted
with the weights, not here.

Used where a layer has no rule and cannot be read as the layers its call applies (``unroll``):
Keras 3 layers whose call applies TensorFlow ops, layers holding their own weights, loops.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["traced_keeps"]

#: ops whose outputs are no buffer of the step (variables, constants, the inputs)
_NOT_BUFFERS = ("ReadVariableOp", "Const", "VarHandleOp", "Placeholder", "Shape", "Identity")

#: (layer class, input specs, configuration) -> what it keeps: a model of fifty identical custom
#: blocks is traced once
_CACHE: Dict[Any, Optional[Dict[str, Any]]] = {}


def _config_text(layer) -> str:
    try:
        return repr(sorted(layer.get_config().items()))
    except Exception:  # noqa: BLE001 - a layer without a readable configuration: its object
        return f"id {id(layer)}"


def _nbytes(t) -> Optional[int]:
    shape = t.shape
    if shape.rank is None or not shape.is_fully_defined():
        return None
    try:
        size = t.dtype.size
    except Exception:  # noqa: BLE001 - resource, variant: not a buffer of known size
        return None
    return int(math.prod(shape.as_list()) if shape.rank else 1) * int(size)


def _trace(layer, in_specs: Sequence[Tuple[Tuple[int, ...], str]], structure, batch: int, tf):
    """The graph of the layer's call and its gradient at ``batch``; the forward input and output
    tensors in it."""
    specs = [tf.TensorSpec((batch, *shape), tf.as_dtype(dtype)) for shape, dtype in in_specs]
    found: Dict[str, Any] = {}

    def step(*xs):
        with tf.GradientTape() as tape:
            for x in xs:
                if x.dtype.is_floating:
                    tape.watch(x)
            args = structure(list(xs))
            out = layer(*args[0], **args[1])
            outs = [o for o in tf.nest.flatten(out) if hasattr(o, "dtype") and o.dtype.is_floating]
            loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in outs])
        targets = [x for x in xs if x.dtype.is_floating] + list(layer.trainable_weights)
        found["inputs"], found["outputs"], found["loss"] = list(xs), outs, loss
        return tape.gradient(loss, targets, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    graph = tf.function(step, autograph=False).get_concrete_function(*specs).graph
    return graph, found["inputs"], found["outputs"], found["loss"]


def _forward_ops(loss) -> set:
    """The ops the loss depends on: the call's forward (everything else is its gradient)."""
    seen, todo = set(), [loss.op]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return seen


def _kept(graph, inputs, outputs, loss) -> Tuple[List[int], List[int], List[int], int, int]:
    """(bytes of each kept input, of each kept output, of each other kept forward tensor, largest
    unkept forward tensor, largest gradient tensor)."""
    forward = _forward_ops(loss)

    def is_grad(op) -> bool:
        return op not in forward and op.type not in _NOT_BUFFERS
    in_names = [t.name for t in inputs]
    out_names = [t.name for t in outputs]
    kept_names = set()
    grad_largest = 0
    for op in graph.get_operations():
        if not is_grad(op):
            continue
        for t in op.inputs:
            if t.op in forward and t.op.type not in _NOT_BUFFERS or t.name in in_names:
                kept_names.add(t.name)
        for t in op.outputs:
            grad_largest = max(grad_largest, _nbytes(t) or 0)
        # gradients summed by one op (AddN over a tensor's many readers) are all alive until it runs
        grad_largest = max(grad_largest, sum(_nbytes(t) or 0 for t in op.inputs if is_grad(t.op)))
    keep_in = [(_nbytes(t) or 0) if t.name in kept_names else -1 for t in inputs]
    keep_out = [(_nbytes(t) or 0) if t.name in kept_names else -1 for t in outputs]
    extra, temp = [], 0
    for op in graph.get_operations():
        if op not in forward or op.type in _NOT_BUFFERS:
            continue
        for t in op.outputs:
            n = _nbytes(t)
            if not n or t.name in in_names or t.name in out_names:
                continue
            if t.name in kept_names:
                extra.append(n)
            else:
                temp = max(temp, n)
    return keep_in, keep_out, extra, temp, grad_largest


def traced_keeps(layer, node_args, node_kwargs, in_tensors, tf) -> Optional[Dict[str, Any]]:
    """What ``layer``'s call keeps for its backward pass, per sample, from its traced gradient:
    ``{"keep_in": [input indices], "keep_out": [output indices], "kept_extra": [bytes per sample],
    "temp": bytes per sample, "backward_temp": bytes per sample}``; None where the call cannot be
    traced (it needs real values, a loop hides its buffers)."""
    in_specs = []
    for t in in_tensors:
        shape = tuple(t.shape)[1:]
        if any(d is None for d in shape):
            return None
        in_specs.append((tuple(int(d) for d in shape), getattr(t.dtype, "name", None) or str(t.dtype)))
    ids = [id(t) for t in in_tensors]
    key = (type(layer), tuple(in_specs), _config_text(layer), repr(node_kwargs and sorted(
        (k, str(v)) for k, v in node_kwargs.items() if not hasattr(v, "shape"))))
    if key not in _CACHE:
        _CACHE[key] = _traced(layer, node_args, node_kwargs, ids, in_specs, tf)
    got = _CACHE[key]
    return None if got is None else {k: list(v) if isinstance(v, list) else v for k, v in got.items()}


def _traced(layer, node_args, node_kwargs, ids, in_specs, tf) -> Optional[Dict[str, Any]]:
    def structure(xs):
        by_id = dict(zip(ids, xs))

        def swap(v):
            if id(v) in by_id:
                return by_id[id(v)]
            if isinstance(v, (list, tuple)):
                return type(v)(swap(u) for u in v)
            if isinstance(v, dict):
                return {k: swap(u) for k, u in v.items()}
            return v
        kwargs = {k: swap(v) for k, v in (node_kwargs or {}).items() if not (k == "mask" and v is None)}
        return [swap(a) for a in node_args], kwargs
    from .unroll import left_as_it_was
    try:
        got = []
        with left_as_it_was(layer):
            for batch in (1, 2):
                graph, inputs, outputs, loss = _trace(layer, in_specs, structure, batch, tf)
                got.append(_kept(graph, inputs, outputs, loss))
    except Exception:  # noqa: BLE001 - a call that cannot be traced: the caller keeps the fallback
        return None
    (in1, out1, extra1, temp1, g1), (in2, out2, extra2, temp2, g2) = got
    if len(extra1) != len(extra2):
        return None  # the graph changed with the batch: not one layer's rule
    return {"keep_in": [i for i, n in enumerate(in2) if n >= 0],
            "keep_out": [i for i, n in enumerate(out2) if n >= 0],
            "kept_extra": [max(0, b - a) for a, b in zip(extra1, extra2) if b - a > 0],
            "temp": max(0, temp2 - temp1), "backward_temp": max(0, g2 - g1)}
