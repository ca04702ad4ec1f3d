"""Where CUDA runs another kernel than the meta device would, the CUDA one: cuDNN convolution
workspaces, the fused dropout's one-byte mask, the fused scaled dot-product attention kernels
(and the math kernel where CUDA has no fused one)."""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

from ...units import MiB
from .inputs import import_torch

__all__ = ["CUBLAS_WORKSPACE_BYTES", "CUBLAS_WORKSPACES", "CUDNN_ROWS_PER_PARTIAL", "split_k_partials", "cudnn_workspace", "CudaDropout", "fused_sdpa"]

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
      and weight: their bytes together (float32 only: fp16/bf16 kernels of this kind took none,
      except a first layer's weight gradient, not modelled).

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
    if pointwise:
        half = x.dtype == import_torch().float16  # fp16 layers took other engines (ShuffleNet's, MobileNetV3's)
        if not need_weight_grad or half:
            return 0
        return split_k_partials(x) * w.numel() * 4
    if x.dtype != _float32():
        return 0  # half-precision kernels read NCHW as it is
    if grad_out is None:
        out_numel = x.shape[0] * w.shape[0]
        for i, size in enumerate(x.shape[2:]):
            k = (w.shape[2 + i] - 1) * args[5][i] + 1  # dilated kernel
            out_numel *= (size + 2 * padding[i] - k) // stride[i] + 1
        return nbytes(x) + out_numel * x.element_size() + nbytes(w)
    return nbytes(x) + nbytes(grad_out) + nbytes(w)


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


@contextlib.contextmanager
def fused_sdpa(enabled: bool, autocast: Any = None):
    """Route scaled dot-product attention to the fused kernel CUDA runs (memory-efficient
    attention keeps the output and a log-sum-exp, not the score matrix); the meta device would
    otherwise take the math fallback, which keeps the full score matrix."""
    torch = import_torch()
    F = torch.nn.functional
    original = F.scaled_dot_product_attention
    if not enabled:
        yield
        return

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if autocast is not None and autocast.enabled:  # autocast runs attention in the compute dtype
            query, key, value = (autocast._cast(t, autocast.dtype) for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = autocast._cast(attn_mask, autocast.dtype)
        if enable_gqa and query.dim() == 4 and key.shape[1] != query.shape[1]:
            # the fused kernels read grouped K/V in place; the same kept bytes as attention over them
            return _gqa_sdpa(original, query, key, value, attn_mask, dropout_p, is_causal, scale)
        if attn_mask is not None and attn_mask.requires_grad and query.dim() == 4:
            # a learned additive bias (T5's relative positions) that needs its gradient: modelled as
            # the math kernel, which keeps the score matrix (the fused kernels do not)
            return _math_sdpa(autocast, query, key, value, attn_mask, dropout_p, is_causal, scale)
        if query.dim() != 4 or (attn_mask is not None and attn_mask.dim() != 4):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale)
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
    """``_scaled_dot_product_attention_math`` step by step, as CUDA runs it: its dropout is a
    bool mask, and half-precision inputs (autocast's casts) are computed in float32 (torch
    2.5+, unless ``allow_fp16_bf16_reduction_math_sdp(True)``): the kept score matrix,
    softmax and dropout output are fp32, the result cast back. It also returns the
    attention weights in the inputs' dtype, a copy freed at once."""
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
        attn = torch.matmul(query * s, (key * s).transpose(-2, -1))
        if is_causal:
            causal = torch.ones(attn.shape[-2], attn.shape[-1], dtype=torch.bool, device=attn.device).tril()
            attn = attn.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            attn = attn + (attn_mask if attn_mask.dtype != torch.bool else
                           torch.zeros(attn_mask.shape, dtype=attn.dtype, device=attn.device))
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


def _gqa_sdpa(original, query, key, value, attn_mask, dropout_p, is_causal, scale):
    torch = import_torch()
    if attn_mask is None:
        try:  # flash attention reads grouped K/V as they are, keeping the output and a log-sum-exp
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        except Exception:
            pass
    return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=True)
