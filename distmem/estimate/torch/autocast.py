"""CUDA autocast, reproduced for the meta device, so a mixed-precision step is simulated with the
dtypes (and therefore the kept tensors) the GPU run has. Internal to ``estimate.torch``.

``torch.autocast("cuda")`` casts at the dispatcher, and only tensors on a CUDA device are eligible:
a meta tensor passes through uncast, and fake CUDA tensors cannot run a backward pass without a
GPU. This mode applies CUDA's cast policy one level up, at the torch function level, so each cast
is an autograd node exactly as under autocast (the cast copy is what the matmul saves):

* ``LOWER`` ops (matmuls, convolutions, attention) run in the compute dtype: floating inputs are
  cast, and a cast of a weight (a leaf that requires grad) is cached for the forward pass as
  autocast's weight cache does;
* ``FP32`` ops (norms, softmax, losses, exp/log/pow, reductions) run in float32: inputs cast up,
  or, for the ops autocast gives an output dtype (softmax, sum, cumsum...), the output made fp32;
* everything else runs in the dtype its inputs have, with torch's own type promotion.

The lists follow ``aten/src/ATen/autocast_mode.cpp`` (CUDA). A Python-level composite that
torch dispatches as one function (``F.multi_head_attention_forward``) is run with its floating
inputs in the compute dtype, which is what autocast does to each of its matmuls.
"""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["LOWER", "FP32", "FP32_OUT", "AutocastMode"]

#: functions autocast runs in the lower-precision compute dtype (names as ``func.__name__``)
LOWER = frozenset({
    "linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__", "__rmatmul__",
    "einsum", "mm", "mv", "bmm", "baddbmm", "addbmm", "chain_matmul", "multi_dot", "linalg_vecdot", "vecdot",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
    "multi_head_attention_forward", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
})

#: functions autocast runs in float32 (its inputs cast up)
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "native_layer_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "cross_entropy", "interpolate", "upsample",
})

#: functions autocast gives a float32 output dtype without copying the input first
FP32_OUT = frozenset({"softmax", "log_softmax", "cumprod", "cumsum", "sum", "prod", "norm", "vector_norm",
                      "matrix_norm", "_softmax"})


_CLASS: Any = None


def AutocastMode(dtype: Any):  # noqa: N802 - used like the class it builds
    """A torch function mode doing CUDA autocast to ``dtype`` for meta tensors while entered;
    ``clear()`` drops its weight cache (autocast clears it when the outermost region exits).
    The class is made on first use, so importing this module does not import torch."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _build()
    return _CLASS(dtype)


def _build():
    from torch.overrides import TorchFunctionMode
    body = {k: v for k, v in _Methods.__dict__.items() if k not in ("__dict__", "__weakref__")}
    return type("AutocastMode", (TorchFunctionMode,), body)


class _Methods:
    def __init__(self, dtype: Any):
        from torch.overrides import TorchFunctionMode
        TorchFunctionMode.__init__(self)
        import torch
        self.torch = torch
        self.dtype = dtype
        self.cache: Dict[int, Any] = {}
        self.enabled = True

    def clear(self) -> None:
        self.cache.clear()

    def _cast(self, x: Any, dtype: Any, seen: Any = None) -> Any:
        torch = self.torch
        if seen is not None and torch.is_tensor(x):
            # one tensor passed as several arguments (self-attention's query, key and value) is cast
            # once, as autocast does per op: the callee's ``q is k`` checks then still hold
            hit = seen.get(id(x))
            if hit is None:
                hit = seen[id(x)] = self._cast(x, dtype)
            return hit
        if torch.is_tensor(x):
            if not x.is_floating_point() or x.dtype == dtype or x.dtype == torch.float64:
                return x
            if x.is_leaf and x.requires_grad and dtype == self.dtype:
                key = id(x)
                hit = self.cache.get(key)
                if hit is None or hit[0] is not x:
                    hit = (x, x.to(dtype))
                    self.cache[key] = hit
                return hit[1]
            return x.to(dtype)
        if isinstance(x, (list, tuple)):
            return type(x)(self._cast(y, dtype, seen) for y in x)
        return x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.enabled:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in LOWER:
            seen: Dict[int, Any] = {}
            args = self._cast(args, self.dtype, seen)
            kwargs = {k: self._cast(v, self.dtype, seen) for k, v in kwargs.items()}
            return func(*args, **kwargs)
        if name in FP32:
            torch = self.torch
            seen = {}
            args = self._cast(args, torch.float32, seen)
            kwargs = {k: self._cast(v, torch.float32, seen) for k, v in kwargs.items()}
            return func(*args, **kwargs)
        if name in FP32_OUT and kwargs.get("dtype") is None:
            torch = self.torch
            first = args[0] if args else kwargs.get("input")
            if torch.is_tensor(first) and first.dtype in (torch.float16, torch.bfloat16):
                try:
                    return func(*args, **{**kwargs, "dtype": torch.float32})
                except TypeError:  # a signature without dtype= (Tensor.norm with p...): cast up instead
                    return func(*self._cast(args, torch.float32), **kwargs)
        return func(*args, **kwargs)
