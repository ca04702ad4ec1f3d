"""Real training steps of a torch module at small batches, measured by torch's CUDA allocator.

The step is what the estimate simulates: forward (under ``torch.autocast`` for a mixed precision;
with the parameters and floating inputs in ``param_dtype`` for FSDP2's ``MixedPrecisionPolicy``),
the same loss (``loss=`` of the estimate, ``loss(output)`` or ``loss(output, batch)``:
cross-entropy over the last dimension by default), the loss scaled as ``GradScaler`` does under
fp16, backward, a fresh optimizer of the same class and options, ``zero_grad(set_to_none=True)``.
Checkpointed modules recompute as they do in training, and a ``torch.compile``d module runs
compiled. The inputs are the user's own (``inputs.real_inputs``: values, dtypes and memory format
kept), so a model whose memory follows its data (experts chosen per token, rows picked by a mask)
is measured on that data.

Every measurement runs in a spawned child (a fresh interpreter started by
``distmem.estimate.isolated``, never a fork), whatever this process did with CUDA: a spec is
rebuilt there from its text; a live module is handed over as its state and code (``torch.save``
of the module, its class imported there from where it is here: a class of the running script is
found by loading the script under ``__mp_main__``, as ``multiprocessing``'s spawn does, so the
script's own work must sit under ``if __name__ == "__main__":``). A module whose weights are on the
meta device cannot run: give a spec. torch's CPU allocator keeps no statistics, so without a GPU
nothing is measured.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Sequence

from ...errors import ConfigError

__all__ = ["torch_step_peaks", "measure_torch", "MEASURE_TIMEOUT_S", "portable_optimizer", "as_param_dtype",
           "dtype_or_none"]

#: A measuring child that has not answered by then is stopped and the model used instead.
MEASURE_TIMEOUT_S = 600.0

#: Steps GradScaler may skip (fp16 gradients that overflowed at the first loss scales) before a
#: batch's measurement stops without an update.
MAX_SKIPPED = 8


def torch_step_peaks(model: Any, batches: Sequence[int], *, inputs: Callable[[int], Any], optimizer: Any,
                     precision: Any, loss: Any = "auto", steps: int = 2, device: str = "cuda") -> Dict[str, Any]:
    """``max_memory_allocated`` of ``steps`` real training steps of ``model`` (already on
    ``device``) at each of ``batches``; ``inputs(batch)`` gives ``(args, kwargs)`` like the
    model's input, real tensors on ``device``. The peaks are what the step allocated beyond what
    was held before it started (the module's weights are added back), so a busy process reads as a
    fresh one. On ``"cpu"`` (whose allocator keeps no statistics) the profiler's memory events give
    the step's peak, and what the step holds before it starts (weights, buffers, optimizer state,
    inputs) is added: the same figure, for tests and machines without a GPU."""
    import torch
    from ..optimizers import torch_optimizer_factory
    from ..precision import resolve_precision
    prec = resolve_precision(precision)
    cdt = torch.bfloat16 if "bfloat16" in prec.name else torch.float16
    t0 = time.time()
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch_optimizer_factory(optimizer)(trainable, {})
    cuda = str(device).startswith("cuda")
    scaler = torch.amp.GradScaler("cuda" if cuda else "cpu") if prec.loss_scaling else None
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if cuda:
        torch.cuda.synchronize()
    other = max(0, torch.cuda.memory_allocated() - weights) if cuda else 0
    peaks: Dict[int, int] = {}
    per_step: Dict[int, List[int]] = {}
    for b in batches:
        args, kwargs = inputs(int(b))
        seen: List[int] = []
        stepped = 0
        # a step whose fp16 gradients overflowed is skipped by GradScaler (no update, no optimizer
        # state): such steps do not count towards ``steps``, up to MAX_SKIPPED of them
        while stepped < max(1, steps) and len(seen) < max(1, steps) + MAX_SKIPPED:
            seen.append(max(0, _one_step(model, args, kwargs, opt, scaler, prec, cdt, loss, cuda) - other))
            stepped += 1 if scaler is None or not getattr(scaler, "_distmem_skipped", False) else 0
        per_step[int(b)] = seen
        peaks[int(b)] = max(seen)
        del args, kwargs
    if not cuda:
        return {"device": "CPU (profiler memory events)", "peaks": peaks, "steps": per_step,
                "seconds": round(time.time() - t0, 3)}
    return {"device": f"cuda:{torch.cuda.current_device()}", "gpu": torch.cuda.get_device_name(),
            "peaks": peaks, "steps": per_step, "seconds": round(time.time() - t0, 3)}


def _held(model, opt, args, kwargs) -> int:
    """Bytes a CPU step starts with: weights, buffers, gradients, optimizer state, the inputs."""
    import torch
    seen, total = set(), 0
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)),
               *(t for t in (*args, *kwargs.values()) if torch.is_tensor(t))]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _cpu_peak(fn) -> int:
    """The CPU allocator's peak over ``fn()`` beyond what was held before (the profiler's events)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        cur += nbytes
        peak = max(peak, cur)
    return peak


def _one_step(model, args, kwargs, opt, scaler, prec, cdt, loss, cuda: bool = True) -> int:
    """One real step; its ``max_memory_allocated`` (bytes). Marks ``scaler._distmem_skipped``
    when GradScaler skipped the update (its scale went down)."""
    import torch
    from ..torch.inputs import as_batch, step_loss
    if not cuda:
        held = _held(model, opt, args, kwargs)
        return held + _cpu_peak(lambda: _step(model, args, kwargs, opt, scaler, prec, cdt, loss, "cpu"))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _step(model, args, kwargs, opt, scaler, prec, cdt, loss, "cuda")
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def _step(model, args, kwargs, opt, scaler, prec, cdt, loss, device: str) -> None:
    import torch
    from ..torch.inputs import as_batch, step_loss
    ctx = torch.autocast(device, dtype=cdt) if prec.cast_weights else contextlib.nullcontext()
    with ctx:
        out = model(*args, **kwargs)
        value = step_loss(out, loss, as_batch(args, kwargs))
    if scaler is not None:
        before = scaler.get_scale()
        scaler.scale(value).backward()
        scaler.step(opt)
        scaler.update()
        scaler._distmem_skipped = scaler.get_scale() < before
    else:
        value.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    del out, value


def _on_meta(model) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def portable_optimizer(optimizer: Any) -> Any:
    """The optimizer as a child can rebuild it: a name or class as given, an optimizer object as
    its class and options (its parameters stay here)."""
    if optimizer is None or isinstance(optimizer, (str, type)):
        return optimizer
    return (type(optimizer), {k: v for k, v in dict(getattr(optimizer, "defaults", {}) or {}).items()
                              if k != "params"})


def as_param_dtype(model: Any, param_dtype: Any) -> Any:
    """The module with its floating parameters in ``param_dtype`` (FSDP2's MixedPrecisionPolicy)."""
    if param_dtype is None:
        return model
    from ..torch.estimate import float_dtype
    dt = float_dtype(param_dtype)
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dt)
    return model


def dtype_or_none(value: Any) -> Any:
    if value is None:
        return None
    from ..torch.estimate import float_dtype
    return float_dtype(value)


def _in_process(eager: Any, compiled: bool, batches: Sequence[int], *, example_input: Any, input_shape: Any,
                input_dtype: Any, batch_dim: Any, optimizer: Any, precision: Any, loss: Any, steps: int,
                param_dtype: Any, device: str, why: str) -> Dict[str, Any]:
    """A module that cannot be handed to a child (its class, or a hook on it, defined inside a
    function): measured here on a private copy, which starts CUDA in this process (said in ``how``)."""
    import copy
    import torch
    from ..torch.inputs import real_inputs
    if device != "cpu" and not torch.cuda.is_available():
        raise ConfigError("no CUDA device is visible, and torch's CPU allocator keeps no statistics")
    twin = as_param_dtype(copy.deepcopy(eager).to(device), param_dtype)
    if compiled:
        twin = torch.compile(twin)
    cast = dtype_or_none(param_dtype)
    try:
        got = torch_step_peaks(twin, batches, inputs=lambda b: real_inputs(twin, example_input, input_shape, b,
                                                                           input_dtype, device, batch_dim=batch_dim,
                                                                           cast=cast),
                               optimizer=optimizer, precision=precision, loss=loss, steps=steps, device=device)
    finally:
        del twin
        if device != "cpu":
            torch.cuda.empty_cache()
    got["in_process"] = (f"measured in this process on a private copy: the module could not be handed to a child "
                         f"({why}); define its classes and hooks at module level to keep CUDA out of this process")
    return got


def measure_torch(model: Any, batches: Sequence[int], *, example_input: Any, input_shape: Any, input_dtype: Any,
                  batch_dim: Any = 0, optimizer: Any, precision: Any, loss: Any = "auto", steps: int = 2,
                  param_dtype: Any = None, device: str = "cuda") -> Dict[str, Any]:
    """Measure a live module in a spawned child that rebuilds it from its state and code (see the
    module docstring); ConfigError where it cannot (weights on the meta device, a class the child
    cannot import, no GPU there)."""
    import torch
    from ..torch.estimate import eager_of
    if _on_meta(model):
        raise ConfigError(f"{type(model).__name__} has its weights on the meta device, so it cannot run a real "
                          f"step; give a spec (torchvision:NAME, hf:NAME, module:factory) to have it rebuilt on the "
                          f"GPU, or build it with weights")
    eager, compiled = eager_of(model)
    folder = tempfile.mkdtemp(prefix="distmem-measure-")  # private to this user (0700)
    try:
        path = os.path.join(folder, "module.pt")
        payload = {"model": eager, "compiled": compiled, "example_input": example_input, "loss": loss,
                   "optimizer": portable_optimizer(optimizer)}
        try:
            torch.save(payload, path)
        except Exception as exc:  # noqa: BLE001 - a class or hook defined inside a function
            got = _in_process(eager, compiled, batches, example_input=example_input, input_shape=input_shape,
                              input_dtype=input_dtype, batch_dim=batch_dim, optimizer=optimizer, precision=precision,
                              loss=loss, steps=steps, param_dtype=param_dtype, device=device,
                              why=f"{type(exc).__name__}: {str(exc)[:160]}")
            return got
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        mods = sorted({type(m).__module__ for m in eager.modules()} |
                      {getattr(x, "__module__", "") or "" for x in (loss, example_input) if callable(x)})
        from .. import isolated
        return isolated.call("distmem.estimate.measure.child:measure_module",
                             dict(model=f"{type(eager).__name__} (a live module)", payload=path,
                                  main=os.path.abspath(main) if main and "__main__" in mods else None,
                                  modules=[m for m in mods if m and m != "__main__"], batches=list(batches),
                                  input_shape=input_shape, input_dtype=input_dtype, batch_dim=batch_dim,
                                  precision=precision, steps=steps, param_dtype=param_dtype, device=device),
                             timeout=MEASURE_TIMEOUT_S, hide_gpus=False)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
