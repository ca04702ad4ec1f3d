"""Shared arithmetic of the planners: rank layout, device sharing, the equal share. Pure."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from dataclasses import dataclass

from ..discover.gpus import Gpu, Inventory
from ..discover.layout import Layout, RankView, assumed
from .. import defaults
from ..errors import ConfigError, DoesNotFitError
from ..discover.identity import Topology
from ..units import MiB, SizeLike, check_size, format_bytes, parse_bytes
from .types import DEFAULT_OVERHEAD_BYTES, DEFAULT_RESERVE, MEMORY_MODES

__all__ = ["Options", "Place", "places", "idle_gpus", "rank_layout", "ranks_per_device", "equal_share",
           "resolve_options", "parse_headroom", "floor_mib"]


class Options(dict):
    """Resolved planner options in bytes; a dict so that it serialises into the plan as is."""


def floor_mib(n: int) -> int:
    """Round down to whole MiB so every framework's unit conversion is exact and identical."""
    return (int(n) // MiB) * MiB


@dataclass(frozen=True)
class Place:
    """Where one rank runs, as the planners see it.

    ``gpus``: the GPUs the rank can use, in its framework's order. ``position``: its place among the
    ranks of its host that see the same GPUs (by local rank), of ``group_size``. ``gpu``: the one
    GPU it takes by that position (``gpus[position % len(gpus)]``), None without GPUs.
    ``shared_by``: ranks of its host on that physical GPU (by UUID), whatever they see.
    """

    rank: int
    host: str
    local_rank: int
    gpus: Tuple[Gpu, ...]
    position: int
    group_size: int
    gpu: Optional[Gpu]
    shared_by: int


def places(topo: Topology, inv: Inventory, layout: Optional[Layout] = None) -> List[Place]:
    """Every known rank's place, from the observed ``layout`` (or, without one, the block mapping
    :func:`distmem.discover.layout.assumed` gives). Pure: the same records give the same places on
    every rank that reads them."""
    if layout is None:
        rank_layout(topo)  # the block mapping needs equal nodes: say so with the numbers
        layout = assumed(topo, inv)
    out: List[Place] = []
    by_host: Dict[str, List[RankView]] = {}
    for v in layout.views:
        by_host.setdefault(v.host, []).append(v)
    for host, views in by_host.items():
        views = sorted(views, key=lambda v: (v.local_rank, v.rank))
        groups: Dict[tuple, List[RankView]] = {}
        for v in views:
            groups.setdefault(v.gpu_set, []).append(v)
        chosen: Dict[int, Optional[Gpu]] = {}
        pos: Dict[int, Tuple[int, int]] = {}
        for members in groups.values():
            for i, v in enumerate(members):
                pos[v.rank] = (i, len(members))
                chosen[v.rank] = v.gpus[i % len(v.gpus)] if v.gpus else None
        users: Dict[str, int] = {}
        for g in chosen.values():
            if g is not None:
                users[g.uuid] = users.get(g.uuid, 0) + 1
        for v in views:
            if v.rank < 0:
                continue  # a placeholder for a rank of this host whose records are unknown: counted, not planned
            g = chosen[v.rank]
            out.append(Place(v.rank, host, v.local_rank, tuple(v.gpus), pos[v.rank][0], pos[v.rank][1], g,
                             users.get(g.uuid, 1) if g is not None else 0))
    return sorted(out, key=lambda p: p.rank)


def idle_gpus(all_places: List[Place], used: Dict[str, set]) -> Dict[str, int]:
    """Per host, the GPUs its ranks can see that no rank uses (``used``: host -> UUIDs in use)."""
    seen: Dict[str, set] = {}
    for p in all_places:
        seen.setdefault(p.host, set()).update(g.uuid for g in p.gpus)
    return {h: len(u - used.get(h, set())) for h, u in seen.items() if u - used.get(h, set())}


def rank_layout(topo: Topology) -> List[Tuple[int, int]]:
    """(node index, local rank) of every rank, under the launchers' default block mapping."""
    if topo.size % max(topo.local_size, 1):
        raise ConfigError(
            f"{topo.size} ranks do not divide into nodes of {topo.local_size} ranks: a dry run of a whole job assumes "
            "equal nodes (consecutive ranks per node); a real job plans from the layout it observes, so uneven "
            "hosts (horovodrun -H a:4,b:2) are fine there - for a dry run, give ranks as a multiple of ranks per node")
    return [(r // topo.local_size, r % topo.local_size) for r in range(topo.size)]


def ranks_per_device(local_size: int, num_devices: int) -> Dict[int, int]:
    """How many local ranks land on each device when local rank ``i`` takes device ``i % n``."""
    counts = {d: 0 for d in range(num_devices)}
    for lr in range(local_size):
        counts[lr % num_devices] += 1
    return counts


def parse_headroom(headroom: SizeLike) -> float:
    """Headroom added to a computed demand, as a ratio: ``"5%"`` or ``0.05`` (0 keeps the figure)."""
    ratio: Optional[float] = None
    if isinstance(headroom, str) and headroom.strip().endswith("%"):
        try:
            ratio = float(headroom.strip()[:-1]) / 100.0
        except ValueError:
            ratio = None
    elif isinstance(headroom, str):
        try:
            ratio = float(headroom)
        except ValueError:
            ratio = None
    elif isinstance(headroom, (int, float)) and not isinstance(headroom, bool):
        ratio = float(headroom)
    if ratio is None or not 0 <= ratio < 10 or ratio != ratio:
        raise ConfigError(f"headroom={headroom!r}: give a percentage of the demand such as '5%' (0% to 999%) or a "
                          "ratio like 0.05; 0 keeps the demand as it is")
    return ratio


def resolve_options(gpus: List[Gpu], *, memory: str = "auto", reserve: SizeLike = DEFAULT_RESERVE,
                    overhead: Optional[SizeLike] = None, foreign: SizeLike = 0,
                    headroom: SizeLike = defaults.HEADROOM) -> Options:
    """The planners' common options in bytes. Every value is checked for its form and range first,
    with or without GPUs, so a machine without GPUs rejects what a GPU node would; a percentage is
    then resolved against the smallest GPU (0 where there is none)."""
    if memory not in MEMORY_MODES:
        raise ConfigError(f"memory={memory!r} is not one of {', '.join(MEMORY_MODES)}; use 'auto' "
                          "(growth alone on a GPU, hard limit when shared), 'growth' or 'limit'")
    for value, what in ((reserve, "reserve"), (foreign, "foreign")):
        check_size(value, what=what)
    if overhead is not None:
        check_size(overhead, what="overhead", allow_percent=False)
    total = min((g.total_bytes for g in gpus), default=None)
    opts = Options(memory=memory)
    resolve = lambda v, what: 0 if total is None and isinstance(v, str) and v.strip().endswith("%") \
        else parse_bytes(v, total=total, what=what)  # noqa: E731
    opts["reserve_bytes"] = resolve(reserve, "reserve")
    opts["overhead_bytes"] = DEFAULT_OVERHEAD_BYTES if overhead is None else parse_bytes(overhead, what="overhead")
    opts["foreign_bytes"] = resolve(foreign, "foreign")
    opts["headroom"] = parse_headroom(headroom)
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
