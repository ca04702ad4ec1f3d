"""Shared arithmetic of the planners: rank layout, device sharing, the equal share. Pure."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..discover.gpus import Gpu, Inventory
from .. import defaults
from ..errors import ConfigError, DoesNotFitError
from ..discover.identity import Topology
from ..units import MiB, SizeLike, format_bytes, parse_bytes
from .types import DEFAULT_OVERHEAD_BYTES, DEFAULT_RESERVE, MEMORY_MODES

__all__ = ["Options", "rank_layout", "ranks_per_device", "equal_share", "resolve_options", "floor_mib"]


class Options(dict):
    """Resolved planner options in bytes; a dict so that it serialises into the plan as is."""


def floor_mib(n: int) -> int:
    """Round down to whole MiB so every framework's unit conversion is exact and identical."""
    return (int(n) // MiB) * MiB


def rank_layout(topo: Topology) -> List[Tuple[int, int]]:
    """(node index, local rank) of every rank, under the launchers' default block mapping."""
    if topo.size % max(topo.local_size, 1):
        raise ConfigError(
            f"{topo.size} ranks do not divide into nodes of {topo.local_size} ranks; distmem assumes every "
            "node runs the same number of ranks (horovodrun -H host1:4,host2:4); launch an equal count per node")
    return [(r // topo.local_size, r % topo.local_size) for r in range(topo.size)]


def ranks_per_device(local_size: int, num_devices: int) -> Dict[int, int]:
    """How many local ranks land on each device when local rank ``i`` takes device ``i % n``."""
    counts = {d: 0 for d in range(num_devices)}
    for lr in range(local_size):
        counts[lr % num_devices] += 1
    return counts


def resolve_options(gpus: List[Gpu], *, memory: str = "auto", reserve: SizeLike = DEFAULT_RESERVE,
                    overhead: Optional[SizeLike] = None, foreign: SizeLike = 0,
                    headroom: SizeLike = defaults.HEADROOM) -> Options:
    if memory not in MEMORY_MODES:
        raise ConfigError(f"memory={memory!r} is not one of {', '.join(MEMORY_MODES)}; use 'auto' "
                          "(growth alone on a GPU, hard limit when shared), 'growth' or 'limit'")
    total = min((g.total_bytes for g in gpus), default=None)
    opts = Options(memory=memory)
    opts["reserve_bytes"] = parse_bytes(reserve, total=total, what="reserve")
    opts["overhead_bytes"] = DEFAULT_OVERHEAD_BYTES if overhead is None else parse_bytes(overhead, what="overhead")
    opts["foreign_bytes"] = parse_bytes(foreign, total=total, what="foreign")
    # Headroom is a fraction of a computed demand (pipeline / model), kept as a ratio.
    if isinstance(headroom, str) and headroom.strip().endswith("%"):
        opts["headroom"] = float(headroom.strip()[:-1]) / 100.0
    elif isinstance(headroom, (int, float)) and not isinstance(headroom, bool) and 0 <= headroom < 10:
        opts["headroom"] = float(headroom)
    else:
        raise ConfigError(f"headroom={headroom!r}: give a percentage of the demand such as '5%' or a ratio like 0.05")
    return opts


def equal_share(gpu: Gpu, k: int, opts: Options) -> int:
    """``(total - driver reserved - reserve - foreign - k * overhead) / k``, in whole MiB; raises when
    nothing is left. ``driver reserved`` is what NVML's total holds that CUDA can never hand out."""
    usable = (gpu.total_bytes - gpu.reserved_bytes - opts["reserve_bytes"] - opts["foreign_bytes"]
              - k * opts["overhead_bytes"])
    share = floor_mib(usable // k) if usable > 0 else 0
    if share <= 0:
        raise DoesNotFitError(
            f"GPU {gpu.index} ({format_bytes(gpu.total_bytes)}) cannot hold {k} ranks: reserve "
            f"{format_bytes(opts['reserve_bytes'])} + foreign {format_bytes(opts['foreign_bytes'])} + {k} x "
            f"per-process overhead {format_bytes(opts['overhead_bytes'])} leave nothing; run fewer ranks per "
            "GPU, lower reserve= or overhead=, or use a larger GPU")
    return share
