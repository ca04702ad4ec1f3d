"""Pure planners: strategy spec + topology + inventory (+ estimates) -> Plan."""
from __future__ import annotations

import importlib
from typing import Any

from ..devices import Inventory
from ..errors import ConfigError
from ..topology import Topology
from .base import Allocation, DeviceSlot, Plan, STRATEGIES

__all__ = ["make_plan", "Plan", "Allocation", "DeviceSlot", "STRATEGIES"]

# strategy -> (module, function); each planner takes (topo, inv, **options) and returns a Plan.
_PLANNERS = {
    "data": ("distmem.plan.data", "plan_data"),
    "pipeline": ("distmem.plan.pipeline", "plan_pipeline"),
    "model": ("distmem.plan.model", "plan_model"),
    "tenants": ("distmem.plan.tenants", "plan_tenants"),
}


def make_plan(strategy: str, topo: Topology, inv: Inventory, **options: Any) -> Plan:
    """Dispatch to the strategy's planner. Pure: the same inputs give the same plan on every rank."""
    if strategy not in _PLANNERS:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of {', '.join(_PLANNERS)}")
    module, func = _PLANNERS[strategy]
    try:
        planner = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"strategy {strategy!r} is not available in this build ({exc})") from exc
    try:
        return planner(topo, inv, **options)
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):
            raise ConfigError(f"strategy {strategy!r} does not take that option: {exc}") from None
        raise
