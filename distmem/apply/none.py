"""No framework: nothing to configure; stats are the process's resident memory only."""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["prepare", "apply", "stats", "reset_peak"]


def apply(plan: Any, **_: Any) -> Dict[str, Any]:
    return {"framework": "none", "applied": []}


def stats(plan: Any) -> Dict[str, Any]:
    return {"framework": "none", "current_bytes": None, "peak_bytes": None, "reserved_bytes": None, "devices": []}


def reset_peak(plan: Any = None) -> None:
    """Nothing to reset without a framework allocator."""


def prepare(plan: Any = None) -> list:
    """Nothing to prepare without a framework."""
    return []
