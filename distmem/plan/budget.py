"""What a GPU offers and how it is shared: the one budget every strategy, ``fit`` and ``auto`` use. Pure.

A GPU used by ``k`` processes offers them, together,
``total - driver reserved - reserve - foreign - k x overhead`` bytes (:meth:`Budget.offered`):
``driver reserved`` is what NVML's total holds that CUDA can never hand out (an H200 reports
143771 MiB to NVML and about 143160 MiB to CUDA), ``reserve`` is kept free for the driver and for
fragmentation between the processes' pools, ``foreign`` is what other jobs hold, and ``overhead``
is each process's memory outside the framework allocator (CUDA context, cuBLAS/cuDNN, NCCL).
Each of the ``k`` gets the equal share, ``offered / k`` in whole MiB (:meth:`Budget.share`); a
limit derived from a demand (a pipeline stage, a layer group, a layout's peak) is
``demand x (1 + headroom)`` rounded up to whole MiB (:meth:`Budget.limit_for`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

from .. import defaults, settings
from ..discover.gpus import Gpu
from ..errors import ConfigError, DoesNotFitError
from ..units import MiB, SizeLike, check_size, format_bytes, parse_bytes, parse_ratio, plural
from .types import DeviceSlot

__all__ = ["Budget", "floor_mib", "ceil_mib", "parse_headroom", "resolve_budget", "slot", "idle_warnings",
           "growth_note", "MEMORY_MODES"]

MEMORY_MODES = settings.MEMORY_MODES


def floor_mib(n: int) -> int:
    """Round down to whole MiB so every framework's unit conversion is exact and identical."""
    return (int(n) // MiB) * MiB


def ceil_mib(n: float) -> int:
    """Round up to whole MiB (a limit never below the demand it covers)."""
    return int(math.ceil(n / MiB)) * MiB


def parse_headroom(headroom: SizeLike) -> float:
    """Headroom added to a computed demand, as a ratio: ``"10%"``, ``"0.1"`` or ``0.1`` (0 keeps the
    figure), under the one rule for ratios (:func:`distmem.units.parse_ratio`: a bare number above 1
    is refused); ConfigError naming the value otherwise."""
    return parse_ratio(headroom, what="headroom", upper=9.99)


@dataclass(frozen=True)
class Budget:
    """The common options of a plan in bytes, resolved once (:func:`resolve_budget`).

    ``memory``: ``auto`` (growth alone on a GPU, a hard limit when shared), ``growth`` or
    ``limit``. ``headroom``: the ratio added to a demand-derived limit. A reserve or foreign use
    given as a percentage is a ``*_fraction`` of each GPU's own total (its ``*_bytes`` is then 0):
    ``"5%"`` keeps 5% of every GPU free, whatever GPUs the ranks of this host happen to see.
    """

    memory: str
    reserve_bytes: int
    overhead_bytes: int
    foreign_bytes: int
    headroom: float
    reserve_fraction: float = 0.0
    foreign_fraction: float = 0.0

    def reserve_of(self, gpu: Gpu) -> int:
        """Bytes kept free on ``gpu``."""
        return self.reserve_bytes + int(gpu.total_bytes * self.reserve_fraction)

    def foreign_of(self, gpu: Gpu) -> int:
        """Bytes other jobs hold on ``gpu``."""
        return self.foreign_bytes + int(gpu.total_bytes * self.foreign_fraction)

    def describe(self, what: str) -> str:
        """``reserve`` or ``foreign`` as given: ``"256.0 MiB"`` or ``"5% of each GPU"``."""
        fraction = self.reserve_fraction if what == "reserve" else self.foreign_fraction
        nbytes = self.reserve_bytes if what == "reserve" else self.foreign_bytes
        return f"{fraction:.0%} of each GPU" if fraction else format_bytes(nbytes)

    def offered(self, gpu: Gpu, k: int = 1, overhead_bytes: Optional[int] = None) -> int:
        """Bytes ``gpu`` offers ``k`` processes together (may be <= 0)."""
        overhead = self.overhead_bytes if overhead_bytes is None else overhead_bytes
        return gpu.total_bytes - gpu.reserved_bytes - self.reserve_of(gpu) - self.foreign_of(gpu) - k * overhead

    def share(self, gpu: Gpu, k: int = 1, overhead_bytes: Optional[int] = None) -> int:
        """Each of ``k`` processes' equal share of ``gpu``, in whole MiB; DoesNotFitError when nothing is left."""
        usable = self.offered(gpu, k, overhead_bytes)
        share = floor_mib(usable // k) if usable > 0 else 0
        if share <= 0:
            overhead = self.overhead_bytes if overhead_bytes is None else overhead_bytes
            raise DoesNotFitError(
                f"GPU {gpu.index} ({format_bytes(gpu.total_bytes)}) cannot hold {plural(k, 'rank')}: driver reserved "
                f"{format_bytes(gpu.reserved_bytes)} + reserve {format_bytes(self.reserve_of(gpu))} + foreign "
                f"{format_bytes(self.foreign_of(gpu))} + {k} x per-process overhead {format_bytes(overhead)} leave "
                "nothing; run fewer ranks per GPU, lower reserve= or overhead=, or use a larger GPU")
        return share

    def share_or_zero(self, gpu: Gpu, k: int = 1, overhead_bytes: Optional[int] = None) -> int:
        """:meth:`share`, 0 where nothing is left (for searches that rank layouts)."""
        try:
            return self.share(gpu, k, overhead_bytes)
        except DoesNotFitError:
            return 0

    def limit_for(self, demand: int, headroom: Optional[float] = None) -> int:
        """The limit for ``demand`` bytes: ``demand x (1 + headroom)`` rounded up to whole MiB."""
        return ceil_mib(demand * (1.0 + (self.headroom if headroom is None else headroom)))

    def enforced(self, shared_by: int = 1, *, always: bool = False) -> bool:
        """Whether a hard limit is applied: ``limit`` always, ``growth`` never, ``auto`` when the GPU
        is shared (or ``always``: limits derived from a demand)."""
        if self.memory == "limit":
            return True
        if self.memory == "growth":
            return False
        return always or shared_by > 1

    def to_options(self) -> Dict[str, Any]:
        """The plan's ``options`` entries (serialised into every plan and its fingerprint)."""
        return asdict(self)


def resolve_budget(*, memory: str = "auto", reserve: SizeLike = defaults.RESERVE, overhead: Optional[SizeLike] = None,
                   foreign: SizeLike = 0, headroom: SizeLike = defaults.LIMIT_HEADROOM) -> Budget:
    """The common options in bytes. Every value is checked for its form and range first, with or
    without GPUs, so a machine without GPUs rejects what a GPU node would; a percentage of reserve
    or foreign use is kept as a fraction of each GPU."""
    if memory not in MEMORY_MODES:
        raise ConfigError(f"memory={memory!r} is not one of {', '.join(MEMORY_MODES)}; use 'auto' "
                          "(growth alone on a GPU, hard limit when shared), 'growth' or 'limit'")
    for value, what in ((reserve, "reserve"), (foreign, "foreign")):
        check_size(value, what=what)
    if overhead is not None:
        check_size(overhead, what="overhead", allow_percent=False)
    def resolve(value: SizeLike, what: str) -> Tuple[int, float]:
        if isinstance(value, str) and value.strip().endswith("%"):  # checked above: (0, 100]
            return 0, float(value.strip()[:-1]) / 100.0
        return parse_bytes(value, what=what), 0.0

    overhead_bytes = defaults.OVERHEAD_BYTES if overhead is None else parse_bytes(overhead, what="overhead")
    reserve_bytes, reserve_fraction = resolve(reserve, "reserve")
    foreign_bytes, foreign_fraction = resolve(foreign, "foreign")
    return Budget(memory=memory, reserve_bytes=reserve_bytes, overhead_bytes=overhead_bytes, foreign_bytes=foreign_bytes,
                  headroom=parse_headroom(headroom), reserve_fraction=reserve_fraction,
                  foreign_fraction=foreign_fraction)


def slot(gpu: Gpu, planned_bytes: int, *, enforce: bool, shared_by: int = 1, label: Optional[str] = None) -> DeviceSlot:
    """The :class:`DeviceSlot` that gives ``planned_bytes`` of ``gpu`` to a rank."""
    return DeviceSlot(index=gpu.index, total_bytes=gpu.total_bytes, planned_bytes=planned_bytes, enforce=enforce,
                      growth=True, shared_by=shared_by, nvml_index=gpu.nvml_index, uuid=gpu.uuid, name=gpu.name,
                      label=label)


def idle_warnings(seen: Dict[str, Set[str]], used: Dict[str, Set[str]], why: str = "") -> List[str]:
    """One sentence per host whose ranks can see GPUs (``seen``: host -> UUIDs) no rank uses
    (``used``). ``why`` says what leaves them idle."""
    out = []
    for host in sorted(seen):
        n = len(seen[host] - used.get(host, set()))
        if not n:
            continue
        it, stays = ("it", "it stays") if n == 1 else ("them", "they stay")
        cause = f" {why}" if why else ""
        out.append(f"{plural(n, 'GPU')} visible on {host} but no rank uses {it}{cause}: {stays} idle (run more ranks "
                   "there, or give each rank its GPUs through CUDA_VISIBLE_DEVICES)")
    return out


def growth_note(shared_by: int, who: str = "rank") -> Optional[str]:
    """The note an allocation under ``memory='growth'`` on a shared GPU carries, or None."""
    if shared_by <= 1:
        return None
    return (f"memory='growth' on a GPU shared by {plural(shared_by, 'rank')}: nothing stops one {who} from taking a "
            "neighbour's share; use memory='auto' or 'limit'")
