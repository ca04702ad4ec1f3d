"""Is this exception an out-of-memory error? One classifier for every framework, no framework imported.

Covered: TensorFlow's ``ResourceExhaustedError``; ``torch.cuda.OutOfMemoryError`` (``torch.OutOfMemoryError``
since torch 2.5 is the same class); Python's ``MemoryError``; and allocator failures that reach Python as
a plain ``RuntimeError`` or a TensorFlow ``OpError`` of another code (torch's CPU allocator, cuBLAS/cuDNN
workspace allocation, XLA, an OOM raised inside ``tf.py_function``). An explicit cause (``raise X from oom``)
is followed. Anything else is not an OOM and the guard lets it propagate unchanged.
"""
from __future__ import annotations

import sys
from typing import Optional, Tuple

__all__ = ["is_oom", "describe", "OOM_MESSAGES"]

#: Lower-case fragments that mark an allocator failure inside a RuntimeError / OpError message.
OOM_MESSAGES: Tuple[str, ...] = (
    "out of memory",                            # CUDA/HIP "CUDA out of memory", "CUDA error: out of memory", XLA
    "oom when allocating",                      # TensorFlow BFC / CPU allocator
    "defaultcpuallocator: can't allocate memory",  # torch CPU allocator
    "resource_exhausted",                       # XLA / gRPC status spelling
    "cublas_status_alloc_failed",               # cuBLAS workspace
    "cudnn_status_alloc_failed",
    "failed to allocate memory",
    "resourceexhaustederror",                   # a TF OOM re-raised through tf.py_function (UnknownError)
)


def _oom_types() -> Tuple[type, ...]:
    """OOM exception classes of the frameworks already imported (never imports one)."""
    types: list = [MemoryError]
    torch = sys.modules.get("torch")
    if torch is not None:
        for cls in (getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None),
                    getattr(torch, "OutOfMemoryError", None)):
            if isinstance(cls, type):
                types.append(cls)
    errors = sys.modules.get("tensorflow.python.framework.errors_impl")
    if errors is not None and isinstance(getattr(errors, "ResourceExhaustedError", None), type):
        types.append(errors.ResourceExhaustedError)
    return tuple(types)


def _message_checked(exc: BaseException) -> bool:
    """Only errors that allocators raise are read for OOM phrases (a KeyError("out of memory") is not one)."""
    if isinstance(exc, (RuntimeError, OSError)):
        return True
    return any(c.__name__ == "OpError" for c in type(exc).__mro__)


def _is_oom_one(exc: BaseException) -> bool:
    if isinstance(exc, _oom_types()):
        return True
    if _message_checked(exc):
        text = str(exc).lower()
        return any(m in text for m in OOM_MESSAGES)
    return False


def is_oom(exc: Optional[BaseException]) -> bool:
    """True when ``exc`` (or an explicit ``__cause__`` of it, up to 5 deep) is an out-of-memory error."""
    depth = 0
    while exc is not None and depth < 5:
        if _is_oom_one(exc):
            return True
        exc = exc.__cause__
        depth += 1
    return False


def describe(exc: BaseException, limit: int = 240) -> str:
    """``Type: first meaningful line of the message``, short enough for a log line and a collective."""
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # TF graph errors start with "Graph execution error:" and a traceback of where the node was defined;
    # the allocator's (or the Python error's) own words come further down
    noise = ("graph execution error", "detected at node", "file \"", "traceback (most recent", "[[{{node")
    plain = [ln for ln in lines if not ln.lower().startswith(noise) and not ln.startswith(("File ", "^"))]
    key = next((ln for ln in lines if any(m in ln.lower() for m in OOM_MESSAGES)),
               next((ln for ln in plain if ":" in ln and not ln.endswith(":")), plain[0] if plain else
                    (lines[0] if lines else "")))
    if len(key) > limit:
        key = key[: limit - 3] + "..."
    return f"{type(exc).__name__}: {key}" if key else type(exc).__name__
