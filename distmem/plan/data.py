"""Data parallel: local ranks spread over the node's GPUs round robin, each GPU split equally."""
from __future__ import annotations

from typing import List, Optional

from ..discover.gpus import Inventory
from ..errors import DoesNotFitError
from ..discover.identity import Topology
from ..units import SizeLike, format_bytes, parse_bytes
from .types import Allocation, DeviceSlot, Plan
from .common import Options, equal_share, floor_mib, rank_layout, ranks_per_device, resolve_options

__all__ = ["plan_data"]


def plan_data(topo: Topology, inv: Inventory, *, memory: str = "auto", reserve: SizeLike = "256MiB",
              limit: Optional[SizeLike] = None, overhead: Optional[SizeLike] = None,
              foreign: SizeLike = 0) -> Plan:
    """Every rank's allocation under data parallelism.

    A GPU used by ``k`` ranks gives each ``(total - reserve - foreign - k * overhead) / k``. Alone on
    a GPU a rank grows on demand (``memory="auto"``) with that figure as its budget; shared, it gets
    a hard limit. ``limit`` (bytes, ``"6GiB"``, ``"45%"`` or a fraction) sets every rank's limit
    explicitly and is checked against what the GPU can give.
    """
    gpus = inv.gpus
    opts = resolve_options(gpus, memory=memory, reserve=reserve, overhead=overhead, foreign=foreign)
    allocations: List[Allocation] = []
    counts = ranks_per_device(topo.local_size, len(gpus)) if gpus else {}
    for rank, (node_idx, local_rank) in enumerate(rank_layout(topo)):
        node = f"node{node_idx}"
        if not gpus:
            allocations.append(Allocation(rank, local_rank, node, "data", "cpu", replica=rank))
            continue
        gpu = gpus[local_rank % len(gpus)]
        k = counts[gpu.index]
        share = equal_share(gpu, k, opts)
        if limit is not None:
            wanted = floor_mib(parse_bytes(limit, total=gpu.total_bytes, what="limit", allow_fraction=True))
            if wanted > share:
                raise DoesNotFitError(
                    f"limit {format_bytes(wanted)} per rank does not fit GPU {gpu.index} "
                    f"({format_bytes(gpu.total_bytes)}) shared by {k} rank(s): at most {format_bytes(share)} each "
                    f"after reserve {format_bytes(opts['reserve_bytes'])} and {k} x overhead "
                    f"{format_bytes(opts['overhead_bytes'])}; lower limit=, run fewer ranks per GPU, or leave "
                    "limit unset for the equal split")
            share, enforce = wanted, True
        else:
            enforce = memory == "limit" or (memory == "auto" and k > 1)
        slot = DeviceSlot(index=gpu.index, total_bytes=gpu.total_bytes, planned_bytes=share, enforce=enforce,
                          growth=True, shared_by=k, nvml_index=gpu.nvml_index, name=gpu.name)
        alloc = Allocation(rank, local_rank, node, "data", "limit" if enforce else "growth", [slot], replica=rank)
        if memory == "growth" and k > 1:
            alloc.notes.append(f"memory='growth' on a GPU shared by {k} ranks: nothing stops one rank from "
                               "taking a neighbour's share; use memory='auto' or 'limit'")
        allocations.append(alloc)
    plan = Plan("data", topo.size, topo.rank, allocations, inv.source, opts["overhead_bytes"],
                opts["reserve_bytes"], options=dict(opts, limit=limit))
    if gpus and topo.local_size < len(gpus):
        plan.warnings.append(f"{len(gpus)} GPUs visible but only {topo.local_size} rank(s) per node: "
                             f"{len(gpus) - topo.local_size} GPU(s) stay idle")
    return plan
