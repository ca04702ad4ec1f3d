"""No framework: nothing to configure; stats are the process's resident memory only."""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["apply", "stats"]


def apply(plan: Any, **_: Any) -> Dict[str, Any]:
    return {"framework": "none", "applied": []}


def stats(plan: Any) -> Dict[str, Any]:
    return {"framework": "none", "current_bytes": None, "peak_bytes": None, "reserved_bytes": None, "devices": []}
