"""The one NVML binding: every ``pynvml`` call in distmem goes through :func:`nvml_query`.

NVML creates no CUDA context, so it is safe before any framework starts. Initialised lazily and
once (thread-safe); when it cannot start, the reason is kept and every query returns its default.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict

__all__ = ["nvml_available", "nvml_query", "nvml_error", "nvml_handle_module", "text"]

_NA = object()
_lock = threading.Lock()
_state: Dict[str, Any] = {"init": None, "error": None}


def nvml_handle_module() -> Any:
    import pynvml  # provided by nvidia-ml-py

    return pynvml


def nvml_available() -> bool:
    """Initialise NVML once (thread-safe); False, with the reason kept, when it cannot start."""
    with _lock:
        if _state["init"] is None:
            try:
                nvml_handle_module().nvmlInit()
                _state["init"] = True
            except ImportError:
                _state["init"], _state["error"] = False, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
            except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
                _state["init"], _state["error"] = False, f"NVML did not start: {exc}"
        return bool(_state["init"])


def nvml_query(func: str | Callable, *args: Any, default: Any = _NA) -> Any:
    """Call an NVML function by name (or object); every NVML call in distmem goes through here.

    Returns ``default`` when NVML is unavailable or the call fails ("not supported", a vanished
    process, an older driver); without a ``default`` the error propagates.
    """
    if not nvml_available():
        if default is _NA:
            raise RuntimeError(_state["error"])
        return default
    try:
        # A binding without the function (an older nvidia-ml-py) is "not supported" too.
        fn = getattr(nvml_handle_module(), func) if isinstance(func, str) else func
        return fn(*args)
    except Exception:  # noqa: BLE001
        if default is _NA:
            raise
        return default


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)




def nvml_error() -> str:
    """Why NVML is not available ("" when it is)."""
    return str(_state["error"] or "")
