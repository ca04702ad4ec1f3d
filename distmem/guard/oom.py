"""Is this exception an out-of-memory error? One classifier for every framework, no framework imported.

Covered: TensorFlow's ``ResourceExhaustedError``; ``torch.cuda.OutOfMemoryError`` (``torch.OutOfMemoryError``
since torch 2.5 is the same class); Python's ``MemoryError``; and allocator failures that reach Python as
a plain ``RuntimeError`` or a TensorFlow ``OpError`` of another code (torch's CPU allocator, cuBLAS/cuDNN
workspace allocation, XLA, an OOM raised inside ``tf.py_function``). An explicit cause (``raise X from oom``)
is followed. Anything else is not an OOM and the guard lets it propagate unchanged.

:func:`install` (called by ``distmem.init()`` unless ``DISTMEM_POSTMORTEM=0``) makes every
out-of-memory error write this rank's record (:mod:`distmem.observe.oom_record`): torch's allocator
observer (every CUDA OOM, caught or not, with the allocator's state at the moment it failed), the
exception hooks (an OOM nobody caught: TensorFlow's ``ResourceExhaustedError`` out of ``model.fit``,
the native cap's refusal as the framework raises it), and the guard (each OOM it classifies here).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Dict, Optional, Tuple

__all__ = ["is_oom", "describe", "OOM_MESSAGES", "install", "uninstall", "record_oom", "record_stopped", "installed",
           "use_allocator"]

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
    """True when ``exc`` (or an explicit ``__cause__`` of it, up to 5 deep) is an out-of-memory error.
    Once :func:`install` ran, an OOM seen here for the first time also writes this rank's record."""
    found = _is_oom_chain(exc)
    if found and _hooks["on"] and exc is not None:
        _seen_exception(exc, "guard")
    return found


def _is_oom_chain(exc: Optional[BaseException]) -> bool:
    depth = 0
    while exc is not None and depth < 5:
        if _is_oom_one(exc):
            return True
        exc = exc.__cause__
        depth += 1
    return False


# -- the post-mortem hooks ----------------------------------------------------------------------

_hooks: Dict[str, Any] = {"on": False, "allocator": None, "run_dir": None, "last": 0.0, "seen": [],
                          "excepthook": None, "thread_hook": None, "busy": False}
_hook_lock = threading.Lock()
#: An exception seen this soon after the allocator's observer wrote the record is the same OOM: it
#: adds its message, not a second record.
SAME_OOM_SECONDS = 5.0


def installed() -> bool:
    return bool(_hooks["on"])


def record_oom(source: str, error: str = "", **figures: Any) -> Optional[str]:
    """Write this rank's out-of-memory record now; the path, or None where it could not be written
    (never raises: it runs inside an allocator callback and exception hooks)."""
    from ..observe import oom_record

    with _hook_lock:
        if _hooks["busy"]:
            return None
        _hooks["busy"] = True
    try:
        rec = oom_record.build_record(source=source, error=error, allocator=_hooks["allocator"], **figures)
        path = oom_record.write_record(rec, _hooks["run_dir"])
        if rec["kind"] == "oom":
            _hooks["last"] = time.monotonic()
            _hooks["last_path"] = path
        return path
    except Exception as exc:  # noqa: BLE001 - the user's own error must surface, not ours
        sys.stderr.write(f"[distmem] could not write the out-of-memory record: {exc}\n")
        return None
    finally:
        _hooks["busy"] = False


def record_stopped(cause: str) -> Optional[str]:
    """Another rank failed and fail fast stops this one: write what this rank held (``kind``
    ``stopped``: its allocator, its steps, what its step was fed) so that the post-mortem compares
    the rank that ran out with its peers. Nothing where this process already wrote an out-of-memory
    record, or the hooks are off."""
    if not _hooks["on"] or _hooks.get("last_path"):
        return None
    return record_oom("stopped", cause, kind="stopped")


def _seen_exception(exc: BaseException, source: str) -> None:
    seen = _hooks["seen"]
    if any(e is exc for e in seen):
        return
    seen.append(exc)
    del seen[:-4]
    text = describe(exc, limit=1000)
    path = _hooks.get("last_path")
    if path and time.monotonic() - _hooks["last"] < SAME_OOM_SECONDS:
        _add_error(path, text)  # the allocator's observer wrote this OOM's figures a moment ago
        return
    record_oom(source, text)


def _add_error(path: str, text: str) -> None:
    import json
    import os

    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
        if rec.get("pid") != os.getpid() or rec.get("error"):
            return
        rec["error"] = text
        from ..observe import oom_record

        oom_record.write_record(rec, _hooks["run_dir"], count=False)
    except (OSError, ValueError):
        pass


def _observer(device: int, requested: int, cap_or_total: int, free: int) -> None:
    if not _hooks["on"]:
        return
    record_oom("torch-allocator", "", request_bytes=int(requested), device=int(device), cap_bytes=int(cap_or_total),
               device_free_bytes=int(free))


def install(run_dir: Optional[str] = None, allocator: Any = None) -> None:
    """Make every out-of-memory error of this process write its rank's record to ``run_dir``
    (default :func:`distmem.settings.run_dir`). ``allocator``: the allocator to read (default torch's
    when torch is imported; tests pass a fake). Calling it again replaces both; idempotent hooks."""
    _hooks["run_dir"] = run_dir
    if allocator is None and "torch" in sys.modules:
        try:
            from ..observe.oom_record import TorchAllocator

            allocator = TorchAllocator()
        except Exception:  # noqa: BLE001 - a torch without CUDA support: exception hooks only
            allocator = None
    if allocator is not None and allocator is not _hooks["allocator"]:
        attach = getattr(allocator, "attach", None)
        if attach is not None:
            attach(_observer)
    _hooks["allocator"] = allocator
    _note_steps_from(allocator)
    if _hooks["on"]:
        return
    _hooks["on"] = True
    _hooks["excepthook"] = sys.excepthook

    def excepthook(kind: Any, value: Any, tb: Any) -> None:
        if value is not None and _is_oom_chain(value):
            _seen_exception(value, "exception")
        elif isinstance(value, Exception):
            # another error ends this rank (often a peer's death seen by the transport before fail
            # fast said so): what it held, for the post-mortem's comparison with the rank that ran out
            record_stopped(describe(value, limit=400))
        (_hooks["excepthook"] or sys.__excepthook__)(kind, value, tb)

    sys.excepthook = excepthook
    _hooks["thread_hook"] = threading.excepthook

    def thread_hook(args: Any) -> None:
        if args.exc_value is not None and _is_oom_chain(args.exc_value):
            _seen_exception(args.exc_value, "exception")
        (_hooks["thread_hook"] or threading.__excepthook__)(args)

    threading.excepthook = thread_hook


def use_allocator(allocator: Any) -> None:
    """Read (and observe) ``allocator`` instead of torch's, leaving the hooks as they are: on where
    ``init()`` installed them, off under ``DISTMEM_POSTMORTEM=0`` (tests pass a fake CUDA allocator)."""
    if allocator is not _hooks["allocator"] and getattr(allocator, "attach", None) is not None:
        allocator.attach(_observer)
    _hooks["allocator"] = allocator
    _note_steps_from(allocator)


def _note_steps_from(allocator: Any) -> None:
    from ..observe import oom_record

    oom_record.use_allocator(allocator)


def uninstall() -> None:
    """Undo :func:`install` (tests); torch's observer cannot be detached, it stays silent."""
    if not _hooks["on"]:
        return
    sys.excepthook = _hooks["excepthook"] or sys.__excepthook__
    threading.excepthook = _hooks["thread_hook"] or threading.__excepthook__
    _hooks.update(on=False, allocator=None, run_dir=None, seen=[], last=0.0, last_path=None)
    from ..observe import oom_record

    oom_record.use_allocator(None)
    oom_record.forget()


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
