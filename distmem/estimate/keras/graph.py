"""The Keras model as a :class:`~distmem.estimate.liveness.Graph`: one node per layer application,
with what its rule keeps, one table row per layer (a shared layer is one row), nested models
inlined once per application (a tower applied to two inputs holds two sets of activations)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ...errors import ConfigError
from ..liveness import Graph, Node
from ..precision import Precision, dtype_bytes, resolve_precision
from ..table import LayerEstimate
from .access import (dtype_name, graph_nodes, is_graph_model, tensor_key, layer_of, model_io, node_inputs,
                     node_outputs, numel, tensor_shape, trainable_weights)
from .rules import LayerNode, rule_for
from .unroll import MAX_DEPTH, call_arguments, keras_package, unrolled

__all__ = ["Builder", "policy_precision"]


class Builder:
    def __init__(self, prec: Precision, override_dtype: bool, device: str = "gpu"):
        self.g = Graph()
        self.device = device
        self.prec = prec
        self.override = override_dtype
        self.ids: Dict[Tuple[Any, Tuple[str, int, int]], int] = {}
        #: which application of a nested model the tensors being added belong to (one per call)
        self.scope: Tuple[int, ...] = ()
        self._applications = 0
        self._depth = 0
        #: layers without a rule that were read as what their call applies
        self.unrolled: List[str] = []
        #: layers without a rule whose kept tensors were read from their traced gradient
        self.traced: List[str] = []
        self.rows: List[LayerEstimate] = []
        self.row_of_layer: Dict[int, int] = {}
        self.layer_objs: List[Any] = []
        self.notes: List[str] = []
        self.per_row_temps: Dict[int, int] = {}
        self.sizes: Dict[Tuple[str, int, int], Tuple[int, Tuple]] = {}
        self.trainable_cache: Dict[int, list] = {}

    def trainable_of(self, layer) -> list:
        """The layer's trainable weights, read once (Keras walks its sublayers on every access)."""
        key = id(layer)
        if key not in self.trainable_cache:
            self.trainable_cache[key] = trainable_weights(layer)
        return self.trainable_cache[key]

    def tensor_bytes(self, t) -> Tuple[int, Tuple]:
        k = tensor_key(t)
        hit = self.sizes.get(k)
        if hit is None:
            hit = self.sizes[k] = self._tensor_bytes(t)
        return hit

    def _tensor_bytes(self, t) -> Tuple[int, Tuple]:
        shape = tensor_shape(t)
        dims = shape[1:] if len(shape) else ()
        unknown = [i for i, d in enumerate(dims, 1) if d is None]
        if unknown:
            raise ConfigError(f"tensor {getattr(t, 'name', '?')} has an unknown size in dimension(s) {unknown} "
                              f"(shape {shape}); build the model with a full input shape, e.g. "
                              f"keras.Input(shape=(128, 64)) or --input-shape 128,64")
        name = dtype_name(t)
        b = dtype_bytes(name)
        if self.override and name in ("float32", "float16", "bfloat16"):
            b = self.prec.compute_bytes
        return numel(dims) * b, shape

    def key(self, t) -> Tuple[Any, Tuple[str, int, int]]:
        """A tensor's id key in the application being added (a nested model's inner tensors are the
        same objects in every application, their buffers are not)."""
        return (self.scope, tensor_key(t))

    def tid(self, t) -> int:
        k = self.key(t)
        if k not in self.ids:
            size, _ = self.tensor_bytes(t)
            self.ids[k] = self.g.add(size)
        return self.ids[k]

    def row_for(self, layer, name: str) -> int:
        if id(layer) in self.row_of_layer:
            return self.row_of_layer[id(layer)]
        row = len(self.rows)
        self.rows.append(LayerEstimate(name=name, kind=type(layer).__name__))
        self.row_of_layer[id(layer)] = row
        self.layer_objs.append(layer)
        return row

    def add_model(self, model, prefix: str = "", mapping: Optional[Dict[Any, int]] = None) -> None:
        nodes = graph_nodes(model)
        if nodes is None:
            raise ConfigError(f"model {getattr(model, 'name', type(model).__name__)} has no layer graph "
                              f"(a subclassed Model); build it with the functional API or Sequential, or "
                              f"estimate the layers you can express functionally")
        for node in nodes:
            layer = layer_of(node)
            ins, outs = node_inputs(node), node_outputs(node)
            if getattr(node, "is_input", False) or type(layer).__name__ == "InputLayer":
                for t in outs:
                    k = self.key(t)
                    if mapping is not None and k in mapping:
                        self.ids[k] = mapping[k]
                    else:
                        tid = self.tid(t)
                        if tid not in self.g.inputs:
                            self.g.inputs = (*self.g.inputs, tid)
                continue
            if is_graph_model(layer):
                inner_ins, inner_outs = model_io(layer)
                outer = self.scope
                self._applications += 1
                inner = outer + (self._applications,)
                inner_map = {(inner, tensor_key(it)): self.tid(ot) for it, ot in zip(inner_ins, ins)}
                self.scope = inner
                self.add_model(layer, prefix + layer.name + "/", inner_map)
                inner_ids = [self.ids[self.key(it)] for it in inner_outs]
                self.scope = outer
                for iid, ot in zip(inner_ids, outs):
                    self.ids[self.key(ot)] = self.g.add(0, alias=iid)
                continue
            if self._unroll(layer, node, prefix, ins, outs):
                continue
            self.add_node(layer, prefix + layer.name, ins, outs, node)

    def _unroll(self, layer, node, prefix: str, ins, outs) -> bool:
        """A layer without a rule of its own (a custom layer, a Lambda) inlined as the layers and ops
        its call applies (``unroll``); False where it cannot be read so (the fallback rule then)."""
        if self._depth >= MAX_DEPTH or not self._without_rule(layer, ins, outs):
            return False
        got = unrolled(layer, node, keras_package(layer))
        if got is None:
            return False
        sub, sub_ins = got
        outer = self.scope
        self._applications += 1
        inner = outer + (self._applications,)
        mapping = {(inner, tensor_key(it)): self.tid(ot) for it, ot in zip(sub_ins, ins)}
        self.scope = inner
        self._depth += 1
        try:
            self.add_model(sub, prefix + layer.name + "/", mapping)
            _, sub_outs = model_io(sub)
            inner_ids = [self.ids[self.key(t)] for t in sub_outs]
        finally:
            self._depth -= 1
            self.scope = outer
        for iid, ot in zip(inner_ids, outs):
            self.ids[self.key(ot)] = self.g.add(0, alias=iid)
        self.row_for(layer, prefix + layer.name)  # its own weights (those no inner layer holds)
        self.unrolled.append(prefix + layer.name)
        return True

    def _without_rule(self, layer, ins, outs) -> bool:
        try:
            in_info = [self.tensor_bytes(t) for t in ins]
            out_info = [self.tensor_bytes(t) for t in outs]
        except ConfigError:
            return False
        node = LayerNode(layer.name, layer, list(range(len(ins))), list(range(len(outs))), [s for s, _ in in_info],
                         [s for s, _ in out_info], [s for _, s in in_info], [s for _, s in out_info])
        rule = rule_for(layer, node, self.prec, self.device)
        return rule.note.startswith("no sizing rule") and not rule.trace

    def _traced_rule(self, layer, node, ins, rule) -> None:
        """The fallback replaced by what TensorFlow's traced gradient of the call reads (``traced``)."""
        from .traced import traced_keeps
        args, kwargs = call_arguments(node) if node is not None else (None, None)
        if args is None:
            return
        import tensorflow as tf
        got = traced_keeps(layer, args, kwargs, ins, tf)
        if got is None:
            return
        rule.keep_in, rule.keep_out = set(got["keep_in"]), set(got["keep_out"])
        rule.kept_extra = list(got["kept_extra"])
        rule.temps = [got["temp"]] if got["temp"] else []
        rule.backward_temps = [got["backward_temp"]] if got["backward_temp"] else []
        rule.note = ""
        self.traced.append(layer.name)

    def add_node(self, layer, name: str, ins, outs, node=None) -> None:
        in_ids = [self.tid(t) for t in ins]
        in_sizes, in_shapes = zip(*[self.tensor_bytes(t) for t in ins]) if ins else ((), ())
        out_info = [self.tensor_bytes(t) for t in outs]
        out_sizes = [s for s, _ in out_info]
        out_shapes = [s for _, s in out_info]
        keras_node = node
        node = LayerNode(name, layer, in_ids, list(range(len(outs))), list(in_sizes), out_sizes, list(in_shapes),
                         out_shapes)
        rule = rule_for(layer, node, self.prec, self.device)
        if rule.note.startswith("no sizing rule"):
            self._traced_rule(layer, keras_node, ins, rule)
        out_ids = []
        for j, t in enumerate(outs):
            k = self.key(t)
            if rule.alias and in_ids and j == 0:
                self.ids[k] = self.g.add(0, alias=in_ids[0])
            elif k not in self.ids:
                self.ids[k] = self.g.add(out_sizes[j])
            out_ids.append(self.ids[k])
        row = self.row_for(layer, name)
        saved = [in_ids[i] for i in sorted(rule.keep_in) if i < len(in_ids)]
        saved += [out_ids[i] for i in sorted(rule.keep_out) if i < len(out_ids)]
        temps = []
        for b in rule.kept_extra:
            t = self.g.add(b)
            temps.append(t)
            saved.append(t)
        transient = [self.g.add(b) for b in rule.temps]
        temps += transient
        bwd = [self.g.add(b) for b in rule.backward_temps] + [self.g.add(0, b) for b in rule.backward_fixed]
        if rule.extra_grad_per_sample:
            bwd.append(self.g.add(rule.extra_grad_per_sample))
        # weights: the fp32 variables, and under mixed precision their compute-dtype cast copies,
        # which the layer's matmul/conv keeps for the input gradient
        tw = self.trainable_of(layer)
        if self.prec.cast_weights and tw:
            cast = self.g.add(0, sum(numel(w.shape) for w in tw) * self.prec.compute_bytes)
            temps.append(cast)
            saved.append(cast)
        self.per_row_temps[row] = max(self.per_row_temps.get(row, 0), max(rule.temps, default=0))
        if rule.note:
            self.notes.append(f"layer '{name}' ({type(layer).__name__}): {rule.note}")
            if not self.rows[row].note:
                self.rows[row].note = rule.note
        self.g.nodes.append(Node(row=row, inputs=tuple(in_ids), outputs=tuple(out_ids), saved=tuple(saved),
                                 temps=tuple(temps), backward_temps=tuple(bwd), trainable=bool(tw)))
        self.rows[row].output_bytes_per_sample += sum(out_sizes) if not rule.alias else 0
        self.rows[row].dtype = dtype_name(outs[0]) if outs else self.rows[row].dtype
        if self.override and self.rows[row].dtype in ("float32", "float16", "bfloat16"):
            self.rows[row].dtype = {2: "float16" if self.prec.name.endswith("float16") else "bfloat16",
                                    4: "float32"}[self.prec.compute_bytes]


def policy_precision(model) -> Precision:
    names = set()
    for layer in getattr(model, "layers", []) or []:
        pol = getattr(layer, "dtype_policy", None)
        names.add(str(getattr(pol, "name", pol) or "float32"))
    for n in ("mixed_float16", "mixed_bfloat16"):
        if n in names:
            return resolve_precision(n)
    return resolve_precision(None)
