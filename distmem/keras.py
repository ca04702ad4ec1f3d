"""Old import path of the Keras callbacks, kept for one release: import ``distmem.report.keras`` instead."""
from __future__ import annotations

from typing import Any

from .report.keras import __all__  # noqa: F401


def __getattr__(name: str) -> Any:
    # MemoryReport is built on first access (it needs TensorFlow's Keras).
    from .report import keras as _new

    return getattr(_new, name)
