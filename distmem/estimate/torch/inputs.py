"""The step's inputs and loss on the meta device: the example batch at any size, its bytes, the
default loss."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from ...errors import ConfigError

__all__ = ["import_torch", "example_inputs", "step_loss", "input_bytes"]


def import_torch():
    try:
        import torch
    except ImportError:
        raise ConfigError("estimating a PyTorch module needs torch; install it (pip install torch)") from None
    return torch


def example_inputs(model: Any, example_input: Any, input_shape: Optional[Sequence[int]], batch: int,
             input_dtype: Any) -> Tuple[tuple, Dict[str, Any]]:
    """Positional and keyword inputs on the meta device at ``batch``."""
    torch = import_torch()
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



def step_loss(output: Any, loss: Any):
    torch = import_torch()
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



def input_bytes(model, example_input, input_shape, input_dtype) -> int:
    args, kwargs = example_inputs(model, example_input, input_shape, 1, input_dtype)
    torch = import_torch()
    return sum(t.numel() * t.element_size() for t in (*args, *kwargs.values()) if torch.is_tensor(t))
