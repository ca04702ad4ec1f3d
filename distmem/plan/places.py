"""Where each rank runs, as the planners see it: its host, the GPUs it can use, the one GPU it
takes and how many ranks share that GPU. Pure: computed from a layout (observed through the
exchange, or declared for a dry run)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..discover.gpus import Gpu
from ..discover.layout import Layout, RankView

__all__ = ["Place", "places"]


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


def places(layout: Layout) -> List[Place]:
    """Every known rank's place, from the observed or declared ``layout``. Pure: the same records
    give the same places on every rank that reads them."""
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
