"""Per-layer estimate of a ``torch.nn.Module``: one training step replayed on the meta device.

Method: simulation. The module runs forward, backward and two optimizer steps on torch's ``meta``
device (shapes and dtypes, no data, no compute, no GPU), with the module's own parameters swapped
for meta copies (``torch.func.functional_call``) so the user's module is untouched. A dispatch
mode sees every buffer the step creates (``dispatch``); each is handed to a model of the allocator
the peak is for (:class:`~distmem.estimate.allocators.CudaCachingAllocator` for CUDA: 512-byte
blocks, best fit, its split rules) and released when torch frees it, so what autograd keeps, when
gradients appear and what the optimizer's ``foreach`` kernels allocate are torch's own behaviour
rather than rules. Where a CUDA kernel saves less than its meta/CPU fallback would — scaled
dot-product attention, whose fused kernels keep a log-sum-exp instead of the score matrix — the
fused op is used (``kernels``). Each buffer is attributed to the innermost module running when it
was made; the buffers still alive when the backward pass starts are that module's kept activations.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...errors import ConfigError
from ..optimizers import torch_optimizer, torch_optimizer_factory
from ..precision import Precision, dtype_bytes, resolve_precision
from ..table import Estimate, LayerEstimate
from .dispatch import ROW_OWN
from .inputs import example_batch, example_inputs, input_bytes, import_torch
from .kernels import CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACES
from .simulate import Simulation, inference_peak

__all__ = ["REPLAY_LATER_STEPS", "MEMO_META_OPS", "CUDNN_WORKSPACES", "DEFAULT_TORCH_INPUT_SHAPE",
           "estimate_torch", "state_estimate", "float_dtype"]

#: Steps after the first are replayed from its allocation trace (False: each is simulated again,
#: slower; the tests compare the two).
REPLAY_LATER_STEPS = True

#: An op on meta tensors seen before with the same input shapes, strides and dtypes reuses the
#: first answer (False: every op runs its meta kernel; the tests compare the two).
MEMO_META_OPS = True

#: Convolutions hold the cuDNN workspace ``kernels._cudnn_workspace`` models while they run (False:
#: none, as before; the tests compare the two).
CUDNN_WORKSPACES = True

#: Per-sample input shape assumed for a torchvision model when none is given.
DEFAULT_TORCH_INPUT_SHAPE = (3, 224, 224)

_TABLE_KEYS = ("kept", "rows", "out_bytes", "read_values", "parts", "phase_parts")

#: What an estimate of a ``torch.compile``d module says: the meta device cannot run Inductor's
#: kernels, so the eager module is simulated; compiled graphs fuse element-wise kernels and keep
#: fewer intermediates (measured on an H200: bench/results/estimate_measured_torch_h200.jsonl).
COMPILED_NOTE = ("torch.compile: the module is compiled, and the meta device cannot run the compiled graph; "
                 "the eager module was simulated instead, an upper bound where Inductor fuses kernels (measured "
                 "compiled peaks were at most the eager ones; see docs/estimate.md). Measure it on a GPU "
                 "(estimate(..., method='measure')) for the compiled figure")


def eager_of(model: Any) -> Tuple[Any, bool]:
    """``(the eager module, whether model is torch.compile'd)``: an ``OptimizedModule``'s
    ``_orig_mod``, or a module whose ``compile()`` was called (run eagerly while simulated)."""
    inner = getattr(model, "_orig_mod", None)
    if inner is not None and type(model).__name__ == "OptimizedModule":
        return inner, True
    return model, getattr(model, "_compiled_call_impl", None) is not None


def estimate_torch(model: Any, example_input: Any = None, *, input_shape: Optional[Sequence[int]] = None,
                   batch_size: Optional[int] = None, optimizer: Any = "adam", precision: Any = None,
                   device: str = "cuda", loss: Any = "auto", input_dtype: Any = None,
                   blas_workspace_bytes: Optional[int] = None, name: Optional[str] = None,
                   batch_dim: Any = 0, param_dtype: Any = None) -> Estimate:
    """Per-layer training memory of ``model`` at ``batch_size``, simulated on the meta device.

    ``example_input``: a tensor, tuple or dict like the model's input (its batch dimension,
    ``batch_dim``, is set to the batch: an int for every input, None for one that does not grow
    with the batch, or one per input), a function building the input at a batch, or
    ``input_shape`` for one sample (``(3, 224, 224)``); a module may also carry an
    ``example_input(batch)`` method. ``batch_size``: None takes the example's own batch (32
    without an example). ``optimizer``: the optimizer object (or class, or name) you
    train with; a fresh copy with the same options runs on the meta weights. ``precision``:
    ``"mixed_float16"``/``"mixed_bfloat16"`` cast weights and inputs to the compute dtype from
    fp32 masters, as autocast does. ``device``: ``"cuda"`` (the caching allocator's 512-byte
    blocks and split rules, foreach optimizer kernels, fused attention, cuBLAS workspaces) or
    ``"cpu"`` (exact bytes). ``loss``: ``"auto"`` (cross-entropy on the output's last dimension),
    ``"sum"``, or a function of the output (or of the output and the batch: ``loss(output,
    batch)``, the batch as the inputs were given) returning a scalar. ``param_dtype``: FSDP2's
    ``MixedPrecisionPolicy(param_dtype=...)``: the step runs with its parameters and floating inputs
    in that dtype (everything computed in it, unlike autocast); the table counts the parameters as
    the model holds them (the sharded master copy).
    """
    torch = import_torch()
    if batch_size is None:
        batch_size = example_batch(model, example_input, batch_dim) or 32
    if isinstance(batch_size, bool) or int(batch_size) < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    if param_dtype is not None:
        param_dtype = float_dtype(param_dtype)
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
    model, compiled = eager_of(model)
    sim = Simulation(model, example_input=example_input, input_shape=input_shape, input_dtype=input_dtype,
                     loss=loss, cuda=cuda, prec=prec, factory=factory, workspace=workspace,
                     replay_later=REPLAY_LATER_STEPS, memo=MEMO_META_OPS, cudnn=CUDNN_WORKSPACES,
                     batch_dim=batch_dim, param_dtype=param_dtype)
    first = sim.run(batch_size, True, want_parts=True)
    # the per-sample slope of each row's kept bytes: one more forward pass at batch + 1
    second = sim.run(batch_size + 1, True, steps=1, forward_only=True)
    rows = _rows(first, second, sim.params, info, prec, batch_size)
    peak_fn, parts_fn, phases_fn = _evaluators(sim, first, batch_size)
    est = Estimate(framework="torch", model=name or type(model).__name__, batch_size=batch_size,
                   precision=prec.name, optimizer=info.to_dict(), layers=rows, method="simulated",
                   device="cuda" if cuda else "cpu",
                   input_bytes_per_sample=input_bytes(model, example_input, input_shape, input_dtype,
                                                      batch_dim=batch_dim, cast=param_dtype),
                   extra_persistent_bytes=CUBLAS_WORKSPACES * workspace, _peak_fn=peak_fn, _parts_fn=parts_fn,
                   _phases_fn=phases_fn)
    est._cache[(batch_size, True)] = {k: v for k, v in first.items() if k not in _TABLE_KEYS}
    if compiled:
        est.warnings.append(COMPILED_NOTE)
    # the step's own forward or backward read a value the meta device does not have: what it
    # allocates may follow the data (a measurement carries such a model by its own points)
    est.data_dependent = any(phase != "update" for _, phase in first["read_values"])  # type: ignore[attr-defined]
    for where, phase in first["read_values"]:
        who = f"the optimizer's step ({info.name})" if phase == "update" else f"module '{where}' ({phase} pass)"
        est.warnings.append(f"{who} read a tensor's value (.item(), bool() or a data-dependent branch), which a "
                            f"meta-device simulation does not have; it was answered with true / 1, the path a step "
                            f"without padding or overflow takes. If memory there depends on the value, measure "
                            f"one step instead")
    for w in est.warnings:
        warnings.warn(f"distmem.estimate: {w}", stacklevel=2)
    return est


def state_estimate(model: Any, *, batch_size: int, optimizer: Any, precision: Any = None, device: str = "cuda",
                   name: Optional[str] = None, why: str = "") -> Estimate:
    """The model's state alone (weights, gradients, optimizer slots per module; no step): what a
    measurement of a model the meta device cannot run is carried with. ``model_ran`` is False and
    ``why_not_modelled`` says why."""
    model, _ = eager_of(model)
    info = torch_optimizer(optimizer)
    prec = resolve_precision(precision)
    rows: List[LayerEstimate] = []
    counted: set = set()
    for mname, m in model.named_modules():
        r = LayerEstimate(name=mname or "(model)", kind=type(m).__name__)
        for p in m.parameters(recurse=False):
            if id(p) not in counted:
                counted.add(id(p))
                _count_parameter(r, p, info)
        if r.params:
            rows.append(r)
    state = sum(r.param_bytes + r.grad_bytes + r.optimizer_bytes for r in rows)

    def peak_fn(batch: int, train: bool) -> Dict[str, Any]:
        return {"peak": state, "phase": "state", "node": -1, "batch": batch}

    def parts_fn(batch: int) -> Dict[str, int]:
        return {"weights": sum(r.param_bytes for r in rows), "gradients": sum(r.grad_bytes for r in rows),
                "optimizer state": sum(r.optimizer_bytes for r in rows)}
    est = Estimate(framework="torch", model=name or type(model).__name__, batch_size=int(batch_size),
                   precision=prec.name, optimizer=info.to_dict(), layers=rows, method="state",
                   device="cpu" if str(device).lower() == "cpu" else "cuda", _peak_fn=peak_fn, _parts_fn=parts_fn)
    est.model_ran = False  # type: ignore[attr-defined]
    est.why_not_modelled = why  # type: ignore[attr-defined]
    return est


def float_dtype(value: Any) -> Any:
    """A torch floating dtype from a dtype or its name (``"bfloat16"``, ``"bf16"``, ``torch.float16``)."""
    torch = import_torch()
    if isinstance(value, torch.dtype):
        return value
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}.get(
        str(value).replace("torch.", "").lower(), str(value).replace("torch.", "").lower())
    got = getattr(torch, name, None)
    if not isinstance(got, torch.dtype) or not got.is_floating_point:
        raise ConfigError(f"param_dtype={value!r}: give a floating dtype such as bfloat16, float16 or float32")
    return got


def _evaluators(sim: Simulation, first: Dict[str, Any], batch_size: int):
    """The estimate's peak and parts functions at any batch (simulated once per batch, cached)."""
    cache = {(batch_size, True): first}

    def parts_fn(batch: int) -> Dict[str, int]:
        if "parts" not in cache.get((batch, True), {}):
            cache[(batch, True)] = sim.run(batch, False, want_parts=True)
        parts = cache[(batch, True)].get("parts")
        if parts is None:
            raise ConfigError("this torch estimate has no per-part record of its peak (steps are not replayed "
                              "from a trace); estimate again with distmem.estimate.torch.estimate.REPLAY_LATER_STEPS")
        return dict(parts)

    def phases_fn(batch: int) -> Dict[str, Dict[str, int]]:
        parts_fn(batch)
        return {k: dict(v) for k, v in (cache[(batch, True)].get("phase_parts") or {}).items()}

    def peak_fn(batch: int, train: bool) -> Dict[str, Any]:
        if train:
            if (batch, True) not in cache:
                cache[(batch, True)] = sim.run(batch, False)
            return {k: v for k, v in cache[(batch, True)].items() if k not in _TABLE_KEYS}
        args, kwargs = example_inputs(sim.model, sim.example_input, sim.input_shape, batch, sim.input_dtype,
                                      batch_dim=sim.batch_dim, cast=sim.param_dtype)
        peak = inference_peak(sim.model, sim.params, sim.buffers, args, kwargs, sim.cuda, sim.prec, sim.cudnn,
                               sim.memo, sim.param_dtype)
        return {"peak": peak, "phase": "forward", "node": -1, "batch": batch}
    return peak_fn, parts_fn, phases_fn


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
            or not r.name.endswith(ROW_OWN)]
