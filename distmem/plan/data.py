"""Data parallel: each rank on one of the GPUs it can see, each GPU split equally among the ranks
that really use it (observed layout: UUIDs after CUDA_VISIBLE_DEVICES)."""
from __future__ import annotations

from typing import Dict, List, Optional, Set

from ..discover.gpus import Inventory
from ..discover.layout import Layout
from ..defaults import MIN_LIMIT_BYTES
from ..errors import ConfigError, DoesNotFitError
from ..discover.identity import Topology
from ..units import SizeLike, check_size, format_bytes, parse_bytes, plural
from .types import Allocation, DeviceSlot, Plan
from .common import equal_share, floor_mib, idle_gpus, places, resolve_options

__all__ = ["plan_data"]


def plan_data(topo: Topology, inv: Inventory, *, memory: str = "auto", reserve: SizeLike = "256MiB",
              limit: Optional[SizeLike] = None, overhead: Optional[SizeLike] = None,
              foreign: SizeLike = 0, layout: Optional[Layout] = None) -> Plan:
    """Every known rank's allocation under data parallelism.

    A rank takes one of the GPUs it can see by its position among the ranks of its host that see
    the same ones; a GPU used by ``k`` ranks (counted by UUID, whatever each rank sees) gives each
    ``(total - reserve - foreign - k * overhead) / k``. Alone on a GPU a rank grows on demand
    (``memory="auto"``) with that figure as its budget; shared, it gets a hard limit. ``limit``
    (bytes, ``"6GiB"``, ``"45%"`` or a fraction) sets every rank's limit explicitly and is checked
    against what the GPU can give. ``layout``: the observed layout (default: the block mapping).
    """
    opts = resolve_options(inv.gpus, memory=memory, reserve=reserve, overhead=overhead, foreign=foreign)
    if limit is not None:
        check_size(limit, what="limit", allow_fraction=True)
        if not (isinstance(limit, str) and limit.strip().endswith("%")) and \
                not (isinstance(limit, float) or (isinstance(limit, str) and "." in limit)):
            as_bytes = parse_bytes(limit, what="limit")
            if as_bytes < MIN_LIMIT_BYTES:
                raise ConfigError(f"limit={limit!r} is {as_bytes} bytes, under 1 MiB: nothing can run in it. An "
                                  "integer limit is bytes; give a size such as '8GiB', a percentage such as '45%' or "
                                  "a fraction such as 0.5")
    allocations: List[Allocation] = []
    all_places = places(topo, inv, layout)
    used: Dict[str, Set[str]] = {}
    for pl in all_places:
        if pl.gpu is None:
            allocations.append(Allocation(pl.rank, pl.local_rank, pl.host, "data", "cpu", replica=pl.rank))
            continue
        gpu, k = pl.gpu, pl.shared_by
        used.setdefault(pl.host, set()).add(gpu.uuid)
        share = equal_share(gpu, k, opts)
        if limit is not None:
            wanted = floor_mib(parse_bytes(limit, total=gpu.total_bytes, what="limit", allow_fraction=True))
            if wanted < MIN_LIMIT_BYTES:
                raise ConfigError(
                    f"limit={limit!r} plans {format_bytes(wanted)} per rank on GPU {gpu.index} "
                    f"({format_bytes(gpu.total_bytes)}), under 1 MiB: nothing can run in it. An integer limit is "
                    f"bytes; give a size such as '8GiB', a percentage such as '45%' or a fraction such as 0.5")
            if wanted > share:
                raise DoesNotFitError(
                    f"limit {format_bytes(wanted)} per rank does not fit GPU {gpu.index} "
                    f"({format_bytes(gpu.total_bytes)}) shared by {plural(k, 'rank')}: at most {format_bytes(share)} each "
                    f"after reserve {format_bytes(opts['reserve_bytes'])} and {k} x overhead "
                    f"{format_bytes(opts['overhead_bytes'])}; lower limit=, run fewer ranks per GPU, or leave "
                    "limit unset for the equal split")
            share, enforce = wanted, True
        else:
            enforce = memory == "limit" or (memory == "auto" and k > 1)
        slot = DeviceSlot(index=gpu.index, total_bytes=gpu.total_bytes, planned_bytes=share, enforce=enforce,
                          growth=True, shared_by=k, nvml_index=gpu.nvml_index, uuid=gpu.uuid, name=gpu.name)
        alloc = Allocation(pl.rank, pl.local_rank, pl.host, "data", "limit" if enforce else "growth", [slot],
                           replica=pl.rank)
        if memory == "growth" and k > 1:
            alloc.notes.append(f"memory='growth' on a GPU shared by {k} ranks: nothing stops one rank from "
                               "taking a neighbour's share; use memory='auto' or 'limit'")
        allocations.append(alloc)
    plan = Plan("data", topo.size, topo.rank, allocations, inv.source, opts["overhead_bytes"],
                opts["reserve_bytes"], options=dict(opts, limit=limit))
    for host, n in sorted(idle_gpus(all_places, used).items()):
        idle = "it: it stays" if n == 1 else "them: they stay"
        plan.warnings.append(f"{plural(n, 'GPU')} visible on {host} but no rank uses {idle} idle (run more ranks "
                             "there, or give each rank its GPUs through CUDA_VISIBLE_DEVICES)")
    return plan
