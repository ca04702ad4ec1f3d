"""Warnings about memory other processes already hold on the GPUs a plan uses. Pure: it reads the
plan and an inventory (with NVML's process lists) and returns sentences; it never fails a plan."""
from __future__ import annotations

from typing import List

from ..discover.gpus import Inventory
from ..units import format_bytes
from .types import Plan

__all__ = ["foreign_warnings"]


def foreign_warnings(plan: Plan, inv: Inventory, pid: int) -> List[str]:
    """Sentences for this rank's GPUs that hold more foreign memory than the plan assumed; only the
    lowest local rank on a GPU speaks, so the job prints each once per GPU."""
    out: List[str] = []
    if not inv.real:
        return out
    mine = plan.mine
    for slot in mine.devices:
        gpu = next((g for g in inv.gpus if g.index == slot.index), None)
        if gpu is None:
            continue
        # Neighbour ranks of this job that started first hold about one overhead each: not foreign.
        job_share = (slot.shared_by - 1) * plan.overhead_bytes
        foreign = {p: b for p, b in gpu.holders().items() if p != pid}
        used = sum(b or 0 for b in foreign.values())
        if used <= job_share:
            continue
        if foreign and mine.local_rank == min(a.local_rank for a in plan.allocations
                                              if a.host == mine.host and any(d.index == slot.index for d in a.devices)):
            msg = (f"GPU {slot.index} already holds {format_bytes(used)} in {len(foreign)} other process(es) "
                   f"(pid {', '.join(str(p) for p in list(foreign)[:5])}); the plan assumed "
                   f"{format_bytes(plan.options.get('foreign_bytes', 0))} foreign use")
            free_needed = slot.planned_bytes * slot.shared_by
            if gpu.free_bytes and free_needed > gpu.free_bytes + used:
                msg += f"; only {format_bytes(gpu.free_bytes)} is free - pass foreign='{format_bytes(used)}'"
            out.append(msg)
    return out
