"""Real training steps of a torch module at small batches, measured by torch's CUDA allocator.

The step is what the estimate simulates: forward (under ``torch.autocast`` for a mixed precision),
the same loss (``loss=`` of the estimate: cross-entropy over the last dimension by default), the
loss scaled as ``GradScaler`` does under fp16, backward, a fresh optimizer of the same class and
options, ``zero_grad(set_to_none=True)``. Checkpointed modules recompute as they do in training,
and a ``torch.compile``d module runs compiled. Where the module lives decides how it is run:

* a module whose parameters are on the meta device (a spec, built without weights) cannot run: the
  caller rebuilds it on the GPU (:func:`materialise` for specs) or falls back to the model;
* with CUDA already started in this process: on a private copy of the module, here;
* before CUDA starts: in a forked child, which copies the module with the process and starts CUDA
  itself, so this process never touches the GPU (``distmem.init`` can still set its limits).

torch's CPU allocator keeps no statistics, so without a GPU nothing is measured.
"""
from __future__ import annotations

import contextlib
import copy
import os
import pickle
import select
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from ...errors import ConfigError

__all__ = ["torch_step_peaks", "measure_torch", "FORK_TIMEOUT_S"]

#: A forked measuring child that has not answered by then is killed and the model used instead.
FORK_TIMEOUT_S = 600.0

#: Steps GradScaler may skip (fp16 gradients that overflowed at the first loss scales) before a
#: batch's measurement stops without an update.
MAX_SKIPPED = 8


def _real_inputs(args, kwargs, batch: int, device):
    """The example inputs at ``batch`` as real tensors on ``device``: floating ones normal, integer
    ones zeros (token ids, class indices), booleans true."""
    import torch

    def real(t):
        if not torch.is_tensor(t):
            return t
        shape = (batch, *t.shape[1:]) if t.dim() > 0 else t.shape
        if t.is_floating_point():
            return torch.randn(shape, dtype=t.dtype, device=device)
        if t.dtype == torch.bool:
            return torch.ones(shape, dtype=t.dtype, device=device)
        return torch.zeros(shape, dtype=t.dtype, device=device)
    return tuple(real(a) for a in args), {k: real(v) for k, v in kwargs.items()}


def torch_step_peaks(model: Any, batches: Sequence[int], *, inputs: Callable[[int], Any], optimizer: Any,
                     precision: Any, loss: Any = "auto", steps: int = 2, device: str = "cuda") -> Dict[str, Any]:
    """``max_memory_allocated`` of ``steps`` real training steps of ``model`` (already on
    ``device``) at each of ``batches``; ``inputs(batch)`` gives ``(args, kwargs)`` like the
    model's input. The peaks are what the step allocated beyond what was held before it started
    (the module's weights are added back), so a busy process reads as a fresh one."""
    import torch
    from ..optimizers import torch_optimizer_factory
    from ..precision import resolve_precision
    prec = resolve_precision(precision)
    cdt = torch.bfloat16 if "bfloat16" in prec.name else torch.float16
    t0 = time.time()
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch_optimizer_factory(optimizer)(trainable, {})
    scaler = torch.amp.GradScaler("cuda") if prec.loss_scaling else None
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    torch.cuda.synchronize()
    other = max(0, torch.cuda.memory_allocated() - weights)
    peaks: Dict[int, int] = {}
    per_step: Dict[int, List[int]] = {}
    for b in batches:
        args, kwargs = _real_inputs(*inputs(int(b)), int(b), device)
        seen: List[int] = []
        stepped = 0
        # a step whose fp16 gradients overflowed is skipped by GradScaler (no update, no optimizer
        # state): such steps do not count towards ``steps``, up to MAX_SKIPPED of them
        while stepped < max(1, steps) and len(seen) < max(1, steps) + MAX_SKIPPED:
            seen.append(max(0, _one_step(model, args, kwargs, opt, scaler, prec, cdt, loss) - other))
            stepped += 1 if scaler is None or not getattr(scaler, "_distmem_skipped", False) else 0
        per_step[int(b)] = seen
        peaks[int(b)] = max(seen)
        del args, kwargs
    return {"device": f"cuda:{torch.cuda.current_device()}", "gpu": torch.cuda.get_device_name(),
            "peaks": peaks, "steps": per_step, "seconds": round(time.time() - t0, 3)}


def _one_step(model, args, kwargs, opt, scaler, prec, cdt, loss) -> int:
    """One real step; its ``max_memory_allocated`` (bytes). Marks ``scaler._distmem_skipped``
    when GradScaler skipped the update (its scale went down)."""
    import torch
    from ..torch.inputs import step_loss
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ctx = torch.autocast("cuda", dtype=cdt) if prec.cast_weights else contextlib.nullcontext()
    with ctx:
        out = model(*args, **kwargs)
        value = step_loss(out, loss)
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
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def _on_meta(model) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def measure_torch(model: Any, batches: Sequence[int], *, inputs: Callable[[int], Any], optimizer: Any,
                  precision: Any, loss: Any = "auto", steps: int = 2) -> Optional[Dict[str, Any]]:
    """Measure a live module where it can be: ``None`` with the reason in ``"why"`` raised as
    ConfigError where it cannot (no GPU, weights on the meta device)."""
    import torch
    if _on_meta(model):
        raise ConfigError(f"{type(model).__name__} has its weights on the meta device, so it cannot run a real "
                          f"step; give a spec (torchvision:NAME, hf:NAME, module:factory) to have it rebuilt on the "
                          f"GPU, or build it with weights")
    run = dict(inputs=inputs, optimizer=optimizer, precision=precision, loss=loss, steps=steps)
    if torch.cuda.is_initialized():
        twin = _twin(model)
        try:
            return torch_step_peaks(twin, batches, **run)
        finally:
            del twin
            torch.cuda.empty_cache()
    return _forked(model, batches, run)


def _twin(model):
    """A private copy of ``model`` on the GPU; a compiled module's copy compiled again (a compiled
    graph belongs to the module it was made for)."""
    import torch
    from ..torch.estimate import eager_of
    eager, compiled = eager_of(model)
    twin = copy.deepcopy(eager if compiled else model).to("cuda")
    if compiled:
        twin._compiled_call_impl = None
        twin = torch.compile(twin)
    return twin


def _forked(model, batches, run) -> Dict[str, Any]:
    """The measurement in a forked child (CUDA is not started here, and stays so)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, answer, leave without running the parent's exit handlers
        os.close(r)
        try:
            import torch
            if not torch.cuda.is_available():
                raise ConfigError("no CUDA device is visible, and torch's CPU allocator keeps no statistics")
            answer = (True, torch_step_peaks(model.to("cuda"), batches, **run))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            answer = (False, f"{type(exc).__name__}: {str(exc)[:300]}")
        with os.fdopen(w, "wb") as f:
            f.write(pickle.dumps(answer))
        os._exit(0)
    os.close(w)
    data = b""
    deadline = time.time() + FORK_TIMEOUT_S
    with os.fdopen(r, "rb") as f:
        while time.time() < deadline:
            ready, _, _ = select.select([f], [], [], max(0.0, deadline - time.time()))
            if not ready:
                break
            chunk = os.read(f.fileno(), 1 << 16)
            if not chunk:
                break
            data += chunk
    try:
        if not data:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
    except (ChildProcessError, ProcessLookupError, OSError):
        pass
    if not data:
        raise ConfigError(f"the measuring child gave no answer within {FORK_TIMEOUT_S:.0f} s")
    ok, value = pickle.loads(data)
    if not ok:
        raise ConfigError(f"measuring in a forked child failed ({value})")
    return value
