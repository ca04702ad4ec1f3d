"""Per-layer estimate of a built Keras model (tf.keras 2.x and Keras 3), without running it.

Method: analytic. Each layer type has a rule naming which tensors TensorFlow's gradient of its
ops reads (Conv2D its input, ReLU its output, BatchNormalization its input, Multiply both inputs,
an LSTM seven hidden-sized tensors and its input per timestep...). Those tensors are what the
layer keeps for the backward pass. The rules are then replayed over the model's own layer graph
(``liveness.replay``): outputs are freed after their last reader unless kept, the backward pass
allocates input and weight gradients and frees kept tensors after their last backward reader,
and each weight is updated (and its gradient freed) as soon as its gradient exists, as a Keras
graph does. A tensor read by several layers (a residual branch, a DenseNet concatenation) is
counted once. Layers without a rule get a conservative fallback (they keep their inputs and
outputs) and a warning naming them.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Dict, List, Optional, Tuple

from ..errors import ConfigError
from .liveness import BFCAllocator, Graph, Node, needs_gradient, replay
from .optimizers import (keras_decays_weights, keras_early_update_temporaries, keras_major_version, keras_optimizer,
                         keras_update_temporaries)
from .precision import Precision, dtype_bytes, resolve_precision
from .table import Estimate, LayerEstimate

__all__ = ["estimate_keras", "LOSS_KEPT_FACTOR", "KERAS_UPDATE_OVERLAP", "TF_WHILE_PARALLEL_ITERATIONS", "BOOL_MASK_BYTES", "TF_RNN_PARTIAL_WEIGHT_GRADS",
           "TF_RNN_PARTIALS_BY_CELL",
           "TF_CPU_UNCOUNTED_BELOW", "XLA_CPU_DEPTHWISE_FILTER_COPIES", "XLA_CPU_GROUPED_CONV_INPUT_TEMPS",
           "XLA_GROUPED_CONV_INPUT_COPIES",
           "TF_CPU_CONV_GRAD_WORKING_SET", "onednn_has_16bit",
           "tf_cpu_uncounted_below"]

#: TensorFlow's CPU allocator with oneDNN (on by default on x86 Linux) serves requests below
#: 256 KiB from a separate small-size pool whose bytes ``get_memory_info('CPU:0')`` does not
#: report; only larger buffers (its BFC pool) are counted. Measured on TF 2.15: fifty 240,000-byte
#: tensors read as 0 bytes in use, fifty 262,144-byte ones as 13,107,200. With
#: ``TF_CPU_ALLOCATOR_USE_BFC=true`` (which distmem's TensorFlow adapter sets) one BFC allocator
#: serves and counts every buffer: the same fifty small tensors read as 12,294,400.
TF_CPU_UNCOUNTED_BELOW = 256 * 1024


def _env_true(name: str) -> bool:
    import os
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def tf_cpu_uncounted_below() -> int:
    """Bytes below which TensorFlow's CPU allocator statistics skip a buffer: 0 under the BFC CPU
    allocator (``TF_CPU_ALLOCATOR_USE_BFC``) or without oneDNN, else :data:`TF_CPU_UNCOUNTED_BELOW`."""
    import os
    if _env_true("TF_CPU_ALLOCATOR_USE_BFC"):
        return 0
    return 0 if os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip() in ("0", "false", "False") \
        else TF_CPU_UNCOUNTED_BELOW

#: The loss keeps about two output-sized fp32 tensors for its gradient: the softmax
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


#: Keras runs a grouped convolution (``groups > 1``) through an XLA-compiled function (TensorFlow's
#: own CPU kernels have no grouped convolution). For a depthwise-style one (one input channel per
#: group: ConvNeXt's 7x7 convolutions), XLA's CPU backend expands the filter to a dense, masked
#: ``kh x kw x C_in x C_out`` one, and the gradient's single XLA temporary holds two such fp32
#: filters — whatever the compute dtype. Measured with the profiler's memory trace (ConvNeXtTiny,
#: 64 px, batch 8, TF 2.15 CPU): one 231,211,008-byte request, 2 x 7 x 7 x 768 x 768 x 4 exactly, at
#: stage 3's gradient, and 57,802,752 / 14,450,688 bytes at stages 2 / 1; the same in probes of one
#: such convolution at 256-768 channels, fp32 and bfloat16, TF 2.15 and 2.21. Grouped convolutions
#: with several channels per group (RegNet) are not expanded: their temporaries are filter-sized.
XLA_CPU_DEPTHWISE_FILTER_COPIES = 2

#: Besides, the gradient of any grouped convolution XLA compiles for the CPU holds input-sized
#: temporaries beside the input gradient: 2.0-3.0 inputs measured at stride 1 and 1.3-2.5 at stride
#: 2 (one such convolution, 24-368 channels, 3-46 groups, batch 16-32, TF 2.15), counted as 2.
XLA_CPU_GROUPED_CONV_INPUT_TEMPS = 2


#: And the XLA-compiled function's gradient needs the convolution's input, which the compiled
#: forward hands back as an output of its own: a copy, kept until the backward (the allocator
#: trace of RegNetX002 at 64 px: a buffer the size of each grouped convolution's input alive at the
#: peak beside the ReLU output it was copied from). Counted on every device: it is how TensorFlow
#: differentiates any compiled function, not a CPU kernel's choice.
XLA_GROUPED_CONV_INPUT_COPIES = 1


#: TensorFlow's own CPU kernels for a convolution's gradient (``Conv2DCustomBackpropFilterOp``,
#: used where oneDNN has no kernel: 16-bit types on a CPU without AVX512) unroll input patches into
#: a column buffer of ``shard`` images, ``shard = ceil(working set / (sizeof(T) x work unit))``
#: where the working set is a fixed 30 MiB ("30MB is from ivybridge" in
#: ``conv_grad_filter_ops.cc``) and the work unit is ``out_img x k x C_in + out_img x C_out +
#: k x C_in x C_out`` elements; the buffer is ``shard x out_img x k x C_in`` elements (not capped by the
#: batch). Requests logged by the BFC allocator matched it on every probe (1x1 and 3x3, 16-768
#: channels, fp32/fp16/bf16 through the same kernel): 20,938,752 bytes for a 1x1 convolution of 32 to
#: 16 channels on 48x48 maps, 25,878,528 for a 3x3 one of 64 channels on 24x24 in bfloat16.
TF_CPU_CONV_GRAD_WORKING_SET = 30 << 20


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset:
    """This CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere), read once."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _compute16(prec: Precision) -> str:
    """The 16-bit compute dtype of a mixed precision: "bfloat16" or "float16"."""
    return "bfloat16" if "bfloat16" in prec.name else "float16"


def onednn_has_16bit(compute: str) -> bool:
    """Whether oneDNN (TensorFlow's x86 CPU kernels) runs ``compute`` ("bfloat16"/"float16")
    convolutions on this CPU: bfloat16 needs AVX512 (or AVX-NE-CONVERT), float16 AVX512-FP16 (or
    AMX-FP16 / AVX-NE-CONVERT). Without, TensorFlow falls back to its own kernels."""
    f = _cpu_flags()
    if compute == "bfloat16":
        return bool(f & {"avx512f", "avx_ne_convert"})
    return bool(f & {"avx512_fp16", "amx_fp16", "avx_ne_convert"})


def _cpu_conv_col_buffer(layer, node: "_Node", itemsize: int) -> int:
    """Bytes of the column buffer TensorFlow's own CPU kernel allocates for the weight gradient of
    convolution ``layer`` (see :data:`TF_CPU_CONV_GRAD_WORKING_SET`); 0 where it does not apply."""
    kernel = getattr(layer, "kernel", None)
    if kernel is None or int(getattr(layer, "groups", 1) or 1) > 1 or not node.out_shapes:
        return 0
    kshape = tuple(int(d) for d in kernel.shape)
    if len(kshape) not in (3, 4):
        return 0
    ft, cout = _numel(kshape[:-1]), kshape[-1]
    out = node.out_shapes[0]
    fmt = str(getattr(layer, "data_format", "channels_last") or "channels_last")
    spatial = out[2:] if fmt == "channels_first" else out[1:-1]
    out_img = _numel(tuple(int(d or 1) for d in spatial))
    work = out_img * ft + out_img * cout + ft * cout
    shard = -(-(TF_CPU_CONV_GRAD_WORKING_SET // itemsize) // max(1, work))
    return shard * out_img * ft * itemsize


def _grouped_conv_rule(rule: "_Rule", layer, node: "_Node", device: str) -> None:
    groups = int(getattr(layer, "groups", 1) or 1)
    kernel = getattr(layer, "kernel", None)
    if groups <= 1 or kernel is None:
        return
    if node.in_sizes:
        rule.kept_extra.extend([node.in_sizes[0]] * XLA_GROUPED_CONV_INPUT_COPIES)
    if device != "cpu":
        return
    if node.in_sizes:
        rule.backward_temps.extend([node.in_sizes[0]] * XLA_CPU_GROUPED_CONV_INPUT_TEMPS)
    shape = tuple(int(d) for d in kernel.shape)
    if len(shape) < 3 or shape[-2] != 1:
        return
    spatial = _numel(shape[:-2])
    rule.backward_fixed.append(XLA_CPU_DEPTHWISE_FILTER_COPIES * spatial * groups * shape[-1] * 4)


#: Layers whose weight gradient is Conv2DBackpropFilter (Conv1D runs as a 2-D convolution)
_TF_OWN_CPU_GRAD_KINDS = {"Conv1D", "Conv2D", "Convolution1D", "Convolution2D"}

_CONV_KINDS = {"Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2D", "DepthwiseConv1D", "SeparableConv1D",
               "SeparableConv2D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose"}


class _Node:
    """A layer application: its inputs and outputs as graph tensor ids and per-sample sizes."""

    def __init__(self, name, layer, inputs, outputs, in_sizes, out_sizes, in_shapes, out_shapes):
        self.name, self.layer = name, layer
        self.inputs, self.outputs = inputs, outputs
        self.in_sizes, self.out_sizes = in_sizes, out_sizes
        self.in_shapes, self.out_shapes = in_shapes, out_shapes


# ---------------------------------------------------------------- Keras 2 / 3 access

def _layer_of(node):
    return getattr(node, "operation", None) or getattr(node, "layer")


def _node_inputs(node) -> list:
    ins = getattr(node, "keras_inputs", None)  # Keras 2: a flat list
    if ins is None:
        ins = getattr(node, "input_tensors", None) or []  # Keras 3
    return _flatten(ins)


def _flatten(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flatten(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in _flatten(item)]
    return [x]


def _node_outputs(node) -> list:
    outs = getattr(node, "output_tensors", None)
    if outs is None:
        outs = node.outputs
    return _flatten(outs)


def _key(t) -> Tuple[str, int, int]:
    h = t._keras_history
    return (h[0].name, int(h[1]), int(h[2]))


def _shape(t) -> Tuple[Optional[int], ...]:
    shp = t.shape
    dims = getattr(shp, "dims", None)
    if dims is not None and not isinstance(shp, tuple):
        return tuple(getattr(d, "value", d) for d in shp)
    return tuple(shp)


def _dtype_name(t) -> str:
    d = getattr(t, "dtype", "float32")
    return getattr(d, "name", None) or str(d)


def _graph_nodes(model) -> Optional[list]:
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


def _model_io(model):
    inner = getattr(model, "_functional", None)
    m = inner if inner is not None else model
    return _flatten(m.inputs), _flatten(m.outputs)


def _is_graph_model(layer) -> bool:
    return _graph_nodes(layer) is not None and hasattr(layer, "inputs") and getattr(layer, "inputs", None)


def _weights(layer):
    return list(getattr(layer, "weights", []) or [])


def _trainable_weights(layer):
    return list(getattr(layer, "trainable_weights", []) or [])


def _numel(shape) -> int:
    return int(math.prod(int(d) for d in shape)) if len(shape) else 1


def _act_name(fn) -> str:
    if fn is None:
        return "linear"
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return str(name).lower()


# ---------------------------------------------------------------- rules

class _Rule:
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


def _activation(rule: _Rule, fn, out_size: int, internal_pre: bool) -> None:
    """Add what activation ``fn`` keeps. ``internal_pre``: the activation's input is a
    temporary inside the layer (Dense(activation=...)), not one of the layer's inputs."""
    name = _act_name(fn)
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


def _rnn_rule(rule: _Rule, layer, node: _Node, cb: int, directions: int = 1) -> None:
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
    for w in _trainable_weights(cell)[:2]:
        rule.backward_fixed.extend([_numel(w.shape) * 4] * counted)
        partial += _numel(w.shape) * 4
    if most > counted and partial:
        dirs = directions
        rule.note = (f"{kind} backward loop: per-timestep partial weight gradients in flight counted as "
                     f"{counted} per weight, but TensorFlow may run up to {most} iterations "
                     f"at once: the peak can be up to "
                     f"{(most - counted) * partial * dirs / 2**20:.1f} MiB higher")


def _mha_rule(rule: _Rule, layer, node: _Node, cb: int) -> None:
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


def _tfop_rule(rule: _Rule, layer, node: _Node) -> None:
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


def _rule_for(layer, node: _Node, prec: Precision, device: str = "gpu") -> _Rule:
    r = _Rule()
    kind = type(layer).__name__
    out0 = node.out_sizes[0] if node.out_sizes else 0
    cb = prec.compute_bytes
    act = getattr(layer, "activation", None)
    if kind in ("Dense", "EinsumDense", "Conv1D", "Conv2D", "Conv3D", "Convolution1D", "Convolution2D",
                "Convolution3D", "DepthwiseConv1D", "DepthwiseConv2D", "Conv1DTranspose", "Conv2DTranspose",
                "Conv3DTranspose", "Convolution2DTranspose", "LocallyConnected1D", "LocallyConnected2D"):
        r.keep_in.add(0)  # the weight gradient (and the input gradient's transpose) read the input
        _activation(r, act, out0, internal_pre=True)
        _grouped_conv_rule(r, layer, node, device)
        if device == "cpu" and cb == 2 and kind in _TF_OWN_CPU_GRAD_KINDS and not onednn_has_16bit(_compute16(prec)):
            col = _cpu_conv_col_buffer(layer, node, cb)
            if col:
                r.backward_fixed.append(col)
    elif kind in ("SeparableConv1D", "SeparableConv2D", "SeparableConvolution2D"):
        r.keep_in.add(0)
        filters = int(getattr(layer, "filters", 1) or 1)
        in_ch = int(node.in_shapes[0][-1] or 1)
        dm = int(getattr(layer, "depth_multiplier", 1) or 1)
        r.kept_extra.append(out0 // filters * in_ch * dm)  # depthwise output, read by the pointwise conv
        _activation(r, act, out0, internal_pre=True)
    elif kind in ("BatchNormalization", "SyncBatchNormalization"):
        r.keep_in.add(0)  # FusedBatchNormGrad reads x (and per-channel statistics)
    elif kind in ("LayerNormalization", "GroupNormalization", "UnitNormalization", "RMSNormalization"):
        r.keep_in.add(0)
        r.kept_extra.append(out0)  # the normalised tensor, read by the gamma product
        r.temps.append(out0)
    elif kind in ("Activation", "ReLU", "ELU", "Softmax", "LeakyReLU", "PReLU", "ThresholdedReLU"):
        if kind == "ReLU":
            slope = float(getattr(layer, "negative_slope", 0.0) or 0.0)
            thr = float(getattr(layer, "threshold", 0.0) or 0.0)
            r.keep_out.add(0) if (slope == 0 and thr == 0) else r.keep_in.add(0)
        elif kind in ("ELU", "Softmax"):
            r.keep_out.add(0)
        elif kind in ("LeakyReLU", "PReLU", "ThresholdedReLU"):
            r.keep_in.add(0)
        else:
            _activation(r, act, out0, internal_pre=False)
    elif kind in ("Add", "Subtract", "Average", "Concatenate", "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D",
                  "Cropping1D", "Cropping2D", "Cropping3D", "Permute", "RepeatVector", "UpSampling1D",
                  "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalAveragePooling3D",
                  "AveragePooling1D", "AveragePooling2D", "AveragePooling3D", "Rescaling", "Resizing",
                  "CenterCrop", "RandomFlip", "RandomCrop", "RandomRotation", "RandomZoom",
                  "RandomTranslation", "RandomContrast", "Masking", "ActivityRegularization",
                  "GaussianNoise", "CategoryEncoding", "Identity"):
        if kind == "Average":
            pass
    elif kind in ("UpSampling2D", "UpSampling3D"):
        if str(getattr(layer, "interpolation", "nearest")) != "nearest":
            r.keep_in.add(0)
    elif kind in ("Reshape", "Flatten"):
        r.alias = True
    elif kind in ("Multiply", "Maximum", "Minimum", "Dot"):
        r.keep_in.update(range(len(node.inputs)))
    elif kind in ("MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "GlobalMaxPooling1D", "GlobalMaxPooling2D",
                  "GlobalMaxPooling3D"):
        r.keep_in.add(0)
        r.keep_out.add(0)  # MaxPoolGrad reads the input and the output
    elif kind in ("Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "AlphaDropout",
                  "GaussianDropout"):
        rate = float(getattr(layer, "rate", 0.0) or 0.0)
        if rate > 0:
            if getattr(layer, "noise_shape", None) is not None or kind.startswith("Spatial"):
                # a broadcast mask: x * mask, whose gradient reads x (the mask itself is small)
                r.keep_in.add(0)
            else:
                numel = out0 // max(cb, 1) if node.out_sizes else 0
                r.kept_extra.append(numel * BOOL_MASK_BYTES)  # SelectV2's gradient reads the keep mask
            r.temps.extend([out0, out0])  # the uniform sample and the scaled input
    elif kind == "Normalization":
        r.keep_in.add(0)
    elif kind == "Embedding":
        # the gradient is an IndexedSlices of the looked-up rows: batch-sized, not table-sized
        r.extra_grad_per_sample = out0
    elif kind in ("LSTM", "GRU", "SimpleRNN", "RNN", "ConvLSTM2D"):
        _rnn_rule(r, layer, node, cb)
    elif kind == "Bidirectional":
        fwd = getattr(layer, "forward_layer", None) or getattr(layer, "layer", None)
        _rnn_rule(r, fwd, node, cb, directions=2)
        r.kept_extra[:] = r.kept_extra * 2
        r.backward_temps[:] = [2 * x for x in r.backward_temps]
        r.backward_fixed[:] = r.backward_fixed * 2  # each direction's loop sums its own partials
    elif kind == "TimeDistributed":
        inner = getattr(layer, "layer", None)
        sub = _rule_for(inner, node, prec, device) if inner is not None else r
        return sub
    elif kind == "MultiHeadAttention":
        _mha_rule(r, layer, node, cb)
    elif kind == "LayerScale":
        # x * gamma (ConvNeXt): gamma's gradient reads x, x's gradient reads only gamma
        r.keep_in.add(0)
    elif kind == "CustomScaleLayer":
        # inputs[0] + inputs[1] * scale with a constant scale (Inception-ResNet): reads nothing back
        pass
    elif kind in ("TFOpLambda", "SlicingOpLambda"):
        _tfop_rule(r, layer, node)
    elif kind == "InputLayer":
        pass
    else:
        r.keep_in.update(range(len(node.inputs)))
        r.keep_out.update(range(len(node.outputs)))
        r.note = (f"no sizing rule for layer type {kind}; fallback: assumed it keeps its inputs and "
                  f"outputs for the backward pass")
    return r


# ---------------------------------------------------------------- graph building

class _Builder:
    def __init__(self, prec: Precision, override_dtype: bool, device: str = "gpu"):
        self.g = Graph()
        self.device = device
        self.prec = prec
        self.override = override_dtype
        self.ids: Dict[Tuple[str, int, int], int] = {}
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
            self.trainable_cache[key] = _trainable_weights(layer)
        return self.trainable_cache[key]

    def tensor_bytes(self, t) -> Tuple[int, Tuple]:
        k = _key(t)
        hit = self.sizes.get(k)
        if hit is None:
            hit = self.sizes[k] = self._tensor_bytes(t)
        return hit

    def _tensor_bytes(self, t) -> Tuple[int, Tuple]:
        shape = _shape(t)
        dims = shape[1:] if len(shape) else ()
        unknown = [i for i, d in enumerate(dims, 1) if d is None]
        if unknown:
            raise ConfigError(f"tensor {getattr(t, 'name', '?')} has an unknown size in dimension(s) {unknown} "
                              f"(shape {shape}); build the model with a full input shape, e.g. "
                              f"keras.Input(shape=(128, 64)) or --input-shape 128,64")
        name = _dtype_name(t)
        b = dtype_bytes(name)
        if self.override and name in ("float32", "float16", "bfloat16"):
            b = self.prec.compute_bytes
        return _numel(dims) * b, shape

    def tid(self, t) -> int:
        k = _key(t)
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

    def add_model(self, model, prefix: str = "", mapping: Optional[Dict[Tuple, int]] = None) -> None:
        nodes = _graph_nodes(model)
        if nodes is None:
            raise ConfigError(f"model {getattr(model, 'name', type(model).__name__)} has no layer graph "
                              f"(a subclassed Model); build it with the functional API or Sequential, or "
                              f"estimate the layers you can express functionally")
        for node in nodes:
            layer = _layer_of(node)
            ins, outs = _node_inputs(node), _node_outputs(node)
            if getattr(node, "is_input", False) or type(layer).__name__ == "InputLayer":
                for t in outs:
                    k = _key(t)
                    if mapping is not None and k in mapping:
                        self.ids[k] = mapping[k]
                    else:
                        tid = self.tid(t)
                        if tid not in self.g.inputs:
                            self.g.inputs = (*self.g.inputs, tid)
                continue
            if _is_graph_model(layer):
                inner_ins, inner_outs = _model_io(layer)
                inner_map = {_key(it): self.tid(ot) for it, ot in zip(inner_ins, ins)}
                self.add_model(layer, prefix + layer.name + "/", inner_map)
                for it, ot in zip(inner_outs, outs):
                    self.ids[_key(ot)] = self.g.add(0, alias=self.ids[_key(it)])
                continue
            self.add_node(layer, prefix + layer.name, ins, outs)

    def add_node(self, layer, name: str, ins, outs) -> None:
        in_ids = [self.tid(t) for t in ins]
        in_sizes, in_shapes = zip(*[self.tensor_bytes(t) for t in ins]) if ins else ((), ())
        out_info = [self.tensor_bytes(t) for t in outs]
        out_sizes = [s for s, _ in out_info]
        out_shapes = [s for _, s in out_info]
        node = _Node(name, layer, in_ids, list(range(len(outs))), list(in_sizes), out_sizes, list(in_shapes),
                     out_shapes)
        rule = _rule_for(layer, node, self.prec, self.device)
        out_ids = []
        for j, t in enumerate(outs):
            k = _key(t)
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
            cast = self.g.add(0, sum(_numel(w.shape) for w in tw) * self.prec.compute_bytes)
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
        self.rows[row].dtype = _dtype_name(outs[0]) if outs else self.rows[row].dtype
        if self.override and self.rows[row].dtype in ("float32", "float16", "bfloat16"):
            self.rows[row].dtype = {2: "float16" if self.prec.name.endswith("float16") else "bfloat16",
                                    4: "float32"}[self.prec.compute_bytes]


def _policy_precision(model) -> Precision:
    names = set()
    for layer in getattr(model, "layers", []) or []:
        pol = getattr(layer, "dtype_policy", None)
        names.add(str(getattr(pol, "name", pol) or "float32"))
    for n in ("mixed_float16", "mixed_bfloat16"):
        if n in names:
            return resolve_precision(n)
    return resolve_precision(None)


def estimate_keras(model: Any, batch_size: int = 32, optimizer: Any = "adam", *,
                   precision: Any = None, loss_scale: Optional[bool] = None, device: str = "gpu",
                   calibrate: Any = False, name: Optional[str] = None) -> Estimate:
    """Per-layer training memory of a built Keras model at ``batch_size``.

    ``optimizer``: the optimizer object you train with (its slots are read from a private copy of
    it) or a name (``"adam"``, ``"sgd"``, ``"momentum"``, ``"rmsprop"``, ``"adagrad"``...).
    ``precision``: ``None`` reads the model's dtype policy; ``"mixed_float16"`` /
    ``"mixed_bfloat16"`` / ``"float32"`` override it (fp16/bf16 compute, fp32 master weights).
    ``loss_scale``: whether gradients are unscaled as one group (default: with mixed_float16 or a
    LossScaleOptimizer). ``device``: whose allocator the peak models — ``"gpu"`` counts every
    buffer; ``"cpu"`` models what ``tf.config.experimental.get_memory_info('CPU:0')`` reports,
    which leaves out buffers below :data:`TF_CPU_UNCOUNTED_BELOW` (the accuracy benchmark's mode).
    ``calibrate``: ``True`` runs a few training steps of a copy of the model at a small batch on
    CPU (:func:`distmem.estimate.profile.measure_keras_step`) and adds what the analytic replay of
    that step missed (never subtracts); a dict ``{"batch": b, "peak": bytes}`` supplies a
    measurement instead. Method ``"calibrated"``; costs one traced step (seconds).
    """
    if batch_size is None or int(batch_size) < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    batch_size = int(batch_size)
    if not hasattr(model, "layers"):
        raise ConfigError(f"estimate_keras needs a built Keras model, got {type(model).__name__}")
    if not getattr(model, "built", True) or not getattr(model, "inputs", None):
        raise ConfigError(f"Keras model {getattr(model, 'name', '?')} is not built with known inputs; build it "
                          f"with keras.Input(shape=...) or call model.build((None, ...)) first")
    device = str(device).lower()
    if device not in ("gpu", "cuda", "cpu"):
        raise ConfigError(f"device must be 'gpu' or 'cpu', got {device!r}")
    device = "cpu" if device == "cpu" else "gpu"
    min_alloc = tf_cpu_uncounted_below() if device == "cpu" else 0
    prec = resolve_precision(precision) if precision is not None else _policy_precision(model)
    override = precision is not None
    opt_info, opt_obj = keras_optimizer(optimizer)
    update_temps = keras_update_temporaries(opt_obj, keras_major_version())
    early_temps = min(update_temps, keras_early_update_temporaries(opt_obj))
    decays = keras_decays_weights(opt_obj)
    if loss_scale is None:
        loss_scale = prec.loss_scaling or "scaled" in opt_info.source

    b = _Builder(prec, override, device)
    b.add_model(model)
    g = b.g
    _, model_outs = _model_io(model)
    out_ids = [b.ids[_key(t)] for t in model_outs]
    # the loss: reads the model outputs, keeps ~2 output-sized fp32 tensors for its gradient
    loss_row = len(b.rows)
    numel_out = sum(int(_numel(_shape(t)[1:])) for t in model_outs)
    loss_keep = g.add(LOSS_KEPT_FACTOR * numel_out * 4)
    loss_out = g.add(0, 4)
    g.nodes.append(Node(row=loss_row, inputs=tuple(out_ids), outputs=(loss_out,), saved=(loss_keep,),
                        temps=(loss_keep,)))

    # weights, gradients, optimizer state per row; each variable, slot, gradient and update
    # temporary is its own allocation in the replay (so allocator rounding applies to each)
    weights_alloc: List[int] = []
    slots_alloc: List[int] = []
    # rows whose backward computes an input gradient (something upstream is trainable)
    grad_tensors = needs_gradient(g)
    input_grad_rows = {node.row for node in g.nodes if any(g.root(t) in grad_tensors for t in node.inputs)}
    seen_vars = set()
    first_node = {}
    for k, node in enumerate(g.nodes):
        first_node.setdefault(node.row, k)
    for row, layer in enumerate(b.layer_objs):
        r = b.rows[row]
        trainable_ids = {id(w) for w in b.trainable_of(layer)}
        # decoupled weight decay copies a variable whose forward read the backward still holds:
        # a kernel (rank >= 2) of a layer whose input gradient is computed (something upstream is
        # trainable) and not an embedding table (its gradient reads only the looked-up rows)
        copies_on_decay = decays and row in input_grad_rows and type(layer).__name__ != "Embedding"
        grads: List[int] = []
        update: List[int] = []
        early: List[int] = []
        copies: List[int] = []
        for w in _weights(layer):
            if id(w) in seen_vars:
                continue  # a shared weight is stored once
            seen_vars.add(id(w))
            shape = tuple(int(d) for d in w.shape)
            n = _numel(shape)
            wb = dtype_bytes(_dtype_name(w))
            r.params += n
            r.param_bytes += n * wb
            weights_alloc.append(n * wb)
            if id(w) in trainable_ids:
                r.trainable_params += n
                r.grad_bytes += n * wb
                slots = opt_info.slot_elements(shape)
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
                update.extend([n * wb] * (update_temps - early_temps))
                early.extend([n * wb] * early_temps)
                if copies_on_decay and len(shape) >= 2:
                    copies.append(n * wb)
                if prec.cast_weights and n * wb >= 4 * n:
                    # the gradient arrives in the compute dtype and is cast to the fp32 master's
                    update.append(n * prec.compute_bytes)
        if row in first_node:
            g.nodes[first_node[row]].grads = tuple(grads)
            g.nodes[first_node[row]].update_temps = tuple(update)
            g.nodes[first_node[row]].early_update_temps = tuple(early)
            g.nodes[first_node[row]].held_read_copies = tuple(copies)
    g.persistent = weights_alloc + slots_alloc
    g.persistent_parts = ["weights"] * len(weights_alloc) + ["optimizer state"] * len(slots_alloc)
    g.update_overlap = KERAS_UPDATE_OVERLAP

    input_per_sample = sum(g.tensors[t].per_sample for t in g.inputs)
    label = g.add(8 * max(1, len(model_outs)))  # int64 class labels, held by the caller
    g.inputs = (*g.inputs, label)
    held = bool(loss_scale)

    extra = [0]

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

    rows = b.rows
    # kept activations per row, from replays at batch 1 and 2 (fixed + per-sample), all counted
    r1 = replay(g, 1, grads_held=held, saved_only=True)
    r2 = replay(g, 2, grads_held=held, saved_only=True)
    for row, r in enumerate(rows):
        a1, a2 = r1.saved_by_row.get(row, 0), r2.saved_by_row.get(row, 0)
        r.activation_bytes_per_sample = a2 - a1
        r.activation_fixed_bytes = a1 - (a2 - a1)
        r.workspace_bytes_per_sample = b.per_row_temps.get(row, 0)
    if rows:  # the loss's kept tensors travel with the last layer
        rows[-1].activation_bytes_per_sample += r2.saved_by_row.get(loss_row, 0) - r1.saved_by_row.get(loss_row, 0)

    compute16 = _compute16(prec)
    if device == "cpu" and prec.compute_bytes == 2 and not onednn_has_16bit(compute16):
        convs = [r.name for r in b.rows if r.kind in _CONV_KINDS]
        if convs:
            b.notes.append(
                f"{compute16} convolutions on TensorFlow's own CPU kernels ({len(convs)} layers, e.g. '{convs[0]}'; "
                f"oneDNN has no {compute16} kernels on this CPU): each weight gradient's column buffer (up to "
                f"30 MiB) is counted, but the input gradients' buffers, which run beside them, and the allocator "
                f"fragmentation they cause are not, so this CPU peak can be low by tens of MiB (measured up to 32% "
                f"on DenseNet-121 in bfloat16); GPU kernels (cuDNN) are sized by the GPU footprint")
    est = Estimate(framework="keras", model=name or getattr(model, "name", "model"), batch_size=batch_size,
                   precision=prec.name, optimizer=opt_info.to_dict(), layers=rows, method="analytic",
                   device=device, input_bytes_per_sample=input_per_sample, warnings=list(b.notes),
                   _peak_fn=peak_fn, _parts_fn=parts_fn)
    for note in b.notes:
        warnings.warn(f"distmem.estimate: {note}", stacklevel=2)
    if calibrate:
        from .profile import calibration_batch, measure_keras_step
        point = calibrate if isinstance(calibrate, dict) else \
            measure_keras_step(model, calibration_batch(batch_size), optimizer)
        cpu_floor = tf_cpu_uncounted_below()
        analytic = replay(g, int(point["batch"]), grads_held=held, allocator=BFCAllocator(cpu_floor), steps=2).peak
        extra[0] = max(0, int(point["peak"]) - int(analytic))
        est.method = "calibrated"
        est.calibration = {"batch": int(point["batch"]), "measured_cpu_peak": int(point["peak"]),
                           "analytic_cpu_peak": int(analytic), "added_bytes": extra[0]}
    return est
