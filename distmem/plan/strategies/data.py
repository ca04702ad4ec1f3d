"""Data parallel: each rank on one of the GPUs it can see, each GPU split equally among the ranks
that really use it (observed layout: UUIDs after CUDA_VISIBLE_DEVICES).

A rank takes one of the GPUs it can see by its position among the ranks of its host that see
the same ones; a GPU used by ``k`` ranks (counted by UUID, whatever each rank sees) gives each its
equal share (:mod:`distmem.plan.budget`). Alone on a GPU a rank grows on demand (``memory="auto"``)
with that figure as its budget; shared, it gets a hard limit. ``limit`` (bytes, ``"6GiB"``,
``"45%"`` or a fraction, default ``DISTMEM_LIMIT``) sets every rank's limit explicitly and is
checked against what the GPU can give.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Set

from ...defaults import MIN_LIMIT_BYTES
from ...errors import ConfigError, DoesNotFitError
from ...units import SizeLike, check_size, format_bytes, parse_bytes, plural
from ..budget import floor_mib, growth_note, idle_warnings, slot
from ..strategy import Strategy, option
from ..types import Allocation, Plan

if TYPE_CHECKING:
    from ..request import Context

__all__ = ["DataOptions", "STRATEGY"]


@dataclass
class DataOptions:
    limit: Optional[SizeLike] = option(
        None, metavar="SIZE", help="explicit per-rank limit: a size (6GiB), a percentage (45%%) or a fraction of the "
                                   "GPU (0.4); an integer is bytes (default DISTMEM_LIMIT, else the equal split)")


def _check_limit(limit: SizeLike) -> None:
    check_size(limit, what="limit", allow_fraction=True)
    fractional = isinstance(limit, float) or (isinstance(limit, str) and ("." in limit or limit.strip().endswith("%")))
    if not fractional:
        as_bytes = parse_bytes(limit, what="limit")
        if as_bytes < MIN_LIMIT_BYTES:
            raise ConfigError(f"limit={limit!r} is {as_bytes} bytes, under 1 MiB: nothing can run in it. An integer "
                              "limit is bytes; give a size such as '8GiB', a percentage such as '45%' or a fraction "
                              "such as 0.5")


def plan(ctx: "Context", opts: DataOptions) -> Plan:
    limit, budget = opts.limit, ctx.budget
    if limit is not None:
        _check_limit(limit)
    allocations: List[Allocation] = []
    used: Dict[str, Set[str]] = {}
    for pl in ctx.places:
        if pl.gpu is None:
            allocations.append(Allocation(pl.rank, pl.local_rank, pl.host, "data", "cpu", replica=pl.rank))
            continue
        gpu, k = pl.gpu, pl.shared_by
        used.setdefault(pl.host, set()).add(gpu.uuid)
        share = budget.share(gpu, k)
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
                    f"({format_bytes(gpu.total_bytes)}) shared by {plural(k, 'rank')}: at most {format_bytes(share)} "
                    f"each after driver reserved {format_bytes(gpu.reserved_bytes)}, reserve "
                    f"{format_bytes(budget.reserve_of(gpu))}, foreign {format_bytes(budget.foreign_of(gpu))} and {k} x "
                    f"overhead {format_bytes(budget.overhead_bytes)}; "
                    "lower limit= (or DISTMEM_LIMIT), run fewer ranks per GPU, or leave it unset for the equal split")
            share, enforce = wanted, True
        else:
            enforce = budget.enforced(k)
        alloc = Allocation(pl.rank, pl.local_rank, pl.host, "data", "limit" if enforce else "growth",
                           [slot(gpu, share, enforce=enforce, shared_by=k)], replica=pl.rank)
        note = growth_note(k) if budget.memory == "growth" else None
        if note:
            alloc.notes.append(note)
        allocations.append(alloc)
    return ctx.make_plan("data", allocations, {"limit": limit}, warnings=idle_warnings(ctx.seen_gpus(), used))


STRATEGY = Strategy("data", "equal split of each GPU among the ranks on it", DataOptions, plan)
