"""Stage: plan. Pure: takes the strategy and its options, this job's topology and GPUs (the
discover stage) and, where a strategy needs them, per-layer estimates (the estimate stage), and
returns the :class:`Plan` - every rank's devices, mode and budget - identical on every rank that
computes it from the same inputs.

Each strategy is a planner ``plan_<name>(topo, inv, **options) -> Plan`` registered in
:data:`PLANNERS`; a new strategy adds a module and one :func:`register` call.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from ..discover.gpus import Inventory
from ..discover.identity import Topology
from ..errors import ConfigError
from .types import STRATEGIES, Allocation, DeviceSlot, Plan

__all__ = ["make_plan", "register", "planner", "options_of", "PLANNERS", "INIT_ARGUMENTS", "Plan", "Allocation", "DeviceSlot", "STRATEGIES"]

Planner = Callable[..., Plan]


def _data() -> Planner:
    from .data import plan_data

    return plan_data


def _pipeline() -> Planner:
    from .pipeline import plan_pipeline

    return plan_pipeline


def _model() -> Planner:
    from .model import plan_model

    return plan_model


def _tenants() -> Planner:
    from .tenants import plan_tenants

    return plan_tenants


def _auto() -> Planner:
    from .auto import plan_auto

    return plan_auto


#: strategy -> loader of its planner (imported on first use, so ``distmem plan`` stays fast).
PLANNERS: Dict[str, Callable[[], Planner]] = {"data": _data, "pipeline": _pipeline, "model": _model,
                                              "tenants": _tenants, "auto": _auto}


def register(strategy: str, loader: Callable[[], Planner]) -> None:
    """Add (or replace) a strategy: ``loader()`` returns its planner."""
    PLANNERS[strategy] = loader


def planner(strategy: str) -> Planner:
    """The planner function of ``strategy``; ConfigError naming the known strategies otherwise."""
    if strategy not in PLANNERS:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of {', '.join(PLANNERS)}")
    try:
        return PLANNERS[strategy]()
    except ImportError as exc:
        raise ConfigError(f"strategy {strategy!r} is not available in this build ({exc})") from exc


def make_plan(strategy: str, topo: Topology, inv: Inventory, **options: Any) -> Plan:
    """Dispatch to the strategy's planner. Pure: the same inputs give the same plan on every rank."""
    fn = planner(strategy)
    valid = options_of(strategy)
    unknown = [k for k in options if k not in valid] if valid is not None else []
    if unknown:
        import difflib

        name = unknown[0]
        everything = sorted(set(valid) | set(INIT_ARGUMENTS))
        close = difflib.get_close_matches(name, everything, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown argument {name!r}{hint} for strategy={strategy!r}; it takes "
                          f"{', '.join(sorted(v for v in valid if v != 'layout'))} besides init()'s "
                          f"{', '.join(INIT_ARGUMENTS)}")
    return fn(topo, inv, **options)


#: init()'s own arguments, named in the unknown-argument message beside the strategy's.
INIT_ARGUMENTS = ("strategy", "framework", "memory", "reserve", "limit", "overhead", "foreign", "fleet", "enforce",
                  "verbose")


def options_of(strategy: str) -> Optional[List[str]]:
    """The keyword options the strategy's planner takes (None when it takes any: ``**options``)."""
    import inspect

    params = list(inspect.signature(planner(strategy)).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
