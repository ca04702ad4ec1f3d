"""Per-layer estimate of a built Keras model (tf.keras 2.x and Keras 3), without running it.

Method: analytic. Each layer type has a rule naming which tensors TensorFlow's gradient of its
ops reads (``rules``). Those tensors are what the layer keeps for the backward pass. The rules are
then replayed over the model's own layer graph (``liveness.replay``): outputs are freed after their
last reader unless kept, the backward pass allocates input and weight gradients and frees kept
tensors after their last backward reader, and each weight is updated (and its gradient freed) as
soon as its gradient exists, as a Keras graph does. A tensor read by several layers (a residual
branch, a DenseNet concatenation) is counted once. Layers without a rule get a conservative
fallback (they keep their inputs and outputs) and a warning naming them.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

from ...errors import ConfigError
from ..allocators import BFCAllocator
from ..liveness import Graph, Node, needs_gradient, replay
from ..optimizers import (keras_decays_weights, keras_early_update_temporaries, keras_major_version, keras_optimizer,
                          keras_update_temporaries)
from ..precision import Precision, dtype_bytes, resolve_precision
from ..table import Estimate
from .access import all_weights, dtype_name, model_io, numel, tensor_shape, trainable_weights
from .graph import Builder, policy_precision
from .kernels import CONV_KINDS, compute16, onednn_has_16bit, tf_cpu_uncounted_below
from .rules import KERAS_UPDATE_OVERLAP, LOSS_KEPT_FACTOR

__all__ = ["estimate_keras", "weights_only_estimate"]


def _add_loss(b: Builder, model) -> int:
    """The loss node: reads the model outputs, keeps ~2 output-sized fp32 tensors for its
    gradient. Returns its row."""
    g = b.g
    _, model_outs = model_io(model)
    out_ids = [b.ids[b.key(t)] for t in model_outs]
    loss_row = len(b.rows)
    numel_out = sum(int(numel(tensor_shape(t)[1:])) for t in model_outs)
    loss_keep = g.add(LOSS_KEPT_FACTOR * numel_out * 4)
    loss_out = g.add(0, 4)
    g.nodes.append(Node(row=loss_row, inputs=tuple(out_ids), outputs=(loss_out,), saved=(loss_keep,),
                        temps=(loss_keep,)))
    return loss_row


class _Optimizer:
    """What the optimizer adds per weight: slots, update temporaries (those computed at the step's
    start apart), whether decoupled weight decay copies held kernels."""

    def __init__(self, optimizer: Any, prec: Precision):
        self.info, obj = keras_optimizer(optimizer)
        self.update_temps = keras_update_temporaries(obj, keras_major_version())
        self.early_temps = min(self.update_temps, keras_early_update_temporaries(obj))
        self.decays = keras_decays_weights(obj)
        self.prec = prec


def _account_weights(b: Builder, opt: _Optimizer) -> None:
    """Weights, gradients, optimizer state per row; each variable, slot, gradient and update
    temporary is its own allocation in the replay (so allocator rounding applies to each)."""
    g = b.g
    weights_alloc: List[int] = []
    slots_alloc: List[int] = []
    # rows whose backward computes an input gradient (something upstream is trainable)
    grad_tensors = needs_gradient(g)
    input_grad_rows = {node.row for node in g.nodes if any(g.root(t) in grad_tensors for t in node.inputs)}
    seen_vars: set = set()
    first_node: Dict[int, int] = {}
    for k, node in enumerate(g.nodes):
        first_node.setdefault(node.row, k)
    for row, layer in enumerate(b.layer_objs):
        # decoupled weight decay copies a variable whose forward read the backward still holds:
        # a kernel (rank >= 2) of a layer whose input gradient is computed (something upstream is
        # trainable) and not an embedding table (its gradient reads only the looked-up rows)
        copies_on_decay = opt.decays and row in input_grad_rows and type(layer).__name__ != "Embedding"
        per = _layer_weights(b, row, layer, opt, copies_on_decay, seen_vars, weights_alloc, slots_alloc)
        if row in first_node:
            node = g.nodes[first_node[row]]
            node.grads, node.update_temps, node.early_update_temps, node.held_read_copies = per
    g.persistent = weights_alloc + slots_alloc
    g.persistent_parts = ["weights"] * len(weights_alloc) + ["optimizer state"] * len(slots_alloc)
    g.update_overlap = KERAS_UPDATE_OVERLAP


def _layer_weights(b: Builder, row: int, layer, opt: _Optimizer, copies_on_decay: bool, seen_vars: set,
                   weights_alloc: List[int], slots_alloc: List[int]):
    """One layer's weights into its row and the replay's buffers: (gradients, update temporaries,
    early update temporaries, decay copies), bytes each."""
    r = b.rows[row]
    trainable_ids = {id(w) for w in b.trainable_of(layer)}
    grads: List[int] = []
    update: List[int] = []
    early: List[int] = []
    copies: List[int] = []
    for w in all_weights(layer):
        if id(w) in seen_vars:
            continue  # a shared weight is stored once
        seen_vars.add(id(w))
        shape = tuple(int(d) for d in w.shape)
        n = numel(shape)
        wb = dtype_bytes(dtype_name(w))
        r.params += n
        r.param_bytes += n * wb
        weights_alloc.append(n * wb)
        if id(w) not in trainable_ids:
            continue
        r.trainable_params += n
        r.grad_bytes += n * wb
        slots = opt.info.slot_elements(shape)
        r.optimizer_bytes += slots * wb
        if slots and slots % n == 0:
            slots_alloc.extend([n * wb] * (slots // n))
        elif slots:
            slots_alloc.append(slots * wb)
        if type(layer).__name__ != "Embedding":
            grads.append(n * wb)
        # else the optimizer gets the looked-up rows (IndexedSlices, sized per sample in the
        # layer's rule): no table-sized gradient (measured: the recommender's 38 MiB of
        # tables, Adam, TF 2.15 and 2.21)
        update.extend([n * wb] * (opt.update_temps - opt.early_temps))
        early.extend([n * wb] * opt.early_temps)
        if copies_on_decay and len(shape) >= 2:
            copies.append(n * wb)
        if opt.prec.cast_weights and n * wb >= 4 * n:
            # the gradient arrives in the compute dtype and is cast to the fp32 master's
            update.append(n * opt.prec.compute_bytes)
    return tuple(grads), tuple(update), tuple(early), tuple(copies)


def _kept_per_row(b: Builder, held: bool, loss_row: int) -> None:
    """Kept activations per row, from replays at batch 1 and 2 (fixed + per-sample), all counted."""
    g, rows = b.g, b.rows
    r1 = replay(g, 1, grads_held=held, saved_only=True)
    r2 = replay(g, 2, grads_held=held, saved_only=True)
    for row, r in enumerate(rows):
        a1, a2 = r1.saved_by_row.get(row, 0), r2.saved_by_row.get(row, 0)
        r.activation_bytes_per_sample = a2 - a1
        r.activation_fixed_bytes = a1 - (a2 - a1)
        r.workspace_bytes_per_sample = b.per_row_temps.get(row, 0)
    if rows:  # the loss's kept tensors travel with the last layer
        rows[-1].activation_bytes_per_sample += r2.saved_by_row.get(loss_row, 0) - r1.saved_by_row.get(loss_row, 0)


def _cpu_16bit_note(b: Builder, prec: Precision, device: str) -> None:
    c16 = compute16(prec)
    if device == "cpu" and prec.compute_bytes == 2 and not onednn_has_16bit(c16):
        convs = [r.name for r in b.rows if r.kind in CONV_KINDS]
        if convs:
            b.notes.append(
                f"{c16} convolutions on TensorFlow's own CPU kernels ({len(convs)} layers, e.g. '{convs[0]}'; "
                f"oneDNN has no {c16} kernels on this CPU): each weight gradient's column buffer (up to "
                f"30 MiB) is counted, but the input gradients' buffers, which run beside them, and the allocator "
                f"fragmentation they cause are not, so this CPU peak can be low by tens of MiB (measured up to 32% "
                f"on DenseNet-121 in bfloat16); GPU kernels (cuDNN) are sized by the GPU footprint")


def _check(model: Any, batch_size: Any, device: Any) -> str:
    if batch_size is None or int(batch_size) < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not hasattr(model, "layers"):
        raise ConfigError(f"estimate_keras needs a built Keras model, got {type(model).__name__}")
    if not getattr(model, "built", True) or not getattr(model, "inputs", None):
        raise ConfigError(f"Keras model {getattr(model, 'name', '?')} is not built with known inputs; build it "
                          f"with keras.Input(shape=...) or call model.build((None, ...)) first")
    device = str(device).lower()
    if device not in ("gpu", "cuda", "cpu"):
        raise ConfigError(f"device must be 'gpu' or 'cpu', got {device!r}")
    return "cpu" if device == "cpu" else "gpu"


def estimate_keras(model: Any, batch_size: int = 32, optimizer: Any = "adam", *,
                   precision: Any = None, loss_scale: Optional[bool] = None, device: str = "gpu",
                   calibrate: Any = False, name: Optional[str] = None,
                   allocator_floor: Optional[int] = None) -> Estimate:
    """Per-layer training memory of a built Keras model at ``batch_size``.

    ``optimizer``: the optimizer object you train with (its slots are read from a private copy of
    it) or a name (``"adam"``, ``"sgd"``, ``"momentum"``, ``"rmsprop"``, ``"adagrad"``...).
    ``precision``: ``None`` reads the model's dtype policy; ``"mixed_float16"`` /
    ``"mixed_bfloat16"`` / ``"float32"`` override it (fp16/bf16 compute, fp32 master weights).
    ``loss_scale``: whether gradients are unscaled as one group (default: with mixed_float16 or a
    LossScaleOptimizer). ``device``: whose allocator the peak models — ``"gpu"`` counts every
    buffer; ``"cpu"`` models what ``tf.config.experimental.get_memory_info('CPU:0')`` reports,
    which leaves out buffers below :data:`TF_CPU_UNCOUNTED_BELOW` unless TensorFlow's BFC allocator
    serves the CPU (``allocator_floor``: those bytes as a process measured them, default read from
    this process's environment).
    ``calibrate``: ``True`` runs a few training steps of a copy of the model at a small batch on
    CPU (:func:`distmem.estimate.keras.calibrate.measure_keras_step`) and adds what the analytic
    replay of that step missed (never subtracts); a dict ``{"batch": b, "peak": bytes}`` supplies a
    measurement instead. Method ``"calibrated"``; costs one traced step (seconds).
    """
    device = _check(model, batch_size, device)
    batch_size = int(batch_size)
    floor = tf_cpu_uncounted_below() if allocator_floor is None else int(allocator_floor)
    min_alloc = floor if device == "cpu" else 0
    prec = resolve_precision(precision) if precision is not None else policy_precision(model)
    opt = _Optimizer(optimizer, prec)
    if loss_scale is None:
        loss_scale = prec.loss_scaling or "scaled" in opt.info.source

    b = Builder(prec, precision is not None, device)
    b.add_model(model)
    g = b.g
    loss_row = _add_loss(b, model)
    _account_weights(b, opt)
    _, model_outs = model_io(model)
    input_per_sample = sum(g.tensors[t].per_sample for t in g.inputs)
    label = g.add(8 * max(1, len(model_outs)))  # int64 class labels, held by the caller
    g.inputs = (*g.inputs, label)
    held = bool(loss_scale)
    extra = [0]
    peak_fn, parts_fn = _replayers(g, held, min_alloc, extra)
    _kept_per_row(b, held, loss_row)
    _cpu_16bit_note(b, prec, device)
    est = Estimate(framework="keras", model=name or getattr(model, "name", "model"), batch_size=batch_size,
                   precision=prec.name, optimizer=opt.info.to_dict(), layers=b.rows, method="analytic",
                   device=device, input_bytes_per_sample=input_per_sample, warnings=list(b.notes),
                   _peak_fn=peak_fn, _parts_fn=parts_fn)
    for note in b.notes:
        warnings.warn(f"distmem.estimate: {note}", stacklevel=2)
    if calibrate:
        _calibrate(est, g, held, model, batch_size, optimizer, calibrate, extra)
    return est


def _replayers(g: Graph, held: bool, min_alloc: int, extra: List[int]):
    """The estimate's peak and parts functions over ``g`` at any batch; ``extra[0]``: bytes a
    calibration adds."""
    def peak_fn(batch: int, train: bool) -> Dict[str, Any]:
        # TensorFlow's allocator is BFC on GPU and (for buffers of 256 KiB and more) on CPU; two
        # steps, because the second starts from the first one's chunk layout
        alloc = BFCAllocator(min_alloc)
        out = replay(g, batch, grads_held=held, train=train, allocator=alloc, steps=2).as_dict()
        if train and extra[0]:
            out["analytic_peak"] = out["peak"]
            out["peak"] = int(out["peak"]) + extra[0]
        return out

    def parts_fn(batch: int) -> Dict[str, int]:
        # the same replay as peak_fn, each allocation booked to its part of the peak
        alloc = BFCAllocator(min_alloc, track=True)
        parts = dict(replay(g, batch, grads_held=held, train=True, allocator=alloc, steps=2).parts or {})
        if extra[0]:
            parts["calibration (measured, not modelled)"] = extra[0]
        return parts
    return peak_fn, parts_fn


def _calibrate(est: Estimate, g: Graph, held: bool, model: Any, batch_size: int, optimizer: Any, calibrate: Any,
               extra: List[int]) -> None:
    from .calibrate import calibration_batch, measure_keras_step
    point = calibrate if isinstance(calibrate, dict) else \
        measure_keras_step(model, calibration_batch(batch_size), optimizer)
    cpu_floor = int(point.get("floor", tf_cpu_uncounted_below()))
    analytic = replay(g, int(point["batch"]), grads_held=held, allocator=BFCAllocator(cpu_floor), steps=2).peak
    extra[0] = max(0, int(point["peak"]) - int(analytic))
    est.method = "calibrated"
    est.calibration = {"batch": int(point["batch"]), "measured_cpu_peak": int(point["peak"]),
                       "analytic_cpu_peak": int(analytic), "added_bytes": extra[0]}


def weights_only_estimate(model: Any, batch_size: int, optimizer: Any = "adam", *, device: str = "gpu",
                          reason: str = "", name: Optional[str] = None) -> Estimate:
    """What can be said of a Keras model without its layer graph (a subclassed model): one row per
    top-level layer with its weights, gradients and optimizer state, no activations; the step's
    figure is the state alone until a measurement gives it (``measure.measured``). ``reason``: why
    the layer graph could not be read, kept as a warning."""
    from ..table import LayerEstimate
    prec = policy_precision(model)
    opt = _Optimizer(optimizer, prec)
    rows: List[LayerEstimate] = []
    seen: set = set()
    layers = list(getattr(model, "layers", []) or []) or [model]
    for layer in layers:
        r = LayerEstimate(name=layer.name, kind=type(layer).__name__)
        trainable = {id(w) for w in trainable_weights(layer)}
        for w in all_weights(layer):
            if id(w) in seen:
                continue
            seen.add(id(w))
            shape = tuple(int(d) for d in w.shape)
            n, wb = numel(shape), dtype_bytes(dtype_name(w))
            r.params += n
            r.param_bytes += n * wb
            if id(w) in trainable:
                r.trainable_params += n
                r.grad_bytes += n * wb
                r.optimizer_bytes += opt.info.slot_elements(shape) * wb
        rows.append(r)
    state = sum(r.state_bytes for r in rows)
    parts = {"weights": sum(r.param_bytes for r in rows), "gradients": sum(r.grad_bytes for r in rows),
             "optimizer state": sum(r.optimizer_bytes for r in rows)}

    def peak_fn(batch: int, train: bool) -> Dict[str, Any]:
        return {"peak": state if train else parts["weights"], "phase": "update"}
    note = (f"the layer graph of {getattr(model, 'name', type(model).__name__)} could not be read ({reason}); "
            f"its table has weights, gradients and optimizer state per layer, no activations")
    est = Estimate(framework="keras", model=name or getattr(model, "name", "model"), batch_size=int(batch_size),
                   precision=prec.name, optimizer=opt.info.to_dict(), layers=rows, method="analytic",
                   device="cpu" if str(device).lower() == "cpu" else "gpu", warnings=[note],
                   _peak_fn=peak_fn, _parts_fn=lambda batch: dict(parts))
    est.model_ran = False  # type: ignore[attr-defined]
    est.why_not_modelled = note  # type: ignore[attr-defined]
    return est
