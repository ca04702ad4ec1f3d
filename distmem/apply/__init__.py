"""Stage: apply. Takes the :class:`~distmem.plan.Plan` and configures this rank's framework for
``plan.mine`` before the framework starts its GPUs (pin the device, memory growth or a hard
limit); returns what it did. Also reads the framework allocator's figures for the reports.

Every framework is an :class:`Adapter` (prepare / apply / stats / reset_peak, and started / too_late for
dry runs), found through the registry:
``adapter("torch")``. A new framework adds a module with those three functions and one
:func:`register` call; nothing else changes.
"""
from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from ..discover import runtime
from ..errors import ConfigError

if TYPE_CHECKING:
    from typing import Protocol

    from ..plan.types import Plan

    class Adapter(Protocol):
        """What a framework binding provides."""

        name: str

        def prepare(self, plan: "Plan") -> List[str]:
            """Set what the framework reads when it starts (environment), in dry runs too; returns actions."""

        def apply(self, plan: "Plan", **options: Any) -> Dict[str, Any]:
            """Configure the framework for ``plan.mine``; ``{"framework", "applied": [actions]}``."""

        def stats(self, plan: Optional["Plan"] = None) -> Dict[str, Any]:
            """Allocator figures in bytes: current_bytes, peak_bytes, reserved_bytes, devices."""

        def reset_peak(self, plan: Optional["Plan"] = None) -> None:
            """Start a new peak measurement."""

        def started(self) -> Any:
            """What the framework already initialised (its live devices), or None while it has not;
            never initialises anything itself. Read before planning, in dry runs too."""

        def too_late(self, plan: "Plan", live: Any) -> Optional[Exception]:
            """The TooLateError a GPU node would raise for ``plan`` given ``live`` (from
            :meth:`started`), for dry runs where nothing is applied; None where the order is fine."""
else:
    Adapter = Any

__all__ = ["detect_framework", "adapter", "register", "ModuleAdapter", "FRAMEWORKS", "Adapter"]

FRAMEWORKS = ("tensorflow", "torch", "none")


class ModuleAdapter:
    """An :class:`Adapter` over a module exposing ``apply``, ``stats`` and (optionally) ``reset_peak``."""

    def __init__(self, name: str, module: ModuleType):
        self.name, self.module = name, module

    def prepare(self, plan: "Plan") -> List[str]:
        fn = getattr(self.module, "prepare", None)
        return list(fn(plan)) if fn is not None else []

    def apply(self, plan: "Plan", **options: Any) -> Dict[str, Any]:
        return self.module.apply(plan, **options)

    def stats(self, plan: Optional["Plan"] = None) -> Dict[str, Any]:
        return self.module.stats(plan)

    def reset_peak(self, plan: Optional["Plan"] = None) -> None:
        self.module.reset_peak(plan)

    def started(self) -> Any:
        fn = getattr(self.module, "started", None)
        return fn() if fn is not None else None

    def too_late(self, plan: "Plan", live: Any) -> Optional[Exception]:
        fn = getattr(self.module, "too_late", None)
        return fn(plan, live) if fn is not None else None


def _tensorflow() -> ModuleAdapter:
    from . import tensorflow

    return ModuleAdapter("tensorflow", tensorflow)


def _torch() -> ModuleAdapter:
    from . import torch

    return ModuleAdapter("torch", torch)


def _none() -> ModuleAdapter:
    from . import none

    return ModuleAdapter("none", none)


_REGISTRY: Dict[str, Callable[[], Any]] = {"tensorflow": _tensorflow, "torch": _torch, "none": _none}
_LOADED: Dict[str, Any] = {}


def register(name: str, factory: Callable[[], Any]) -> None:
    """Add (or replace) the adapter for framework ``name``; ``factory()`` builds it on first use."""
    _REGISTRY[name] = factory
    _LOADED.pop(name, None)
    runtime.add_framework(name)


def adapter(name: str) -> Any:
    """The :class:`Adapter` for framework ``name`` (``"tensorflow"``, ``"torch"``, ``"none"``, or registered)."""
    if name not in _REGISTRY:
        raise ConfigError(f"framework={name!r} has no adapter; known: {', '.join(_REGISTRY)}")
    if name not in _LOADED:
        _LOADED[name] = _REGISTRY[name]()
    return _LOADED[name]


def detect_framework(explicit: Optional[str] = None) -> str:
    """The framework to configure: the explicit choice, else one already imported, else installed
    (:func:`distmem.discover.runtime.detect_framework`, the one detector every door uses)."""
    return runtime.detect_framework(explicit)
