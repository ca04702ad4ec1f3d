"""The meta-device step's bookkeeping: a dispatch mode that sees every buffer torch creates and
hands it to an allocator model (:class:`Tracker`), answers ``.item()`` on meta tensors, shortcuts
``foreach`` kernels and memoises repeated meta kernels."""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

from .inputs import import_torch
from .kernels import cudnn_workspace

__all__ = ["ROW_OWN", "Tracker", "dispatch_mode"]

#: suffix of the row that holds a container module's own ops (those outside its children)
ROW_OWN = " (own ops)"
# ops that run on cuBLAS, whose first use creates the workspaces
_BLAS_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_efficient_attention"}
# foreach kernels whose outputs are not shaped like their first list's
_COMPUTED_FOREACH = {"_foreach_norm", "_foreach_max"}


class Tracker:
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
        #: convolutions take cuDNN workspaces (CUDA only, see :func:`cudnn_workspace`)
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
            self.row_names.append((name + (ROW_OWN if own else ""), module, own))
        return self.rows[key]

    def register(self, t) -> None:
        torch = import_torch()
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



class _Memo:
    """On the meta device an op's outputs depend only on its inputs' shapes, strides and dtypes: a
    repeated layer reuses the first one's answer instead of rerunning torch's Python meta kernel
    (a new-tensor op only; views and in-place ops always run)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.memo: Dict[Any, Any] = {}
        self.fresh_ops: Dict[Any, bool] = {}

    def fresh(self, func) -> bool:
        """Whether ``func`` returns only new tensors (no view, no in-place or out= write)."""
        ok = self.fresh_ops.get(func)
        if ok is None:
            try:
                schema = func._schema
                ok = all(r.alias_info is None for r in schema.returns) and \
                    not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
            except Exception:
                ok = False
            self.fresh_ops[func] = ok
        return ok

    def freeze(self, x):
        torch = import_torch()
        if isinstance(x, torch.Tensor):
            if x.device.type != "meta" or x.layout != torch.strided:
                raise TypeError
            return (tuple(x.shape), x.stride(), x.dtype, x.storage_offset())
        if isinstance(x, (list, tuple)):
            return tuple(self.freeze(y) for y in x)
        if isinstance(x, dict):
            return tuple((k, self.freeze(v)) for k, v in sorted(x.items()))
        hash(x)
        return x

    def run(self, func, args, kwargs):
        from torch.utils._pytree import tree_flatten, tree_unflatten
        torch = import_torch()
        key = None
        if self.enabled and self.fresh(func):
            try:
                key = (func, self.freeze(args), self.freeze(kwargs))
            except TypeError:
                key = None
        hit = self.memo.get(key) if key is not None else None
        if hit is not None:
            spec, leaves = hit
            return tree_unflatten([torch.empty_strided(m[1], m[2], dtype=m[3], device="meta")
                                   if isinstance(m, _Meta) else m for m in leaves], spec)
        out = func(*args, **kwargs)
        if key is not None:
            leaves, spec = tree_flatten(out)
            if all(not torch.is_tensor(t) or _plain_meta(t) for t in leaves):
                self.memo[key] = (spec, [_Meta(("t", tuple(t.shape), t.stride(), t.dtype))
                                         if torch.is_tensor(t) else t for t in leaves])
        return out


def _plain_meta(t) -> bool:
    """A strided meta tensor that owns exactly its storage (so rebuilding it from shape and stride
    makes the same buffer)."""
    torch = import_torch()
    return (t.device.type == "meta" and t.layout == torch.strided and t.storage_offset() == 0 and
            t.untyped_storage().nbytes() == torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                                device="meta").untyped_storage().nbytes())


def _foreach_shortcut(tracker: Tracker, name: str, args, kwargs):
    """foreach kernels on the meta device are Python loops of shape checks (most of a large model's
    simulated optimizer step): an in-place one allocates nothing, an out-of-place one returns a
    tensor like each of its first list's, so both are answered without running them. Returns
    ``(True, answer)`` where that applies."""
    torch = import_torch()
    if name.startswith("_foreach_") and name not in _COMPUTED_FOREACH and args and isinstance(args[0], (list, tuple)) \
            and all(torch.is_tensor(t) and t.device.type == "meta" for t in args[0]) \
            and _same_shapes(args, kwargs):
        if name.endswith("_"):
            return True, None
        out = [torch.empty_like(t) for t in args[0]]
        for t in out:
            tracker.register(t)
        return True, out
    return False, None


def _read_value(tracker: Tracker, t):
    """``.item()`` / ``bool(t)``: a value the meta device does not have. Stand in the value a step
    on real data takes on its usual path (true, one), and say where it happened."""
    torch = import_torch()
    where = tracker.module_names.get(tracker.stack[-1], "") if tracker.stack else ""
    tracker.read_values.add((where or "(model)", tracker.phase))
    return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)


_MODE_CLASS: Any = None


def _mode_class() -> Any:
    """The dispatch mode's class, made once per process: a class made per call (closing over its
    tracker) sits in a reference cycle, as every class does, and kept the tracker - and through
    its rows the user's model, on the GPU where it lives - until the next garbage collection."""
    global _MODE_CLASS
    if _MODE_CLASS is not None:
        return _MODE_CLASS
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    torch = import_torch()

    class Mode(TorchDispatchMode):
        def __init__(self, tracker: Tracker, memo: bool) -> None:
            super().__init__()
            self.tracker, self.memo = tracker, _Memo(memo)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tracker = self.tracker
            name = getattr(func, "__name__", str(func)).split(".")[0]
            done, answer = _foreach_shortcut(tracker, name, args, kwargs)
            if done:
                return answer
            if name in _BLAS_OPS:
                tracker.blas = True
            if name == "_local_scalar_dense" and args and torch.is_tensor(args[0]) and args[0].device.type == "meta":
                return _read_value(tracker, args[0])
            try:
                out = self.memo.run(func, args, kwargs)
            except RuntimeError:
                out = _meta_refused(name, args, kwargs)
                if out is None:
                    raise
            for t in tree_flatten(out)[0]:
                tracker.register(t)
            if tracker.cudnn and name in ("convolution", "convolution_backward"):
                ws = cudnn_workspace(name, args)
                if ws > 0:
                    # allocated beside the outputs and freed when the kernel returns
                    tracker.register(torch.empty(ws, dtype=torch.uint8, device="meta"))
            return out
    _MODE_CLASS = Mode
    return Mode


def _meta_refused(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The output of a kernel whose meta function refuses what its CUDA kernel runs, or None.

    ``_grouped_mm`` (a mixture of experts' experts, Hugging Face's ``grouped_mm`` backend): its
    meta function accepts bfloat16 alone, while CUDA runs float32 too, and autocast does not cast
    it (both measured on an H200, torch 2.11: float32 in and out under bf16 autocast), so a
    mixed-precision step with float32 expert weights reaches it in float32. Its output is shaped
    by the operands' ranks: (M, K) x (G, K, N) -> (M, N); (G, M, K) x (G, K, N) -> (G, M, N);
    (M, K) x (K, N) with ``offs`` over K -> (G, M, N), in ``out_dtype`` or the first operand's."""
    if name not in ("_grouped_mm", "grouped_mm"):
        return None
    torch = import_torch()
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    out_dtype = (args[4] if len(args) > 4 else None) or kwargs.get("out_dtype") or a.dtype
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[2])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[2])
    elif a.dim() == 2 and b.dim() == 2 and offs is not None:
        shape = (offs.shape[0], a.shape[0], b.shape[1])
    else:
        return None
    return torch.empty(shape, dtype=out_dtype, device="meta")


def dispatch_mode(tracker: Tracker, memo: bool = True):
    return _mode_class()(tracker, memo)
