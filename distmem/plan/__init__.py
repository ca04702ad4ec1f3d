"""Stage: plan. Pure: from one :class:`~distmem.plan.request.PlanRequest` - the strategy and its
options, this job's ranks and GPUs (the discover stage) and, where a strategy needs them,
per-layer estimates (the estimate stage) - to the :class:`Plan`: every rank's devices, mode and
budget, identical on every rank that computes it from the same inputs, whichever door asked.

* :mod:`.request` resolves the request once (settings, defaults, fleets, layout);
* :mod:`.budget` owns what a GPU offers, the equal share and a limit from a demand;
* :mod:`.strategy` is the protocol and registry; :mod:`.strategies` holds one module per strategy
  (data, pipeline, model, tenants, auto);
* :mod:`.partition` cuts layers into stages and groups exactly; :mod:`.fit` searches layouts.
"""
from __future__ import annotations

from typing import Any, Optional

from ..discover.gpus import Inventory
from ..discover.identity import Topology
from ..discover.layout import Layout
from .request import REQUEST_ARGUMENTS, JobLayout, PlanRequest
from .strategy import Strategy, get, names, register
from .types import Allocation, DeviceSlot, Plan

__all__ = ["make_plan", "PlanRequest", "JobLayout", "Strategy", "register", "get", "names", "Plan", "Allocation",
           "DeviceSlot", "REQUEST_ARGUMENTS"]


def make_plan(strategy: str, topo: Topology, inv: Inventory, *, layout: Optional[Layout] = None,
              framework: str = "none", memory: Optional[str] = None, reserve: Any = None, overhead: Any = None,
              foreign: Any = 0, **options: Any) -> Plan:
    """The plan of ``strategy`` for a given topology and inventory (and observed ``layout``; the
    block mapping without one), through the same request every door uses, reading no environment.
    Pure: the same inputs give the same plan on every rank (tests, benchmarks, tools)."""
    limit = options.pop("limit", None)
    request = PlanRequest(strategy=strategy, options=options, framework=framework, memory=memory, reserve=reserve,
                          limit=limit, overhead=overhead, foreign=foreign, env={}, topology=topo, inventory=inv,
                          layout=layout)
    return request.plan()
