"""The step's inputs and loss: the example batch at any size (on the meta device for the simulation,
as real tensors for a measurement), its bytes, the default loss.

What a user writes: ``example_input`` a tensor, a tuple/list (positional inputs) or a dict (keyword
inputs), or a callable ``example_input(batch)`` that builds the input at a batch (a graph's edges, an
``EmbeddingBag``'s flat indices and offsets: inputs whose size is not batch x something); a module
may carry an ``example_input(batch)`` method too. ``batch_dim``: where each input's batch is — an
int for all (default 0), None for an input that does not grow with the batch, or per input a
sequence (positional) or a dict (keyword) of those. A real input keeps the values, dtype and memory
format it was given (its samples repeated to the batch): token ids that route to experts, masks that
select rows, channels_last images.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from ...errors import ConfigError

__all__ = ["import_torch", "example_inputs", "real_inputs", "example_batch", "step_loss", "input_bytes",
           "as_batch", "loss_takes_batch"]


def import_torch():
    try:
        import torch
    except ImportError:
        raise ConfigError("estimating a PyTorch module needs torch; install it (pip install torch)") from None
    return torch


def _given(model: Any, example_input: Any, batch: int) -> Tuple[Any, bool]:
    """(the example as given or built at ``batch``, whether it was built at ``batch`` already)."""
    if example_input is None:
        hook = getattr(model, "example_input", None)
        if callable(hook):
            return hook(batch), True
        return hook, False
    torch = import_torch()
    if callable(example_input) and not torch.is_tensor(example_input):
        return example_input(batch), True
    return example_input, False


def _dims(example: Any, batch_dim: Any) -> Tuple[Sequence[Any], Dict[str, Any]]:
    """Per positional and keyword input, its batch dimension (an int or None)."""
    if isinstance(example, dict):
        keys = list(example)
        if isinstance(batch_dim, dict):
            unknown = sorted(set(batch_dim) - set(keys))
            if unknown:
                raise ConfigError(f"batch_dim names {unknown} but the inputs are {keys}; give one entry per input "
                                  "name (an int, or None for an input that does not grow with the batch)")
            return (), {k: batch_dim.get(k, 0) for k in keys}
        return (), {k: batch_dim for k in keys}
    n = len(example) if isinstance(example, (list, tuple)) else 1
    if isinstance(batch_dim, (list, tuple)):
        if len(batch_dim) != n:
            raise ConfigError(f"batch_dim={list(batch_dim)!r} gives {len(batch_dim)} dimensions for {n} inputs; give "
                              "one per positional input (None: the input does not grow with the batch)")
        return list(batch_dim), {}
    if isinstance(batch_dim, dict):
        raise ConfigError(f"batch_dim={batch_dim!r} is a dict but the inputs are positional; give a list, one per input")
    return [batch_dim] * n, {}


def _check_dim(t: Any, dim: Any, where: str) -> Optional[int]:
    if dim is None or t.dim() == 0:
        return None
    if isinstance(dim, bool) or not isinstance(dim, int) or not -t.dim() <= dim < t.dim():
        raise ConfigError(f"batch_dim {dim!r} for {where} of shape {tuple(t.shape)}: give a dimension in "
                          f"[{-t.dim()}, {t.dim() - 1}] or None")
    return dim % t.dim()


def _map(example: Any, batch_dim: Any, fn: Callable[[Any, Optional[int], str], Any]) -> Tuple[tuple, Dict[str, Any]]:
    torch = import_torch()
    pos, kw = _dims(example, batch_dim)

    def one(t: Any, dim: Any, where: str) -> Any:
        return fn(t, _check_dim(t, dim, where), where) if torch.is_tensor(t) else t
    if isinstance(example, dict):
        return (), {k: one(v, kw[k], f"input {k!r}") for k, v in example.items()}
    if isinstance(example, (list, tuple)):
        return tuple(one(t, d, f"input {i}") for i, (t, d) in enumerate(zip(example, pos))), {}
    return (one(example, pos[0], "the input"),), {}


def example_batch(model: Any, example_input: Any, batch_dim: Any = 0) -> Optional[int]:
    """The batch of the example as given (its first batched tensor's size along its batch
    dimension); None where the example is built per batch or absent."""
    torch = import_torch()
    if example_input is None or (callable(example_input) and not torch.is_tensor(example_input)):
        return None
    found = []
    _map(example_input, batch_dim, lambda t, d, w: found.append(int(t.shape[d])) if d is not None else None)
    return found[0] if found else None


def example_inputs(model: Any, example_input: Any, input_shape: Optional[Sequence[int]], batch: int,
                   input_dtype: Any, *, batch_dim: Any = 0, cast: Any = None) -> Tuple[tuple, Dict[str, Any]]:
    """Positional and keyword inputs on the meta device at ``batch``. ``cast``: a dtype the floating
    inputs are cast to (FSDP2's ``MixedPrecisionPolicy`` casts them to ``param_dtype``)."""
    torch = import_torch()
    example, built = _given(model, example_input, batch)
    if example is None:
        shape = tuple(input_shape or getattr(model, "_distmem_input_shape", None) or ())
        if not shape:
            raise ConfigError(f"{type(model).__name__}: give example_input= (a tensor or tuple of tensors with a "
                              f"batch dimension, or a function of the batch building one) or input_shape= (one "
                              f"sample, e.g. (3, 224, 224)); the module does not say what it takes")
        dtype = cast or input_dtype or torch.float32
        return (torch.empty((batch, *shape), dtype=dtype, device="meta"),), {}

    def meta(t: Any, dim: Optional[int], where: str) -> Any:
        shape = list(t.shape)
        if dim is not None and not built:
            shape[dim] = batch
        dtype = cast if cast is not None and t.is_floating_point() else t.dtype
        return torch.empty(shape, dtype=dtype, device="meta")
    return _map(example, batch_dim, meta)


def _memory_format(t: Any) -> Any:
    torch = import_torch()
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def real_inputs(model: Any, example_input: Any, input_shape: Optional[Sequence[int]], batch: int,
                input_dtype: Any, device: Any, *, batch_dim: Any = 0, cast: Any = None,
                seed: int = 0) -> Tuple[tuple, Dict[str, Any]]:
    """The inputs at ``batch`` as real tensors on ``device``, keeping what the user gave: a
    given tensor's samples repeated (or cut) to the batch along its batch dimension, its values,
    dtype and memory format kept; a callable example called at the batch. Only where no value was
    given (``input_shape``, an example on the meta device) are values drawn: normal floats,
    integers 0, masks true."""
    torch = import_torch()
    example, built = _given(model, example_input, batch)
    if example is None:
        args, kwargs = example_inputs(model, None, input_shape, batch, input_dtype, cast=cast)
        gen = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(a.shape, generator=gen).to(device=device, dtype=a.dtype) for a in args), kwargs

    gen = torch.Generator().manual_seed(seed)

    def real(t: Any, dim: Optional[int], where: str) -> Any:
        if t.device.type == "meta":  # a shape without values: drawn (floats normal, integers 0, masks true)
            shape = list(t.shape)
            if dim is not None and not built:
                shape[dim] = batch
            dtype = cast if cast is not None and t.is_floating_point() else t.dtype
            if t.is_floating_point():
                return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
            return (torch.ones if t.dtype == torch.bool else torch.zeros)(shape, dtype=dtype, device=device)
        fmt = _memory_format(t)
        if dim is not None and not built and t.shape[dim] != batch:
            if t.shape[dim] == 0:
                raise ConfigError(f"{where} has no sample along batch_dim {dim} to repeat to batch {batch}")
            idx = torch.arange(batch, device=t.device) % t.shape[dim]
            t = t.index_select(dim, idx)
        if cast is not None and t.is_floating_point():
            t = t.to(cast)
        return t.to(device=device).contiguous(memory_format=fmt)
    return _map(example, batch_dim, real)


def as_batch(args: tuple, kwargs: Dict[str, Any]) -> Any:
    """The inputs as the user's loss sees its batch: the one tensor, the tuple, or the dict."""
    if kwargs and not args:
        return dict(kwargs)
    if len(args) == 1 and not kwargs:
        return args[0]
    return tuple(args) if not kwargs else (tuple(args), dict(kwargs))


def loss_takes_batch(loss: Any) -> bool:
    """True for a loss written ``loss(output, batch)``; False for ``loss(output)``."""
    try:
        params = [p for p in inspect.signature(loss).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def step_loss(output: Any, loss: Any, batch: Any = None):
    """The step's scalar loss: ``loss(output)`` or ``loss(output, batch)`` for a callable; for
    ``"auto"``/``"cross_entropy"`` cross-entropy over the output's last dimension, computed in
    float32 (as Hugging Face's loss upcasts its logits); ``"sum"`` the output's sum."""
    torch = import_torch()
    if callable(loss):
        return loss(output, batch) if loss_takes_batch(loss) else loss(output)
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


def input_bytes(model, example_input, input_shape, input_dtype, *, batch_dim: Any = 0, cast: Any = None) -> int:
    """Bytes of one sample's inputs (for an input built per batch: the batch of one)."""
    args, kwargs = example_inputs(model, example_input, input_shape, 1, input_dtype, batch_dim=batch_dim, cast=cast)
    torch = import_torch()
    return sum(t.numel() * t.element_size() for t in (*args, *kwargs.values()) if torch.is_tensor(t))
