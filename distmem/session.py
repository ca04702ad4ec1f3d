"""What this process has applied: the plan, the framework, the observed topology and inventory.

A leaf that every stage may read (nothing here imports a stage at run time); only the facade
(:mod:`distmem.api`) writes it, in :func:`distmem.init` and :func:`distmem.reset`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:  # types only: a leaf must not import the stages
    from .discover.gpus import Inventory
    from .discover.identity import Topology
    from .discover.layout import Layout
    from .plan.types import Plan

__all__ = ["Session", "state", "current_plan", "fingerprint", "host_fingerprint", "allocation_dict", "clear"]


@dataclass
class Session:
    """The process's applied state. ``applied`` is what the framework adapter reported; ``options``
    the arguments ``init()`` was called with (a second, different ``init()`` is an error)."""

    plan: Optional["Plan"] = None
    framework: Optional[str] = None
    applied: Optional[Dict[str, Any]] = None
    topology: Optional["Topology"] = None
    inventory: Optional["Inventory"] = None
    layout: Optional["Layout"] = None
    options: Optional[Dict[str, Any]] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    _fingerprint: Optional[str] = None
    _allocation: Optional[Dict[str, Any]] = None
    _host_fingerprint: Optional[str] = None
    _fingerprint_of: Any = None


state = Session()

#: Set by :func:`clear` (``distmem.reset()``, tests only) and never unset: the framework may have
#: started under an earlier plan of this process, which cannot be undone, so a later ``init()`` in
#: a dry run no longer treats a started framework as "too late" (real GPUs are still checked by the
#: framework itself). Tests of that check run in a fresh process.
was_reset = False

#: The launcher wrapper this process is (``"distmem-exec"``), set by :func:`distmem.api.plan_for_exec`
#: and never unset: the process is the rank's own until it execs the command (the pid the launcher
#: watches), so it starts no transport (:func:`distmem.comm.get_comm`) and exchanges its layout apart
#: from the command's (:func:`distmem.discover.layout.exchange`). None in every other process.
wrapper: Optional[str] = None


def current_plan() -> Optional["Plan"]:
    """The plan ``distmem.init()`` applied in this process, or None before ``init()``."""
    return state.plan


def _hash(plan: "Plan") -> None:
    if state._fingerprint_of is not plan:
        state._fingerprint, state._host_fingerprint = plan.fingerprint(), plan.host_fingerprint()
        state._allocation = plan.mine.to_dict()
        state._fingerprint_of = plan


def allocation_dict(plan: "Plan") -> Dict[str, Any]:
    """This rank's allocation as plain data, made once per plan (every snapshot carries it)."""
    _hash(plan)
    return state._allocation or {}


def fingerprint(plan: "Plan") -> str:
    """The plan's job-wide fingerprint, hashed once per plan: a plan of many ranks makes a large
    JSON, and every periodic snapshot carries it."""
    _hash(plan)
    return state._fingerprint or ""


def host_fingerprint(plan: "Plan") -> str:
    """The fingerprint of the plan's allocations on this host (hashed once per plan)."""
    _hash(plan)
    return state._host_fingerprint or ""


def clear() -> None:
    """Forget everything (tests; a process cannot un-apply a framework)."""
    global was_reset
    state.__dict__.update(Session().__dict__)
    was_reset = True
