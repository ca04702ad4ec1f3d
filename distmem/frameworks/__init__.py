"""Framework adapters: apply a plan and read allocator stats. Each module exposes

``apply(plan, **kw) -> dict``  configure the framework for ``plan.mine`` (before its GPUs start)
``stats(plan) -> dict``        allocator figures: current_bytes, peak_bytes, reserved_bytes, devices
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Optional

from ..errors import ConfigError

__all__ = ["detect_framework", "adapter", "FRAMEWORKS"]

FRAMEWORKS = ("tensorflow", "torch", "none")


def detect_framework(explicit: Optional[str] = None) -> str:
    """The framework to configure: the explicit choice, else one already imported, else installed."""
    if explicit is not None:
        name = {"tf": "tensorflow", "pytorch": "torch", "keras": "tensorflow"}.get(explicit, explicit)
        if name not in FRAMEWORKS:
            raise ConfigError(f"framework={explicit!r} is not one of {', '.join(FRAMEWORKS)}")
        return name
    for mod, name in (("tensorflow", "tensorflow"), ("horovod.tensorflow", "tensorflow"), ("keras", "tensorflow"),
                      ("torch", "torch"), ("horovod.torch", "torch")):
        if mod in sys.modules:
            return name
    for name in ("tensorflow", "torch"):
        if importlib.util.find_spec(name) is not None:
            return name
    return "none"


def adapter(name: str) -> ModuleType:
    if name == "none":
        return importlib.import_module("distmem.frameworks.none")
    return importlib.import_module(f"distmem.frameworks.{name}")
