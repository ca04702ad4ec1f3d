"""Per-layer estimate of a ``torch.nn.Module``: one training step replayed on the meta device.

Method: simulation. The module runs forward, backward and two optimizer steps on torch's ``meta``
device (shapes and dtypes, no data, no compute, no GPU), with the module's own parameters swapped
for meta copies (``torch.func.functional_call``) so the user's module is untouched. A dispatch
mode sees every buffer the step creates; each is handed to a model of the allocator the peak is
for (:class:`~distmem.estimate.liveness.CudaCachingAllocator` for CUDA: 512-byte blocks, best fit,
its split rules) and released when torch frees it, so what autograd keeps, when gradients appear
and what the optimizer's ``foreach`` kernels allocate are torch's own behaviour rather than
rules. Where a CUDA kernel saves less than its meta/CPU fallback would — scaled dot-product
attention, whose fused kernels keep a log-sum-exp instead of the score matrix — the fused op is
used. Each buffer is attributed to the innermost module running when it was made; the buffers
still alive when the backward pass starts are that module's kept activations.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import ConfigError
from ..units import MiB
from .autocast import AutocastMode
from .liveness import CudaCachingAllocator, ExactAllocator
from .optimizers import torch_optimizer, torch_optimizer_factory
from .precision import Precision, dtype_bytes, resolve_precision
from .table import Estimate, LayerEstimate

__all__ = ["estimate_torch", "CUBLAS_WORKSPACE_BYTES", "CUBLAS_WORKSPACES", "DEFAULT_TORCH_INPUT_SHAPE",
           "LOSS_SCALE"]

#: cuBLAS workspace torch allocates through its caching allocator, so it is part of
#: ``max_memory_allocated``: 32 MiB on Hopper (sm90) by default (CUBLAS_WORKSPACE_CONFIG
#: ``:4096:8``), 8.125 MiB on earlier GPUs (``:4096:2:16:8``). Kept for the life of the process.
CUBLAS_WORKSPACE_BYTES = 32 * MiB

#: One workspace per (cuBLAS handle, stream), and handles are per thread: the forward runs on the
#: Python thread, the backward on autograd's device thread, so a training step holds two.
CUBLAS_WORKSPACES = 2

#: Steps after the first are replayed from its allocation trace (False: each is simulated again,
#: slower; the tests compare the two).
REPLAY_LATER_STEPS = True

#: An op on meta tensors seen before with the same input shapes, strides and dtypes reuses the
#: first answer (False: every op runs its meta kernel; the tests compare the two).
MEMO_META_OPS = True

#: Convolutions hold the cuDNN workspace :func:`_cudnn_workspace` models while they run (False:
#: none, as before; the tests compare the two).
CUDNN_WORKSPACES = True

#: The loss scale ``GradScaler`` multiplies the loss by under fp16 (its default ``init_scale``).
LOSS_SCALE = 65536.0

#: Per-sample input shape assumed for a torchvision model when none is given.
DEFAULT_TORCH_INPUT_SHAPE = (3, 224, 224)

_ROW_OWN = " (own ops)"
_TABLE_KEYS = ("kept", "rows", "out_bytes", "read_values", "parts")


def _torch():
    try:
        import torch
    except ImportError:
        raise ConfigError("estimating a PyTorch module needs torch; install it (pip install torch)") from None
    return torch


def _example(model: Any, example_input: Any, input_shape: Optional[Sequence[int]], batch: int,
             input_dtype: Any) -> Tuple[tuple, Dict[str, Any]]:
    """Positional and keyword inputs on the meta device at ``batch``."""
    torch = _torch()
    if example_input is None:
        hook = getattr(model, "example_input", None)
        if callable(hook):
            example_input = hook(batch)
        elif hook is not None:
            example_input = hook
    if example_input is None:
        shape = tuple(input_shape or getattr(model, "_distmem_input_shape", None) or ())
        if not shape:
            raise ConfigError(f"{type(model).__name__}: give example_input= (a tensor or tuple of tensors with a "
                              f"batch dimension) or input_shape= (one sample, e.g. (3, 224, 224)); the module "
                              f"does not say what it takes")
        dtype = input_dtype or torch.float32
        return (torch.empty((batch, *shape), dtype=dtype, device="meta"),), {}

    def meta(t):
        if torch.is_tensor(t):
            shape = (batch, *t.shape[1:]) if t.dim() > 0 else t.shape
            return torch.empty(shape, dtype=t.dtype, device="meta")
        return t
    if isinstance(example_input, dict):
        return (), {k: meta(v) for k, v in example_input.items()}
    if isinstance(example_input, (list, tuple)):
        return tuple(meta(t) for t in example_input), {}
    return (meta(example_input),), {}


class _Tracker:
    """Counts every meta buffer through an allocator model and attributes it to a module."""

    def __init__(self, allocator):
        self.alloc = allocator
        self.owner: Dict[int, int] = {}
        self.size: Dict[int, int] = {}
        self.stack: List[int] = []
        self.rows: Dict[int, int] = {}  # id(module) -> row
        self.row_names: List[Tuple[str, Any, bool]] = []
        self.module_names: Dict[int, str] = {}
        self.phase = "forward"
        self.blas = False
        #: convolutions take cuDNN workspaces (CUDA only, see :func:`_cudnn_workspace`)
        self.cudnn = False
        self.peak_phase = "forward"
        self.out_bytes: Dict[int, int] = {}
        self.serial: Dict[int, int] = {}
        self.next_serial = 0
        self.read_values: set = set()  # (module, phase) where the step read a tensor's value
        #: (serial, bytes, phase) for an allocation, (serial, -1, phase) for a free: the step recorded
        #: once, so later steps replay it through the allocator model without running the model again
        self.trace: Optional[List[Tuple[int, int, str]]] = None

    def row_of(self, module, own: bool) -> int:
        key = id(module)
        if key not in self.rows:
            self.rows[key] = len(self.row_names)
            name = self.module_names.get(key, type(module).__name__) or "(model)"
            self.row_names.append((name + (_ROW_OWN if own else ""), module, own))
        return self.rows[key]

    def register(self, t) -> None:
        torch = _torch()
        if not torch.is_tensor(t) or t.device.type != "meta":
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.size:
            return
        n = st.nbytes()
        self.size[key] = n
        before = self.alloc.peak
        self.alloc.alloc(key, n)
        if self.alloc.peak > before:
            self.peak_phase = self.phase
        if self.phase == "forward" and self.stack:
            self.owner[key] = self.stack[-1]
        serial = self.next_serial
        self.next_serial += 1
        self.serial[key] = serial
        if self.trace is not None:
            self.trace.append((serial, n, self.phase))
        weakref.finalize(st, self._release, key)

    def _release(self, key: int) -> None:
        self.size.pop(key, None)
        self.owner.pop(key, None)
        serial = self.serial.pop(key, None)
        if self.trace is not None and serial is not None:
            self.trace.append((serial, -1, self.phase))
        self.alloc.free(key)


def _same_shapes(args, kwargs) -> bool:
    """Whether every tensor list among a foreach op's arguments matches the first one shape for
    shape and dtype for dtype (no broadcasting, no promotion), so its outputs are like the first."""
    first = args[0]
    for a in (*args[1:], *kwargs.values()):
        if isinstance(a, (list, tuple)) and a and hasattr(a[0], "shape"):
            if len(a) != len(first) or any(getattr(x, "shape", None) != y.shape or
                                           getattr(x, "dtype", None) != y.dtype for x, y in zip(a, first)):
                return False
        elif hasattr(a, "shape") and getattr(a, "dim", lambda: 0)() > 0:
            return False  # one tensor against a list: may broadcast
    return True


class _Meta(tuple):
    """A memoised output tensor's (tag, shape, stride, dtype)."""


def _dispatch_mode(tracker: _Tracker):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_unflatten

    # ops that run on cuBLAS, whose first use creates the workspaces
    blas_ops = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_efficient_attention"}

    torch = _torch()
    # foreach kernels on the meta device are Python loops of shape checks (most of a large model's
    # simulated optimizer step): an in-place one allocates nothing, an out-of-place one returns a
    # tensor like each of its first list's, so both are answered without running them
    computed = {"_foreach_norm", "_foreach_max"}

    memo: Dict[Any, Any] = {}
    fresh_ops: Dict[Any, bool] = {}

    def fresh(func) -> bool:
        """Whether ``func`` returns only new tensors (no view, no in-place or out= write)."""
        ok = fresh_ops.get(func)
        if ok is None:
            try:
                schema = func._schema
                ok = all(r.alias_info is None for r in schema.returns) and \
                    not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
            except Exception:
                ok = False
            fresh_ops[func] = ok
        return ok

    def freeze(x):
        if isinstance(x, torch.Tensor):
            if x.device.type != "meta" or x.layout != torch.strided:
                raise TypeError
            return (tuple(x.shape), x.stride(), x.dtype, x.storage_offset())
        if isinstance(x, (list, tuple)):
            return tuple(freeze(y) for y in x)
        if isinstance(x, dict):
            return tuple((k, freeze(v)) for k, v in sorted(x.items()))
        hash(x)
        return x

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", str(func)).split(".")[0]
            if name.startswith("_foreach_") and name not in computed and args and isinstance(args[0], (list, tuple)) \
                    and all(torch.is_tensor(t) and t.device.type == "meta" for t in args[0]) \
                    and _same_shapes(args, kwargs):
                if name.endswith("_"):
                    return None
                out = [torch.empty_like(t) for t in args[0]]
                for t in out:
                    tracker.register(t)
                return out
            if name in blas_ops:
                tracker.blas = True
            if name == "_local_scalar_dense" and args and torch.is_tensor(args[0]) and args[0].device.type == "meta":
                # ``.item()`` / ``bool(t)``: a value the meta device does not have. Stand in the value a
                # step on real data takes on its usual path (true, one), and say where it happened
                where = tracker.module_names.get(tracker.stack[-1], "") if tracker.stack else ""
                tracker.read_values.add((where or "(model)", tracker.phase))
                t = args[0]
                return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
            # on the meta device an op's outputs depend only on its inputs' shapes, strides and
            # dtypes: a repeated layer reuses the first one's answer instead of rerunning torch's
            # Python meta kernel (a new-tensor op only; views and in-place ops always run)
            key = None
            if MEMO_META_OPS and fresh(func):
                try:
                    key = (func, freeze(args), freeze(kwargs))
                except TypeError:
                    key = None
            hit = memo.get(key) if key is not None else None
            if hit is not None:
                spec, leaves = hit
                out = tree_unflatten([torch.empty_strided(m[1], m[2], dtype=m[3], device="meta")
                                      if isinstance(m, _Meta) else m for m in leaves], spec)
            else:
                out = func(*args, **kwargs)
                if key is not None:
                    leaves, spec = tree_flatten(out)
                    if all(not torch.is_tensor(t) or (t.device.type == "meta" and t.layout == torch.strided
                                                      and t.storage_offset() == 0 and t.untyped_storage().nbytes()
                                                      == torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                                             device="meta").untyped_storage().nbytes())
                           for t in leaves):
                        memo[key] = (spec, [_Meta(("t", tuple(t.shape), t.stride(), t.dtype))
                                            if torch.is_tensor(t) else t for t in leaves])
            for t in tree_flatten(out)[0]:
                tracker.register(t)
            if tracker.cudnn and name in ("convolution", "convolution_backward"):
                ws = _cudnn_workspace(name, args)
                if ws > 0:
                    # allocated beside the outputs and freed when the kernel returns
                    tracker.register(torch.empty(ws, dtype=torch.uint8, device="meta"))
            return out
    return Mode()


def _float32() -> Any:
    return _torch().float32


def _cudnn_workspace(name: str, args: Sequence[Any]) -> int:
    """Bytes of the workspace cuDNN takes for one convolution (``name``: ``convolution`` or
    ``convolution_backward``, with the aten op's arguments), as its heuristic engines choose them
    on NCHW tensors (measured on an H200, cuDNN 9: ``bench/estimate_zoo_probe.py --ops``):

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
        half = x.dtype == _torch().float16  # fp16 layers took other engines (ShuffleNet's, MobileNetV3's)
        return x.shape[0] * w.numel() * 4 if need_weight_grad and not half else 0
    if x.dtype != _float32():
        return 0  # half-precision kernels read NCHW as it is
    if grad_out is None:
        out_numel = x.shape[0] * w.shape[0]
        for i, size in enumerate(x.shape[2:]):
            k = (w.shape[2 + i] - 1) * args[5][i] + 1  # dilated kernel
            out_numel *= (size + 2 * padding[i] - k) // stride[i] + 1
        return nbytes(x) + out_numel * x.element_size() + nbytes(w)
    return nbytes(x) + nbytes(grad_out) + nbytes(w)


class _CudaDropout:
    """``F.dropout`` as CUDA runs it: the fused ``native_dropout`` kernel, which keeps a one-byte
    mask for the backward pass. On the meta device (as on CPU) ``dropout`` decomposes into a
    Bernoulli draw in the input's dtype, a mask four times larger in fp32."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if getattr(func, "__name__", "") == "dropout":
                    torch = _torch()
                    x = args[0] if args else kwargs.get("input")
                    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
                    train = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
                    inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
                    if torch.is_tensor(x) and train and 0 < float(p) < 1 and not inplace and x.numel() > 0:
                        return torch.native_dropout(x, float(p), True)[0]
                return func(*args, **kwargs)
        self.mode = Mode()


@contextlib.contextmanager
def _fused_sdpa(enabled: bool, autocast: Any = None):
    """Route scaled dot-product attention to the fused kernel CUDA runs (memory-efficient
    attention keeps the output and a log-sum-exp, not the score matrix); the meta device would
    otherwise take the math fallback, which keeps the full score matrix."""
    torch = _torch()
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
            return _gqa_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale)
        if attn_mask is not None and attn_mask.requires_grad and query.dim() == 4:
            # a learned additive bias (T5's relative positions) that needs its gradient: modelled as
            # the math kernel, which keeps the score matrix (the fused kernels do not)
            return _math_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale)
        if query.dim() != 4 or (attn_mask is not None and attn_mask.dim() != 4):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale)
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

    def _math_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale):
        """``_scaled_dot_product_attention_math`` step by step, as CUDA runs it: its dropout is a
        bool mask, and half-precision inputs (autocast's casts) are computed in float32 (torch
        2.5+, unless ``allow_fp16_bf16_reduction_math_sdp(True)``): the kept score matrix,
        softmax and dropout output are fp32, the result cast back. It also returns the
        attention weights in the inputs' dtype, a copy freed at once."""
        import math
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

    def _gqa_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale):
        if attn_mask is None:
            try:  # flash attention reads grouped K/V as they are, keeping the output and a log-sum-exp
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, is_causal, False, scale=scale)[0]
            except Exception:
                pass
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=True)
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _replay_steps(alloc, tracker: _Tracker, steps: int, peaks: List[int], phases: List[str]) -> None:
    """Steps after the first, replayed from the first one's allocation trace through the allocator
    model: the same kernels allocate and free the same buffers, except those the first step made
    and left alive (the optimizer's state, created once), which a later step finds in place."""
    trace = tracker.trace or []
    tracker.trace = None
    alive = set(tracker.serial.values())
    skip = {s for s, n, _ in trace if n >= 0 and s in alive}
    for r in range(steps):
        alloc.reset_peak()
        phase = "forward"
        for serial, n, ph in trace:
            if serial in skip:
                continue
            if n >= 0:
                before = alloc.peak
                alloc.alloc(("r", r, serial), n)
                if alloc.peak > before:
                    phase = ph
            else:
                alloc.free(("r", r, serial))
        for serial, n, _ in trace:  # whatever the trace left allocated (nothing, normally)
            alloc.free(("r", r, serial))
        peaks.append(alloc.peak)
        phases.append(phase)


def _peak_parts(cuda: bool, before: List[Tuple[int, str]], trace: List[Tuple[int, int, str]], alive: set,
                grad_serials: set, workspaces: List[int], steps: int, which: int, peak: int) -> Dict[str, int]:
    """The peak of step ``which`` split into ``liveness.PARTS``: the recorded step replayed through a
    fresh allocator model in the same order, each buffer booked by what it was — weights and the
    batch (alive before the step), the weights' gradients, the optimizer state (made in the update
    and alive after it), kept activations (made in the forward pass and alive past it), cuBLAS
    workspaces, temporaries (everything else) — and the allocator's rounding beside them."""
    alloc = CudaCachingAllocator(track=True) if cuda else ExactAllocator(track=True)
    for i, (n, part) in enumerate(before):
        alloc.alloc(("pre", i), n, part)
    freed_in: Dict[int, str] = {}
    for serial, n, ph in trace:
        if n < 0:
            freed_in.setdefault(serial, ph)

    def part(serial: int, ph: str) -> str:
        if serial in grad_serials:
            return "gradients"
        if ph == "update" and serial in alive:
            return "optimizer state"
        if ph == "forward" and freed_in.get(serial) != "forward":
            return "activations"
        return "temporaries"
    results: List[Tuple[int, Dict[str, int]]] = []
    alloc.reset_peak()
    for serial, n, ph in trace:
        if n >= 0:
            alloc.alloc(("s", serial), n, part(serial, ph))
        else:
            alloc.free(("s", serial))
    for i, n in enumerate(workspaces):
        alloc.alloc(("cublas", i), n, "workspaces")
    results.append((alloc.peak, alloc.parts()))
    skip = {s for s, n, _ in trace if n >= 0 and s in alive}
    for r in range(steps - 1):
        alloc.reset_peak()
        for serial, n, ph in trace:
            if serial in skip:
                continue
            if n >= 0:
                alloc.alloc(("r", r, serial), n, part(serial, ph))
            else:
                alloc.free(("r", r, serial))
        for serial, n, _ in trace:
            alloc.free(("r", r, serial))
        results.append((alloc.peak, alloc.parts()))
    got, parts = results[which]
    if got != peak:  # the record does not reproduce the step: say so in the parts, never hide it
        parts["allocator rounding"] += peak - got
    return parts


def _loss(output: Any, loss: Any):
    torch = _torch()
    if callable(loss):
        return loss(output)
    t = output
    if isinstance(t, dict):
        t = t.get("logits", next(iter(t.values())))
    if isinstance(t, (list, tuple)):
        t = t[0]
    t = getattr(t, "logits", t)
    if loss in ("auto", "cross_entropy") and t.dim() >= 2 and t.is_floating_point():
        logits = t.reshape(-1, t.shape[-1])
        target = torch.zeros(logits.shape[0], dtype=torch.long, device=t.device)
        return torch.nn.functional.cross_entropy(logits.float() if t.dtype != torch.float32 else logits, target)
    return t.float().sum() if t.dtype != torch.float32 else t.sum()


def estimate_torch(model: Any, example_input: Any = None, *, input_shape: Optional[Sequence[int]] = None,
                   batch_size: int = 32, optimizer: Any = "adam", precision: Any = None,
                   device: str = "cuda", loss: Any = "auto", input_dtype: Any = None,
                   blas_workspace_bytes: Optional[int] = None, name: Optional[str] = None) -> Estimate:
    """Per-layer training memory of ``model`` at ``batch_size``, simulated on the meta device.

    ``example_input``: a tensor, tuple or dict like the model's input (its batch dimension is
    replaced), or ``input_shape`` for one sample (``(3, 224, 224)``); a module may also carry an
    ``example_input(batch)`` method. ``optimizer``: the optimizer object (or class, or name) you
    train with; a fresh copy with the same options runs on the meta weights. ``precision``:
    ``"mixed_float16"``/``"mixed_bfloat16"`` cast weights and inputs to the compute dtype from
    fp32 masters, as autocast does. ``device``: ``"cuda"`` (the caching allocator's 512-byte
    blocks and split rules, foreach optimizer kernels, fused attention, cuBLAS workspaces) or
    ``"cpu"`` (exact bytes). ``loss``: ``"auto"`` (cross-entropy on the output's last dimension),
    ``"sum"``, or a function of the output returning a scalar.
    """
    torch = _torch()
    if batch_size is None or int(batch_size) < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"estimate_torch needs a torch.nn.Module, got {type(model).__name__}")
    batch_size = int(batch_size)
    dev = str(device).lower()
    if dev not in ("cuda", "gpu", "cpu"):
        raise ConfigError(f"device must be 'cuda' or 'cpu', got {device!r}")
    cuda = dev != "cpu"
    prec = resolve_precision(precision)
    info = torch_optimizer(optimizer)
    factory = torch_optimizer_factory(optimizer)
    workspace = (CUBLAS_WORKSPACE_BYTES if blas_workspace_bytes is None else int(blas_workspace_bytes)) if cuda else 0

    names = {id(m): n for n, m in model.named_modules()}
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())

    def run(batch: int, keep_table: bool, steps: int = 2, forward_only: bool = False,
            want_parts: bool = False) -> Dict[str, Any]:
        alloc = CudaCachingAllocator() if cuda else ExactAllocator()
        tracker = _Tracker(alloc)
        tracker.module_names = names
        tracker.cudnn = cuda and CUDNN_WORKSPACES
        mode = _dispatch_mode(tracker)
        hooks = []

        def pre(mod, args):
            tracker.stack.append(id(mod))
            tracker.row_of(mod, own=any(True for _ in mod.children()))

        def post(mod, args, out):
            if tracker.stack and tracker.stack[-1] == id(mod):
                tracker.stack.pop()
            row = tracker.rows.get(id(mod))
            if row is not None and row not in tracker.out_bytes:
                from torch.utils._pytree import tree_flatten
                tracker.out_bytes[row] = sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                                             if torch.is_tensor(t))
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        with mode:
            meta_params = {k: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
                           for k, p in params.items()}
            meta_buffers = {k: torch.empty_like(b, device="meta") for k, b in buffers.items()}
        trainable = [p for p in meta_params.values() if p.requires_grad]
        opt = factory(trainable, {})
        _foreach_as_torch_picks(opt, cuda)
        args, kwargs = _example(model, example_input, input_shape, batch, input_dtype)
        for t in (*args, *kwargs.values()):
            tracker.register(t)  # the batch is on the device for the whole step
        weight_keys = {p.untyped_storage()._cdata for p in (*meta_params.values(), *meta_buffers.values())}
        grad_serials: set = set()
        before_trace: List[Tuple[int, str]] = []
        blas_after_first = [False]
        cdt = torch.bfloat16 if "bfloat16" in prec.name else torch.float16
        hooks.append(register_module_forward_pre_hook(pre))
        hooks.append(register_module_forward_hook(post))
        kept: Dict[int, int] = {}
        peaks: List[int] = []
        phases: List[str] = []
        autocast = AutocastMode(cdt) if prec.cast_weights else None
        try:
            with mode, _fused_sdpa(cuda, autocast), (_CudaDropout().mode if cuda else contextlib.nullcontext()):
                for step in range(1 if REPLAY_LATER_STEPS else steps):
                    alloc.reset_peak()
                    tracker.peak_phase = "forward"
                    tracker.phase = "forward"
                    tracker.trace = [] if REPLAY_LATER_STEPS and steps > 1 and not forward_only else None
                    if step == 0:
                        before_trace = [(n, "weights" if key in weight_keys else "inputs")
                                        for key, n in tracker.size.items()]
                    state = dict(meta_params)
                    state.update(meta_buffers)
                    # ``with autocast(): out = model(x); loss = crit(out, y)``, then backward outside it
                    if autocast is not None:
                        autocast.__enter__()
                    try:
                        out = torch.func.functional_call(model, state, args, kwargs)
                        value = _loss(out, loss)
                    finally:
                        if autocast is not None:
                            autocast.__exit__(None, None, None)
                            autocast.clear()
                    if prec.loss_scaling:
                        value = value * LOSS_SCALE  # GradScaler.scale(loss)
                    if keep_table and step == 0:
                        for key, owner in list(tracker.owner.items()):
                            row = tracker.rows.get(owner)
                            if row is not None:
                                kept[row] = kept.get(row, 0) + tracker.size.get(key, 0)
                    tracker.phase = "backward"
                    del state
                    if forward_only:
                        peaks.append(alloc.peak)
                        phases.append(tracker.peak_phase)
                        break
                    else:
                        # the output and loss stay referenced through backward and the update, as in
                        # ``out = model(x); loss = crit(out, y); loss.backward(); opt.step()``
                        value.backward()
                        for p_ in trainable:
                            if p_.grad is not None:
                                serial = tracker.serial.get(p_.grad.untyped_storage()._cdata)
                                if serial is not None:
                                    grad_serials.add(serial)
                        tracker.phase = "update"
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        del out, value
                        if tracker.blas and workspace and ("cublas", 0) not in alloc.sizes:
                            # created on the first matmul and kept for the process: part of every later step
                            for i in range(CUBLAS_WORKSPACES):
                                alloc.alloc(("cublas", i), workspace)
                            blas_after_first[0] = True
                        peaks.append(alloc.peak)
                        phases.append(tracker.peak_phase)
                        if tracker.trace is not None:
                            trace = list(tracker.trace)
                            alive = set(tracker.serial.values())
                            _replay_steps(alloc, tracker, steps - 1, peaks, phases)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"could not run {type(model).__name__} on the meta device to size it "
                              f"({type(exc).__name__}: {exc}); check example_input/input_shape, or estimate a "
                              f"module whose forward does not read tensor values (no .item(), no data-dependent "
                              f"shapes)") from None
        finally:
            for h in hooks:
                h.remove()
        step_peak = max(peaks)
        res = {"peak": step_peak, "phase": phases[peaks.index(step_peak)], "node": -1, "batch": batch,
               "steps": peaks}
        if want_parts and not forward_only and REPLAY_LATER_STEPS and steps > 1:
            res["parts"] = _peak_parts(cuda, before_trace, trace, alive, grad_serials,
                                       CUBLAS_WORKSPACES * [workspace] if blas_after_first[0] else [],
                                       steps, peaks.index(step_peak), step_peak)
        if keep_table:
            res["kept"] = kept
            res["rows"] = tracker.row_names
            res["out_bytes"] = dict(tracker.out_bytes)
            res["read_values"] = sorted(tracker.read_values)
        return res

    first = run(batch_size, True, want_parts=True)
    # the per-sample slope of each row's kept bytes: one more forward pass at batch + 1
    second = run(batch_size + 1, True, steps=1, forward_only=True)
    rows = _rows(first, second, params, info, prec, batch_size)
    cache = {(batch_size, True): first}

    def parts_fn(batch: int) -> Dict[str, int]:
        if "parts" not in cache.get((batch, True), {}):
            cache[(batch, True)] = run(batch, False, want_parts=True)
        parts = cache[(batch, True)].get("parts")
        if parts is None:
            raise ConfigError("this torch estimate has no per-part record of its peak (steps are not replayed "
                              "from a trace); estimate again with distmem.estimate.from_torch.REPLAY_LATER_STEPS")
        return dict(parts)

    def peak_fn(batch: int, train: bool) -> Dict[str, Any]:
        if train:
            if (batch, True) not in cache:
                cache[(batch, True)] = run(batch, False)
            return {k: v for k, v in cache[(batch, True)].items() if k not in _TABLE_KEYS}
        args, kwargs = _example(model, example_input, input_shape, batch, input_dtype)
        peak = _inference_peak(model, params, buffers, args, kwargs, cuda, prec)
        return {"peak": peak, "phase": "forward", "node": -1, "batch": batch}

    est = Estimate(framework="torch", model=name or type(model).__name__, batch_size=batch_size,
                   precision=prec.name, optimizer=info.to_dict(), layers=rows, method="simulated",
                   device="cuda" if cuda else "cpu",
                   input_bytes_per_sample=_input_bytes(model, example_input, input_shape, input_dtype),
                   extra_persistent_bytes=CUBLAS_WORKSPACES * workspace, _peak_fn=peak_fn, _parts_fn=parts_fn)
    est._cache[(batch_size, True)] = {k: v for k, v in first.items() if k not in _TABLE_KEYS}
    for where, phase in first["read_values"]:
        who = f"the optimizer's step ({info.name})" if phase == "update" else f"module '{where}' ({phase} pass)"
        est.warnings.append(f"{who} read a tensor's value (.item(), bool() or a data-dependent branch), which a "
                            f"meta-device simulation does not have; it was answered with true / 1, the path a step "
                            f"without padding or overflow takes. If memory there depends on the value, measure "
                            f"one step instead")
    for w in est.warnings:
        warnings.warn(f"distmem.estimate: {w}", stacklevel=2)
    return est


#: torch optimizers whose ``foreach=None`` runs the for-loop implementation on CUDA too: torch's
#: Adafactor (its foreach path holds a weight-sized temporary per tensor at once)
_FOR_LOOP_BY_DEFAULT = frozenset({"Adafactor"})


def _foreach_as_torch_picks(opt: Any, cuda: bool) -> None:
    """Set each parameter group's unset ``foreach`` to what torch would run: the foreach kernels
    on CUDA (``_default_to_fused_or_foreach``), except for :data:`_FOR_LOOP_BY_DEFAULT`; the for-loop
    on CPU. An explicit ``foreach=True/False`` is kept."""
    default = cuda and type(opt).__name__ not in _FOR_LOOP_BY_DEFAULT
    for group in opt.param_groups:
        if "foreach" in group and group["foreach"] is None:
            group["foreach"] = default


def _input_bytes(model, example_input, input_shape, input_dtype) -> int:
    args, kwargs = _example(model, example_input, input_shape, 1, input_dtype)
    torch = _torch()
    return sum(t.numel() * t.element_size() for t in (*args, *kwargs.values()) if torch.is_tensor(t))


def _inference_peak(model, params, buffers, args, kwargs, cuda, prec) -> int:
    """Allocator peak of one forward pass under ``no_grad`` (eval mode), weights included."""
    torch = _torch()
    alloc = CudaCachingAllocator() if cuda else ExactAllocator()
    tracker = _Tracker(alloc)
    tracker.cudnn = cuda and CUDNN_WORKSPACES
    mode = _dispatch_mode(tracker)
    cdt = torch.bfloat16 if "bfloat16" in prec.name else torch.float16
    autocast = AutocastMode(cdt) if prec.cast_weights else None
    with mode:
        state = {k: torch.empty_like(p, device="meta") for k, p in params.items()}
        state.update({k: torch.empty_like(b, device="meta") for k, b in buffers.items()})
        for t in (*args, *kwargs.values()):
            tracker.register(t)
        with torch.no_grad(), _fused_sdpa(cuda, autocast):
            was = model.training
            model.eval()
            try:
                if autocast is not None:
                    with autocast:
                        out = torch.func.functional_call(model, state, args, kwargs)
                else:
                    out = torch.func.functional_call(model, state, args, kwargs)
            finally:
                model.train(was)
        del out
    return alloc.peak



def _count_parameter(row: LayerEstimate, p: Any, info: Any) -> None:
    """Add one parameter to a table row: its elements and bytes, and if it trains, its gradient
    and optimizer slots."""
    n = p.numel()
    wb = dtype_bytes(p.dtype)
    row.params += n
    row.param_bytes += n * wb
    if p.requires_grad:
        row.trainable_params += n
        row.grad_bytes += n * wb
        row.optimizer_bytes += info.slot_elements(tuple(p.shape)) * wb

def _rows(first, second, params, info, prec: Precision, batch: int) -> List[LayerEstimate]:
    """Table rows in execution order from two simulations (``batch`` and ``batch + 1``)."""
    rows: List[LayerEstimate] = []
    counted = set()  # a tied weight (an embedding shared with the output head) is held once
    for idx, (name, module, own) in enumerate(first["rows"]):
        r = LayerEstimate(name=name, kind=type(module).__name__)
        for p in module.parameters(recurse=False):
            if id(p) in counted:
                continue
            counted.add(id(p))
            _count_parameter(r, p, info)
        a1 = first["kept"].get(idx, 0)
        a2 = second["kept"].get(idx, 0)
        r.activation_bytes_per_sample = max(a2 - a1, 0)
        r.activation_fixed_bytes = max(a1 - r.activation_bytes_per_sample * batch, 0)
        o1, o2 = first["out_bytes"].get(idx, 0), second["out_bytes"].get(idx, 0)
        r.output_bytes_per_sample = max(o2 - o1, 0)
        r.dtype = "float32" if not prec.cast_weights else prec.name.replace("mixed_", "")
        rows.append(r)
    # parameters of modules that never ran still need memory
    seen = set()
    for _, m, _ in first["rows"]:
        for p in m.parameters(recurse=False):
            seen.add(id(p))
    leftovers = [(n, p) for n, p in params.items() if id(p) not in seen]
    if leftovers:
        r = LayerEstimate(name="(unused parameters)", kind="Parameter")
        for _, p in leftovers:
            _count_parameter(r, p, info)
        rows.append(r)
    return [r for r in rows if r.params or r.activation_bytes_per_sample or r.activation_fixed_bytes
            or not r.name.endswith(_ROW_OWN)]
