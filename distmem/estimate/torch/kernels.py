"""Where CUDA runs another kernel than the meta device would, the CUDA one: cuDNN convolution
workspaces, the fused dropout's one-byte mask, the fused scaled dot-product attention kernels
(and the math kernel where CUDA has no fused one for the inputs: see :func:`sdpa_kernel`)."""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

from ...units import MiB
from .inputs import import_torch

__all__ = ["CUBLAS_WORKSPACE_BYTES", "CUBLAS_WORKSPACES", "CUDNN_ROWS_PER_PARTIAL", "split_k_partials", "cudnn_workspace",
           "half_forward_workspace", "POINTWISE_NHWC_WEIGHT",
           "CudaDropout", "EFFICIENT_ATTENTION_GROUPED_KV", "efficient_attention_takes_grouped_kv", "sdpa_kernel", "fused_sdpa"]

#: cuBLAS workspace torch allocates through its caching allocator, so it is part of
#: ``max_memory_allocated``: 32 MiB on Hopper (sm90) by default (CUBLAS_WORKSPACE_CONFIG
#: ``:4096:8``), 8.125 MiB on earlier GPUs (``:4096:2:16:8``). Kept for the life of the process.
CUBLAS_WORKSPACE_BYTES = 32 * MiB

#: One workspace per (cuBLAS handle, stream), and handles are per thread: the forward runs on the
#: Python thread, the backward on autograd's device thread, so a training step holds two.
CUBLAS_WORKSPACES = 2


def _float32() -> Any:
    return import_torch().float32


#: cuDNN's weight gradient of a 1x1 convolution splits its reduction over the batch's N x H x W
#: positions into partial sums (split-K), one float32 weight-sized buffer each, and gives every
#: split at least this many positions: the probes of every 1x1 stride-1 weight gradient of
#: ResNet-50 (fp32, bf16) and ResNeXt-50 on an H200 (bench/results/estimate_cudnn_probe_h200.json)
#: show one partial per image on 28x28 maps and larger, but 4 (fp32) and 2 (bf16) at 7x7 with 32
#: images (1,568 positions), 16 to 32 at 14x14. The constant is the one chosen on both held-out
#: halves of the torch zoo among None / 196 / 392 (bench/results/estimate_heldout_torch.json): at
#: 7x7 it allows 8 partials for 32 images where cuDNN took 2-4, over rather than under. None: one
#: partial per image, the earlier rule.
CUDNN_ROWS_PER_PARTIAL = 196


def split_k_partials(x) -> int:
    """Partial sums cuDNN's split-K keeps for a 1x1 weight gradient over input ``x`` (N, C, H, W...)."""
    n = int(x.shape[0])
    if CUDNN_ROWS_PER_PARTIAL is None:
        return n
    rows = n
    for d in x.shape[2:]:
        rows *= int(d)
    return max(1, min(n, -(-rows // CUDNN_ROWS_PER_PARTIAL)))


def cudnn_workspace(name: str, args: Sequence[Any]) -> int:
    """Bytes of the workspace cuDNN takes for one convolution (``name``: ``convolution`` or
    ``convolution_backward``, with the aten op's arguments), as its heuristic engines choose them
    on NCHW tensors (measured on an H200, cuDNN 9: ``bench/estimate/estimate_zoo_probe.py --ops``):

    * depthwise convolutions run torch's own kernels: none;
    * a 1x1, stride-1 convolution is a GEMM per image: none forward; its weight gradient is summed
      from one float32 partial per image, ``batch x weight elements x 4`` bytes (float32 and
      bfloat16; fp16 layers took engines without them);
    * any other convolution goes through NHWC copies of its input, output (or output gradient)
      and weight: their bytes together (float32 only: fp16/bf16 backward kernels of this kind took
      none, except a first layer's weight gradient, not modelled);
    * forward under fp16/bf16 (:func:`half_forward_workspace`): NHWC copies too, measured on the
      forward of a frozen ResNet-50 (its peak), where the backward-only probes saw none.

    cuDNN picks among engines by its own performance model, so this is the engine it chose for
    most shapes measured, not a rule it keeps (large 1x1 layers on 7x7 maps took the NHWC copies
    instead of the per-image partials, less)."""
    if name == "convolution":
        x, w = args[0], args[1]
        stride, padding, transposed, groups = args[3], args[4], args[6], args[8]
        grad_out, need_weight_grad = None, False
    else:
        grad_out, x, w = args[0], args[1], args[2]
        stride, padding, transposed, groups = args[4], args[5], args[7], args[9]
        mask = args[10] if len(args) > 10 else (True, True, True)
        need_weight_grad = bool(mask[1])
    if transposed or x.dim() < 3:
        return 0
    if groups > 1 and groups == x.shape[1]:
        return 0
    pointwise = all(k == 1 for k in w.shape[2:]) and all(s == 1 for s in stride) and \
        all(p == 0 for p in padding)

    def nbytes(t):
        return t.numel() * t.element_size()
    if grad_out is None and x.dtype != _float32():
        return half_forward_workspace(x, w, stride, padding, args[5], pointwise)
    if pointwise:
        half = x.dtype == import_torch().float16  # fp16 layers took other engines (ShuffleNet's, MobileNetV3's)
        if not need_weight_grad or half:
            return 0
        return split_k_partials(x) * w.numel() * 4
    if x.dtype != _float32():
        return 0  # half-precision kernels read NCHW as it is
    if grad_out is None:
        return nbytes(x) + _conv_out_numel(x, w, stride, padding, args[5]) * x.element_size() + nbytes(w)
    return nbytes(x) + nbytes(grad_out) + nbytes(w)


#: A 1x1, stride-1 half-precision forward convolution went through NHWC copies where its weight
#: had at least this many elements (ResNet-50's last stage: 512x1024, 2048x512, 512x2048), and read
#: NCHW as it is below it (256x1024 and smaller, on every map size): frozen ResNet-50, bf16 and fp16,
#: batches 64 and 128, H200, cuDNN 9 (bench/results/estimate_half_forward_probe_h200.json; held out: _h100.json).
POINTWISE_NHWC_WEIGHT = 1 << 19


def half_forward_workspace(x, w, stride, padding, dilation, pointwise: bool) -> int:
    """Bytes cuDNN holds beside one fp16/bf16 forward convolution's output while it runs, as
    measured (bench/results/estimate_half_forward_probe_h200.json: every convolution of a frozen
    ResNet-50's forward, bf16 and fp16, batches 64 and 128, H200, cuDNN 9; each matched to the byte):
    NHWC copies of its input, its output and its weight in the compute dtype, the input's channels
    padded to a multiple of 8 under bf16 and of 4 under fp16 (the 3-channel stem: 8 and 4); a 1x1,
    stride-1 one only where its weight has :data:`POINTWISE_NHWC_WEIGHT` elements or more. The
    peak this sets is a forward one: a frozen backbone's, or any step whose forward holds the most
    (the backward's probes, above, saw no copies in half precision)."""
    if pointwise and w.numel() < POINTWISE_NHWC_WEIGHT:
        return 0
    torch = import_torch()
    size = x.element_size()
    pad = 8 if x.dtype == torch.bfloat16 else 4
    channels = -(-int(x.shape[1]) // pad) * pad
    x_bytes = x.numel() // max(1, int(x.shape[1])) * channels * size
    return x_bytes + _conv_out_numel(x, w, stride, padding, dilation) * size + w.numel() * size


def _conv_out_numel(x, w, stride, padding, dilation) -> int:
    """Elements of a convolution's output over input ``x`` (N, C, spatial...) and weight ``w``."""
    out = int(x.shape[0]) * int(w.shape[0])
    for i, n in enumerate(x.shape[2:]):
        k = (int(w.shape[2 + i]) - 1) * int(dilation[i]) + 1  # dilated kernel
        out *= (int(n) + 2 * int(padding[i]) - k) // int(stride[i]) + 1
    return out


class CudaDropout:
    """``F.dropout`` as CUDA runs it: the fused ``native_dropout`` kernel, which keeps a one-byte
    mask for the backward pass. On the meta device (as on CPU) ``dropout`` decomposes into a
    Bernoulli draw in the input's dtype, a mask four times larger in fp32."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if getattr(func, "__name__", "") == "dropout":
                    torch = import_torch()
                    x = args[0] if args else kwargs.get("input")
                    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
                    train = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
                    inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
                    if torch.is_tensor(x) and train and 0 < float(p) < 1 and not inplace and x.numel() > 0:
                        return torch.native_dropout(x, float(p), True)[0]
                return func(*args, **kwargs)
        self.mode = Mode()


#: Whether CUDA's memory-efficient attention takes grouped K/V: None asks the torch installed
#: (:func:`efficient_attention_takes_grouped_kv`); True / False say it for another torch (the
#: tests price both).
EFFICIENT_ATTENTION_GROUPED_KV: Optional[bool] = None


def efficient_attention_takes_grouped_kv() -> bool:
    """Whether this torch's CUDA memory-efficient attention reads grouped K/V (``enable_gqa``) as
    they are. Until it did, grouped K/V in float32 (which flash attention does not take) left CUDA
    only the math kernel: on an H200 with torch 2.11, Mistral- and Qwen2-style decoders in float32
    held 0.55-0.64 GiB more than the fused kernel keeps, the same at every N
    (bench/results/sharded_door_h200.json). torch says so in ``scaled_dot_product_attention``'s
    own documentation from the release that added it (2.14 documents it; 2.11 did not), read here
    rather than a version number guessed."""
    if EFFICIENT_ATTENTION_GROUPED_KV is not None:
        return bool(EFFICIENT_ATTENTION_GROUPED_KV)
    doc = getattr(import_torch().nn.functional.scaled_dot_product_attention, "__doc__", None) or ""
    return "Memory-efficient attention also supports" in " ".join(doc.split())


def sdpa_kernel(query, key, attn_mask, enable_gqa: bool, grouped_efficient: bool) -> str:
    """The kernel CUDA's ``scaled_dot_product_attention`` runs on 4-D inputs, as its dispatcher
    picks it (flash, then memory-efficient, then math): ``"flash"`` for half precision without a
    mask, ``"efficient"`` for any floating dtype with or without a mask, ``"math"`` where neither
    takes the inputs: grouped K/V (fewer key heads than query heads under ``enable_gqa``) that flash
    cannot take (float32, a mask) while the efficient kernel takes none (``grouped_efficient``
    false: :func:`efficient_attention_takes_grouped_kv`), or a mask that needs its gradient (a
    learned bias, which only the math kernel differentiates)."""
    torch = import_torch()
    if attn_mask is not None and attn_mask.requires_grad:
        return "math"
    half = query.dtype in (torch.float16, torch.bfloat16)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        if half and attn_mask is None and query.shape[-1] <= 256:
            return "flash"
        return "efficient" if grouped_efficient else "math"
    return "flash" if half and attn_mask is None and query.shape[-1] <= 256 else "efficient"


@contextlib.contextmanager
def fused_sdpa(enabled: bool, autocast: Any = None):
    """Route scaled dot-product attention to the kernel CUDA runs (:func:`sdpa_kernel`): the fused
    kernels keep the output and a log-sum-exp, not the score matrix, which the meta device's math
    fallback would keep; where CUDA itself runs the math kernel, the math kernel as CUDA runs it."""
    torch = import_torch()
    F = torch.nn.functional
    original = F.scaled_dot_product_attention
    if not enabled:
        yield
        return
    grouped_efficient = efficient_attention_takes_grouped_kv()

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if autocast is not None and autocast.enabled:  # autocast runs attention in the compute dtype
            query, key, value = (autocast._cast(t, autocast.dtype) for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = autocast._cast(attn_mask, autocast.dtype)
        if query.dim() != 4 or key.dim() != 4 or (attn_mask is not None and attn_mask.dim() != 4):
            more = {"enable_gqa": True} if enable_gqa else {}
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, **more)
        kernel = sdpa_kernel(query, key, attn_mask, enable_gqa, grouped_efficient)
        grouped = enable_gqa and key.shape[1] != query.shape[1]
        if kernel == "math":
            if grouped:  # the math kernel repeats each key/value head for its query heads (copies)
                key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
                value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
            return _math_sdpa(autocast, query, key, value, attn_mask, dropout_p, is_causal, scale)
        if kernel == "flash" and grouped:
            # flash attention reads grouped K/V as they are, keeping the output and a log-sum-exp
            try:
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, is_causal, False, scale=scale)[0]
            except Exception:  # a torch whose meta kernel for it refuses grouped K/V: the caller's own call
                return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                scale=scale, enable_gqa=True)
        return _efficient_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale)
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _efficient_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale):
    torch = import_torch()
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:
        # CUDA turns a boolean mask into an additive bias in the query's dtype, which the kernel keeps
        bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device)
    elif bias is not None and bias.dtype != query.dtype:
        bias = bias.to(query.dtype)
    grad = query.requires_grad or key.requires_grad or value.requires_grad
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, grad, dropout_p, is_causal, scale=scale)
    return out[0]


def _math_sdpa(autocast, query, key, value, attn_mask, dropout_p, is_causal, scale):
    """``_scaled_dot_product_attention_math`` step by step, as CUDA runs it: the query and the
    (repeated) key each scaled by the root of the scale, the score matrix with the mask (a causal
    one made as a float matrix) added in place, a safe softmax (its result kept; beside it a softmax
    output and an ``-inf`` mask while it runs), its dropout a bool mask; half-precision inputs
    (autocast's casts) are computed in float32 (torch 2.5+, unless
    ``allow_fp16_bf16_reduction_math_sdp(True)``): the kept score matrix, softmax and dropout
    output are fp32, the result cast back. It also returns the attention weights in the inputs'
    dtype, a copy freed at once."""
    import math
    torch = import_torch()
    was = autocast.enabled if autocast is not None else None
    if autocast is not None:
        autocast.enabled = False  # inside autocast's sdpa kernel nothing is cast again
    try:
        origin = query.dtype
        allowed = getattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", lambda: True)()
        if origin in (torch.float16, torch.bfloat16) and not allowed:
            query, key, value = query.float(), key.float(), value.float()
        s = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
        attn = torch.matmul(query * s, key.transpose(-2, -1) * s)
        if is_causal:
            causal = torch.ones(attn.shape[-2], attn.shape[-1], dtype=torch.bool, device=attn.device).tril()
            attn_mask = causal
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:  # made an additive float mask first
                attn_mask = torch.zeros(attn_mask.shape, dtype=attn.dtype, device=attn.device)
            attn.add_(attn_mask)
        safe = getattr(torch.ops.aten, "_safe_softmax", None)
        if safe is not None:
            # while it runs: softmax's output and the rows' -inf mask beside the result
            during = (torch.empty_like(attn), torch.empty(attn.shape, dtype=torch.bool, device=attn.device))
            attn = safe(attn, -1)
            del during
        else:
            attn = torch.softmax(attn, dim=-1)
        if dropout_p > 0:
            attn = torch.native_dropout(attn, float(dropout_p), True)[0]
        out = torch.matmul(attn, value)
        if out.dtype != origin:
            attn.detach().to(origin)  # the weights the kernel returns beside its output, unused
            out = out.to(origin)
        return out
    finally:
        if autocast is not None:
            autocast.enabled = was
