"""What each Keras layer keeps for its backward pass: one rule per layer type, naming the tensors
TensorFlow's gradient of its ops reads (Conv2D its input, ReLU its output, BatchNormalization its
input, Multiply both inputs, an LSTM seven hidden-sized tensors and its input per timestep...),
plus its temporaries. A layer without a rule keeps its inputs and outputs (a fallback, noted)."""
from __future__ import annotations

import math
from typing import List

from ..precision import Precision
from .access import activation_name, numel, trainable_weights
from .kernels import (TF_OWN_CPU_GRAD_KINDS, compute16, cpu_conv_col_buffer, grouped_conv_rule,
                      onednn_has_16bit)

__all__ = ["LOSS_KEPT_FACTOR", "BOOL_MASK_BYTES", "TF_RNN_PARTIAL_WEIGHT_GRADS", "TF_RNN_PARTIALS_BY_CELL",
           "KERAS_UPDATE_OVERLAP", "TF_WHILE_PARALLEL_ITERATIONS", "LayerNode", "Rule", "rule_for"]

#: cross-entropy's backprop, or the clipped probabilities and their log for a probabilistic output.
LOSS_KEPT_FACTOR = 2

#: A dropout mask is a bool tensor: one byte per element.
BOOL_MASK_BYTES = 1

#: Per-timestep partial weight gradients of a recurrent layer alive beside the loop's accumulators
#: (TensorFlow sums a loop-captured weight's gradient iteration by iteration, and runs iterations
#: in parallel). Measured on two recurrent models outside the benchmark zoo — LSTM(384) over 60
#: steps, two GRU(320) over 80 steps, batch 32: 0.9 and 1.6 partials at the median step.
TF_RNN_PARTIAL_WEIGHT_GRADS = 1

#: An LSTM's backward loop keeps many more of them in flight, and how many changes from step to
#: step with the executor's scheduling: at the worst of four steps, the allocator trace held 30 per
#: weight of LSTMText (two LSTM(256) over 100 steps, batch 16; the peak of the same step moved from
#: 105 to 140 MB between two runs) and 18-20 per weight and direction of a bidirectional LSTM(96)
#: over 50 steps, where the bound is 32 (:data:`TF_WHILE_PARALLEL_ITERATIONS`). A limit set from a
#: typical step fails on the worst one, so an LSTM is estimated at the bound (``None``); a GRU's loop
#: measured 5-7 (GRU(160) over 60 steps) and is counted as the median above, with a warning.
TF_RNN_PARTIALS_BY_CELL = {"LSTM": None, "GRU": TF_RNN_PARTIAL_WEIGHT_GRADS,
                           "SimpleRNN": TF_RNN_PARTIAL_WEIGHT_GRADS}

#: How long a weight update outlasts the backward pass beside it (``liveness.Graph.update_overlap``):
#: until the backward has allocated as many bytes again as the update's gradient and temporaries.
#: Measured with the profiler's memory trace (MobileNet 64 px, RMSprop, TF 2.15 CPU): at the peak
#: the updates of the last two large weights (conv_preds, conv_pw_13: 4 MiB each) are alive together,
#: six weight-sized buffers, while the backward is at conv_pw_13; finishing each update before the
#: backward goes on (0) left the estimate 17% low there.
KERAS_UPDATE_OVERLAP = 1.0

#: ``tf.while_loop``'s default ``parallel_iterations``, which Keras's recurrent loops keep: the most
#: loop iterations (and per-step partial weight gradients) TensorFlow runs at once.
TF_WHILE_PARALLEL_ITERATIONS = 32

# What an activation's TensorFlow gradient reads. Output-readers keep the op's output; the others
# keep the input-sized tensors counted here (measured by listing the forward tensors the gradient
# ops of a TF 2.15 graph consume): gelu = 0.5*x*(1+erf(x/sqrt2)) keeps x, x/sqrt2, 0.5*x and
# 1+erf(.); swish/silu is a custom gradient that keeps its output and beta*x.
_KEEPS_OUTPUT = {"relu", "relu6", "elu", "selu", "sigmoid", "tanh", "softmax", "exponential", "log_softmax"}
_KEEPS_INPUT = {"softplus": 1, "leaky_relu": 1, "softsign": 1, "gelu": 4, "mish": 3, "hard_sigmoid": 1,
                "hard_swish": 2, "hard_silu": 2}
_KEEPS_OUTPUT_PLUS = {"swish": 1, "silu": 1}


class LayerNode:
    """A layer application: its inputs and outputs as graph tensor ids and per-sample sizes."""

    def __init__(self, name, layer, inputs, outputs, in_sizes, out_sizes, in_shapes, out_shapes):
        self.name, self.layer = name, layer
        self.inputs, self.outputs = inputs, outputs
        self.in_sizes, self.out_sizes = in_sizes, out_sizes
        self.in_shapes, self.out_shapes = in_shapes, out_shapes



class Rule:
    """What one layer keeps: indices of kept inputs and outputs, extra kept buffers and
    temporaries (bytes per sample), whether its output shares its input's buffer."""

    def __init__(self):
        self.keep_in: set = set()
        self.keep_out: set = set()
        self.kept_extra: List[int] = []
        self.temps: List[int] = []
        self.backward_temps: List[int] = []
        self.alias = False
        self.note = ""
        self.extra_grad_per_sample = 0
        self.backward_fixed: List[int] = []
        #: size it from TensorFlow's traced gradient of its call (``traced``), not by reading it as layers
        self.trace = False


def _activation(rule: Rule, fn, out_size: int, internal_pre: bool) -> None:
    """Add what activation ``fn`` keeps. ``internal_pre``: the activation's input is a
    temporary inside the layer (Dense(activation=...)), not one of the layer's inputs."""
    name = activation_name(fn)
    if name in ("linear", "identity", "none"):
        return
    if internal_pre:
        rule.temps.append(out_size)  # pre-activation
    if name in _KEEPS_OUTPUT:
        rule.keep_out.add(0)
        return
    if name in _KEEPS_OUTPUT_PLUS:
        rule.keep_out.add(0)
        rule.kept_extra.append(_KEEPS_OUTPUT_PLUS[name] * out_size)
        rule.temps.append(out_size)  # sigmoid(beta * x) before the product
        return
    k = _KEEPS_INPUT.get(name)
    if k is None:
        rule.note = f"activation {name!r} has no rule; assumed it keeps its input and output"
        k = 1
        rule.keep_out.add(0)
    if internal_pre:
        rule.kept_extra.extend([out_size] * k)
    else:
        rule.keep_in.add(0)
        rule.kept_extra.extend([out_size] * (k - 1))
    rule.temps.append(out_size)


def _rnn_rule(rule: Rule, layer, node: LayerNode, cb: int, directions: int = 1) -> None:
    cell = getattr(layer, "cell", None)
    units = int(getattr(layer, "units", None) or getattr(cell, "units", 0) or 0)
    in_shape = node.in_shapes[0]
    steps = int(in_shape[1] or 1) if len(in_shape) >= 3 else 1
    feat = int(in_shape[-1] or 1)
    kind = type(cell).__name__ if cell is not None else type(layer).__name__
    # per timestep, TensorFlow keeps what each step's gradient reads: the step input and previous
    # state for the two matmuls, plus the gate outputs and products named below
    # (each is its own small buffer per step, held in the loop's gradient accumulators)
    if "LSTM" in kind:
        hidden = 7   # h, c, sigmoid i f o, tanh(g), tanh(c)
    elif "GRU" in kind:
        hidden = 6   # h, z, r, recurrent h part, tanh(hh), 1 - z
    else:
        hidden = 2   # h, tanh output
    rule.kept_extra.extend(([feat * cb] + [units * cb] * hidden) * steps)
    rule.backward_temps.append(steps * (feat + units) * cb)  # stacked per-step gradients
    rule.temps.append(steps * feat * cb)  # the time-major copy of the input
    # the loop's weight gradients are summed step by step: per-step partials of the kernel and the
    # recurrent kernel are in flight beside the accumulators (batch-free, hence ``fixed``)
    cell = cell if cell is not None else layer
    # how many of those partials are in flight at once depends on the loop's scheduling: at most one
    # per iteration the loop may run at once; an LSTM is counted at that bound, other cells at the
    # measured median, with a warning giving the bound
    most = min(steps, TF_WHILE_PARALLEL_ITERATIONS)
    family = next((f for f in TF_RNN_PARTIALS_BY_CELL if f in kind), None)
    counted = TF_RNN_PARTIALS_BY_CELL.get(family, TF_RNN_PARTIAL_WEIGHT_GRADS) if family else TF_RNN_PARTIAL_WEIGHT_GRADS
    counted = most if counted is None else min(counted, most)
    partial = 0
    for w in trainable_weights(cell)[:2]:
        rule.backward_fixed.extend([numel(w.shape) * 4] * counted)
        partial += numel(w.shape) * 4
    if most > counted and partial:
        dirs = directions
        rule.note = (f"{kind} backward loop: per-timestep partial weight gradients in flight counted as "
                     f"{counted} per weight, but TensorFlow may run up to {most} iterations "
                     f"at once: the peak can be up to "
                     f"{(most - counted) * partial * dirs / 2**20:.1f} MiB higher")


def _mha_rule(rule: Rule, layer, node: LayerNode, cb: int) -> None:
    q_shape = node.in_shapes[0]
    v_shape = node.in_shapes[1] if len(node.in_shapes) > 1 else q_shape
    tq = int(math.prod(int(d or 1) for d in q_shape[1:-1])) or 1
    tv = int(math.prod(int(d or 1) for d in v_shape[1:-1])) or 1
    heads = int(getattr(layer, "_num_heads", None) or getattr(layer, "num_heads", 1))
    kd = int(getattr(layer, "_key_dim", None) or getattr(layer, "key_dim", 1))
    vd = int(getattr(layer, "_value_dim", None) or getattr(layer, "value_dim", None) or kd)
    dropout = float(getattr(layer, "_dropout", None) or getattr(layer, "dropout", 0.0) or 0.0)
    scores = heads * tq * tv * cb
    rule.keep_in.update(range(len(node.inputs)))            # the projections' einsums read their inputs
    rule.kept_extra += [tq * heads * kd * cb, tv * heads * kd * cb, tv * heads * vd * cb]  # scaled Q, K, V
    rule.kept_extra.append(scores)                           # softmax keeps its output
    if dropout > 0:
        rule.kept_extra += [scores, heads * tq * tv * BOOL_MASK_BYTES]  # dropped scores, keep mask
    rule.kept_extra.append(tq * heads * vd * cb)             # attention output read by the out projection
    rule.temps.extend([scores, tq * heads * kd * cb])        # raw scores, unscaled Q
    rule.backward_temps.extend([scores, scores])             # score gradient and softmax-grad product


def _tfop_rule(rule: Rule, layer, node: LayerNode) -> None:
    sym = str(getattr(layer, "symbol", "") or getattr(getattr(layer, "function", None), "__name__", "")).lower()
    tail = sym.split(".")[-1]
    n_tensors = len(node.inputs)
    if tail in ("add", "subtract", "add_n", "concat", "truediv", "divide", "reduce_mean", "reduce_sum",
                "cast", "transpose", "pad", "identity", "stop_gradient", "expand_dims", "squeeze",
                "split", "gather", "stack", "unstack", "__getitem__", "strided_slice", "tile",
                "negative", "neg", "reduce_mean", "mean", "sum"):
        if tail in ("truediv", "divide") and n_tensors > 1:
            rule.keep_in.update(range(n_tensors))
        if tail in ("expand_dims", "squeeze", "identity", "stop_gradient"):
            rule.alias = True
        return
    if tail in ("reshape",):
        rule.alias = True
        return
    if tail in ("multiply", "matmul", "einsum", "maximum", "minimum", "pow", "square", "sqrt", "rsqrt",
                "log", "reduce_max", "reduce_min", "abs", "erf"):
        if tail in ("multiply", "maximum", "minimum") and n_tensors < 2:
            return  # times a constant: the gradient reads only the constant
        rule.keep_in.update(range(n_tensors))
        if tail in ("reduce_max", "reduce_min", "sqrt", "rsqrt"):
            rule.keep_out.add(0)
        return
    if tail in ("relu", "relu6", "sigmoid", "tanh", "softmax", "exp", "elu", "selu", "log_softmax"):
        rule.keep_out.add(0)
        return
    if tail in ("gelu", "silu", "swish", "softplus", "leaky_relu", "leaky_relu"):
        _activation(rule, type("f", (), {"__name__": tail}), node.out_sizes[0], internal_pre=False)
        return
    rule.keep_in.update(range(n_tensors))
    rule.keep_out.add(0)
    rule.note = f"TensorFlow op {sym or '?'} has no rule; assumed it keeps its inputs and output"


_WEIGHTED = ("Dense", "EinsumDense", "Conv1D", "Conv2D", "Conv3D", "Convolution1D", "Convolution2D",
             "Convolution3D", "DepthwiseConv1D", "DepthwiseConv2D", "Conv1DTranspose", "Conv2DTranspose",
             "Conv3DTranspose", "Convolution2DTranspose", "LocallyConnected1D", "LocallyConnected2D")
_SEPARABLE = ("SeparableConv1D", "SeparableConv2D", "SeparableConvolution2D")
_ACTIVATION_LAYERS = ("Activation", "ReLU", "ELU", "Softmax", "LeakyReLU", "PReLU", "ThresholdedReLU")
# layers whose gradient reads nothing they hold
_READS_NOTHING = ("Add", "Subtract", "Average", "Concatenate", "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D",
                  "Cropping1D", "Cropping2D", "Cropping3D", "Permute", "RepeatVector", "UpSampling1D",
                  "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalAveragePooling3D",
                  "AveragePooling1D", "AveragePooling2D", "AveragePooling3D", "Rescaling", "Resizing",
                  "CenterCrop", "RandomFlip", "RandomCrop", "RandomRotation", "RandomZoom",
                  "RandomTranslation", "RandomContrast", "Masking", "ActivityRegularization",
                  "GaussianNoise", "CategoryEncoding", "Identity",
                  # (inputs[0] + inputs[1] * scale with a constant scale: Inception-ResNet)
                  "CustomScaleLayer", "InputLayer")
_MAX_POOLS = ("MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "GlobalMaxPooling1D", "GlobalMaxPooling2D",
              "GlobalMaxPooling3D")
_DROPOUTS = ("Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "AlphaDropout", "GaussianDropout")


def _weighted_rule(r: Rule, layer, node: LayerNode, prec: Precision, device: str, out0: int) -> None:
    kind = type(layer).__name__
    r.keep_in.add(0)  # the weight gradient (and the input gradient's transpose) read the input
    _activation(r, getattr(layer, "activation", None), out0, internal_pre=True)
    grouped_conv_rule(r, layer, node, device)
    cb = prec.compute_bytes
    if device == "cpu" and cb == 2 and kind in TF_OWN_CPU_GRAD_KINDS and not onednn_has_16bit(compute16(prec)):
        col = cpu_conv_col_buffer(layer, node, cb)
        if col:
            r.backward_fixed.append(col)


def _separable_rule(r: Rule, layer, node: LayerNode, out0: int) -> None:
    r.keep_in.add(0)
    filters = int(getattr(layer, "filters", 1) or 1)
    in_ch = int(node.in_shapes[0][-1] or 1)
    dm = int(getattr(layer, "depth_multiplier", 1) or 1)
    r.kept_extra.append(out0 // filters * in_ch * dm)  # depthwise output, read by the pointwise conv
    _activation(r, getattr(layer, "activation", None), out0, internal_pre=True)


def _activation_layer_rule(r: Rule, layer, out0: int) -> None:
    kind = type(layer).__name__
    if kind == "ReLU":
        slope = float(getattr(layer, "negative_slope", 0.0) or 0.0)
        thr = float(getattr(layer, "threshold", 0.0) or 0.0)
        r.keep_out.add(0) if (slope == 0 and thr == 0) else r.keep_in.add(0)
    elif kind in ("ELU", "Softmax"):
        r.keep_out.add(0)
    elif kind in ("LeakyReLU", "PReLU", "ThresholdedReLU"):
        r.keep_in.add(0)
    else:
        _activation(r, getattr(layer, "activation", None), out0, internal_pre=False)


def _dropout_rule(r: Rule, layer, node: LayerNode, cb: int, out0: int) -> None:
    rate = float(getattr(layer, "rate", 0.0) or 0.0)
    if rate <= 0:
        return
    if getattr(layer, "noise_shape", None) is not None or type(layer).__name__.startswith("Spatial"):
        # a broadcast mask: x * mask, whose gradient reads x (the mask itself is small)
        r.keep_in.add(0)
    else:
        numel = out0 // max(cb, 1) if node.out_sizes else 0
        r.kept_extra.append(numel * BOOL_MASK_BYTES)  # SelectV2's gradient reads the keep mask
    r.temps.extend([out0, out0])  # the uniform sample and the scaled input


def _bidirectional_rule(r: Rule, layer, node: LayerNode, cb: int) -> None:
    fwd = getattr(layer, "forward_layer", None) or getattr(layer, "layer", None)
    _rnn_rule(r, fwd, node, cb, directions=2)
    r.kept_extra[:] = r.kept_extra * 2
    r.backward_temps[:] = [2 * x for x in r.backward_temps]
    r.backward_fixed[:] = r.backward_fixed * 2  # each direction's loop sums its own partials


def _keras3(layer) -> bool:
    from .unroll import keras_package
    major = str(getattr(keras_package(layer), "__version__", "2")).split(".")[0]
    return major.isdigit() and int(major) >= 3


def rule_for(layer, node: LayerNode, prec: Precision, device: str = "gpu") -> Rule:
    r = Rule()
    kind = type(layer).__name__
    out0 = node.out_sizes[0] if node.out_sizes else 0
    cb = prec.compute_bytes
    if kind in _WEIGHTED:
        _weighted_rule(r, layer, node, prec, device, out0)
    elif kind in _SEPARABLE:
        _separable_rule(r, layer, node, out0)
    elif kind in ("BatchNormalization", "SyncBatchNormalization", "Normalization"):
        r.keep_in.add(0)  # FusedBatchNormGrad reads x (and per-channel statistics)
    elif kind in ("LayerNormalization", "GroupNormalization", "UnitNormalization", "RMSNormalization"):
        r.keep_in.add(0)
        r.kept_extra.append(out0)  # the normalised tensor, read by the gamma product
        r.temps.append(out0)
    elif kind in _ACTIVATION_LAYERS:
        _activation_layer_rule(r, layer, out0)
    elif kind in _READS_NOTHING:
        pass
    elif kind in ("UpSampling2D", "UpSampling3D"):
        if str(getattr(layer, "interpolation", "nearest")) != "nearest":
            r.keep_in.add(0)
    elif kind in ("Reshape", "Flatten"):
        r.alias = True
    elif kind in ("Multiply", "Maximum", "Minimum", "Dot"):
        r.keep_in.update(range(len(node.inputs)))
    elif kind in _MAX_POOLS:
        r.keep_in.add(0)
        r.keep_out.add(0)  # MaxPoolGrad reads the input and the output
    elif kind in _DROPOUTS:
        _dropout_rule(r, layer, node, cb, out0)
    elif kind == "Embedding":
        # the gradient is an IndexedSlices of the looked-up rows: batch-sized, not table-sized
        r.extra_grad_per_sample = out0
    elif kind in ("LSTM", "GRU", "SimpleRNN", "RNN", "ConvLSTM2D"):
        _rnn_rule(r, layer, node, cb)
    elif kind == "Bidirectional":
        _bidirectional_rule(r, layer, node, cb)
    elif kind == "TimeDistributed":
        inner = getattr(layer, "layer", None)
        if _keras3(layer) and len(node.in_shapes[0]) > 1 and node.in_shapes[0][1] is not None:
            # Keras 3 runs it as a Python loop over the time steps: each step's slice of the input has
            # a gradient the input's size, all summed at the end (the allocator trace of a BiLSTM tagger,
            # TF 2.21: 58 of 60 alive at the peak); read from its traced gradient
            r.trace = True
            r.keep_in.add(0)
            r.keep_out.add(0)
            r.note = "no sizing rule for a Keras 3 TimeDistributed (a loop over time steps); traced"
            return r
        return rule_for(inner, node, prec, device) if inner is not None else r
    elif kind == "MultiHeadAttention":
        _mha_rule(r, layer, node, cb)
    elif kind == "LayerScale":
        # x * gamma (ConvNeXt): gamma's gradient reads x, x's gradient reads only gamma
        r.keep_in.add(0)
    elif kind in ("TFOpLambda", "SlicingOpLambda"):
        _tfop_rule(r, layer, node)
    else:
        r.keep_in.update(range(len(node.inputs)))
        r.keep_out.update(range(len(node.outputs)))
        r.note = (f"no sizing rule for layer type {kind}; fallback: assumed it keeps its inputs and "
                  f"outputs for the backward pass")
    return r
