"""What TensorFlow's kernels allocate beyond a layer's rule: the CPU allocator's uncounted pool,
oneDNN's 16-bit support, TensorFlow's own CPU convolution gradients and the XLA-compiled grouped
convolutions. Each constant says how it was measured."""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from ..precision import Precision
from .access import numel

if TYPE_CHECKING:  # the rules module imports this one
    from .rules import LayerNode, Rule

__all__ = ["TF_CPU_UNCOUNTED_BELOW", "tf_cpu_uncounted_below", "XLA_CPU_DEPTHWISE_FILTER_COPIES",
           "XLA_CPU_GROUPED_CONV_INPUT_TEMPS", "XLA_GROUPED_CONV_INPUT_COPIES", "TF_CPU_CONV_GRAD_WORKING_SET",
           "compute16", "onednn_has_16bit", "cpu_conv_col_buffer", "grouped_conv_rule",
           "TF_OWN_CPU_GRAD_KINDS", "CONV_KINDS"]


#: TensorFlow's CPU allocator with oneDNN (on by default on x86 Linux) serves requests below
#: 256 KiB from a separate small-size pool whose bytes ``get_memory_info('CPU:0')`` does not
#: report; only larger buffers (its BFC pool) are counted. Measured on TF 2.15: fifty 240,000-byte
#: tensors read as 0 bytes in use, fifty 262,144-byte ones as 13,107,200. With
#: ``TF_CPU_ALLOCATOR_USE_BFC=true`` (which distmem's TensorFlow adapter sets) one BFC allocator
#: serves and counts every buffer: the same fifty small tensors read as 12,294,400.
TF_CPU_UNCOUNTED_BELOW = 256 * 1024


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def tf_cpu_uncounted_below() -> int:
    """Bytes below which TensorFlow's CPU allocator statistics skip a buffer: 0 under the BFC CPU
    allocator (``TF_CPU_ALLOCATOR_USE_BFC``) or without oneDNN, else :data:`TF_CPU_UNCOUNTED_BELOW`."""
    if _env_true("TF_CPU_ALLOCATOR_USE_BFC"):
        return 0
    return 0 if os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip() in ("0", "false", "False") \
        else TF_CPU_UNCOUNTED_BELOW

#: The loss keeps about two output-sized fp32 tensors for its gradient: the softmax


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


def compute16(prec: Precision) -> str:
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


def cpu_conv_col_buffer(layer, node: "LayerNode", itemsize: int) -> int:
    """Bytes of the column buffer TensorFlow's own CPU kernel allocates for the weight gradient of
    convolution ``layer`` (see :data:`TF_CPU_CONV_GRAD_WORKING_SET`); 0 where it does not apply."""
    kernel = getattr(layer, "kernel", None)
    if kernel is None or int(getattr(layer, "groups", 1) or 1) > 1 or not node.out_shapes:
        return 0
    kshape = tuple(int(d) for d in kernel.shape)
    if len(kshape) not in (3, 4):
        return 0
    ft, cout = numel(kshape[:-1]), kshape[-1]
    out = node.out_shapes[0]
    fmt = str(getattr(layer, "data_format", "channels_last") or "channels_last")
    spatial = out[2:] if fmt == "channels_first" else out[1:-1]
    out_img = numel(tuple(int(d or 1) for d in spatial))
    work = out_img * ft + out_img * cout + ft * cout
    shard = -(-(TF_CPU_CONV_GRAD_WORKING_SET // itemsize) // max(1, work))
    return shard * out_img * ft * itemsize


def grouped_conv_rule(rule: "Rule", layer, node: "LayerNode", device: str) -> None:
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
    spatial = numel(shape[:-2])
    rule.backward_fixed.append(XLA_CPU_DEPTHWISE_FILTER_COPIES * spatial * groups * shape[-1] * 4)


#: Layers whose weight gradient is Conv2DBackpropFilter (Conv1D runs as a 2-D convolution)
TF_OWN_CPU_GRAD_KINDS = {"Conv1D", "Conv2D", "Convolution1D", "Convolution2D"}

CONV_KINDS = {"Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2D", "DepthwiseConv1D", "SeparableConv1D",
               "SeparableConv2D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose"}
