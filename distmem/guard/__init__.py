"""OOM guard that keeps every rank in step.

* :func:`step` — a guarded training step for hand-written loops: micro-batches with gradient
  accumulation, one tiny flag all-reduce per step, and on an out-of-memory error on any rank a
  consistent fallback to a smaller micro-batch with the global batch unchanged.
* :class:`KerasGuard` (``distmem.guard.keras``) — the same for ``model.fit``, as a callback.
* :func:`find_batch_size` — a start-up probe whose result every rank agrees on.
* :func:`is_oom` — the classifier: TensorFlow, PyTorch (CUDA and CPU allocator), MemoryError.

The protocol, its costs and what happens on other errors and timeouts: docs/guard.md.
"""
from .errors import BatchSizeFloorError, GuardError, PeerError
from .finder import find_batch_size
from .flags import Status, Verdict, flag_reducer
from .oom import describe, is_oom
from .step import Fallback, StepGuard, step

__all__ = ["step", "StepGuard", "Fallback", "find_batch_size", "is_oom", "describe",
           "GuardError", "PeerError", "BatchSizeFloorError", "Status", "Verdict", "flag_reducer"]


def __getattr__(name: str):  # KerasGuard: not in __all__, so a star-import never pulls in TensorFlow
    if name == "KerasGuard":  # imports TensorFlow: only on use
        from .keras import KerasGuard

        return KerasGuard
    raise AttributeError(f"module 'distmem.guard' has no attribute {name!r}")
