"""Plain data of a plan: what every rank gets on which device. Pure; serialises to JSON."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from .. import defaults, settings
from ..errors import ConfigError
from ..units import format_bytes

__all__ = ["DeviceSlot", "Allocation", "Plan", "DEFAULT_OVERHEAD_BYTES", "DEFAULT_RESERVE",
           "STRATEGIES", "MEMORY_MODES"]

#: The defaults live in distmem.defaults (one place); named here for the planners and old imports.
DEFAULT_OVERHEAD_BYTES = defaults.OVERHEAD_BYTES
DEFAULT_RESERVE = defaults.RESERVE

STRATEGIES = ("data", "pipeline", "model", "tenants", "auto")
MEMORY_MODES = settings.MEMORY_MODES


@dataclass
class DeviceSlot:
    """One GPU (or one logical slice of it) given to a rank.

    ``index`` is the device's ordinal as the framework sees it (position in CUDA_VISIBLE_DEVICES);
    ``nvml_index`` and ``uuid`` name the physical GPU. ``planned_bytes`` is what the plan gives this
    rank on the device; ``enforce`` says whether a hard limit of that size is applied (otherwise the
    framework grows on demand and the figure is the rank's budget, checked by the report).
    """

    index: int
    total_bytes: int
    planned_bytes: int
    enforce: bool
    growth: bool
    shared_by: int = 1
    nvml_index: Optional[int] = None
    uuid: Optional[str] = None
    name: Optional[str] = None
    label: Optional[str] = None  # tenant name for strategy="tenants", layer group for "model"


@dataclass
class Allocation:
    """What one rank applies: its devices, mode and budget, plus the demand behind the budget."""

    rank: int
    local_rank: int
    host: str
    strategy: str
    mode: str  # "growth" | "limit" | "cpu"
    devices: List[DeviceSlot] = field(default_factory=list)
    stage: Optional[int] = None
    replica: Optional[int] = None
    demand_bytes: Optional[int] = None
    breakdown: Dict[str, int] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    #: The headroom ratio the limit was derived with (pipeline stages, layer groups), as stated.
    headroom: Optional[float] = None

    @property
    def limit_bytes(self) -> Optional[int]:
        """Sum of the planned bytes over this rank's devices (None on a CPU-only rank)."""
        if not self.devices:
            return None
        return sum(d.planned_bytes for d in self.devices)

    @property
    def device(self) -> Optional[int]:
        """The framework ordinal of this rank's first device, or None without a GPU."""
        return self.devices[0].index if self.devices else None

    def describe(self) -> str:
        stage = f" stage {self.stage}" if self.stage is not None else ""
        if not self.devices:
            planned = self.breakdown.get("planned_bytes")
            budget = f", planned {format_bytes(planned)}" if planned else ""
            return f"rank {self.rank}{stage}: no GPU ({self.mode}{budget})"
        parts = []
        head = self.breakdown.get("headroom_bytes")
        for d in self.devices:
            how = "hard limit" if d.enforce else "growth, budget"
            lab = f" [{d.label}]" if d.label else ""
            # A limit above the demand says by how much (a pipeline stage's headroom for the allocator's cache).
            ratio = self.headroom if self.headroom is not None else (head / self.demand_bytes if head and
                                                                      self.demand_bytes else 0)
            derived = (f" ({format_bytes(self.demand_bytes)} + {ratio:.0%} headroom)"
                       if head and self.demand_bytes and len(self.devices) == 1 else "")
            parts.append(f"GPU {d.index}{lab} {how} {format_bytes(d.planned_bytes)}{derived}"
                         + (f" shared by {d.shared_by}" if d.shared_by > 1 else ""))
        return f"rank {self.rank} (local {self.local_rank}){stage}: " + "; ".join(parts)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["limit_bytes"] = self.limit_bytes
        return d


@dataclass
class Plan:
    """The job's plan as this rank knows it: ``allocations`` of the ranks of its host (every rank of
    the job in a dry run or on one host), sorted by rank; ``rank`` says which row is ours. The
    job-wide part (strategy, options, stages...) is identical on every rank - :meth:`fingerprint` -
    and the allocations on every rank of a host - :meth:`host_fingerprint`."""

    strategy: str
    world_size: int
    rank: int
    allocations: List[Allocation]
    source: str  # where device totals came from: "nvml", "fleet:4x16GiB", "none"
    overhead_bytes: int
    reserve_bytes: int
    options: Dict[str, Any] = field(default_factory=dict)
    extras: Dict[str, Any] = field(default_factory=dict)  # partition, stages, tenants...
    warnings: List[str] = field(default_factory=list)

    @property
    def mine(self) -> Allocation:
        """This rank's allocation."""
        return self.for_rank(self.rank)

    def for_rank(self, rank: int) -> Allocation:
        for a in self.allocations:
            if a.rank == rank:
                return a
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside this plan of {self.world_size} ranks")
        raise ConfigError(f"rank {rank} runs on another host ({', '.join(sorted(self.hosts)) or 'none'} here): its "
                          "allocation is planned there; distmem.report() gathers every rank's")

    @property
    def hosts(self) -> List[str]:
        """The hosts of the ranks this plan lists."""
        return sorted({a.host for a in self.allocations})

    def device(self, name: str) -> str:
        """The framework device string planned for a named tenant or layer group, e.g. ``"/GPU:1"``.

        Planners that name devices record them in ``extras["devices"]`` (name -> device string).
        """
        names = self.extras.get("devices") or {}
        if name not in names:
            raise ConfigError(f"no device named {name!r} in this {self.strategy} plan; known names: "
                              f"{sorted(names) or 'none (this strategy names no devices)'}")
        return names[name]

    def to_dict(self) -> Dict[str, Any]:
        return {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "rank": self.rank,
            "source": self.source,
            "overhead_bytes": self.overhead_bytes,
            "reserve_bytes": self.reserve_bytes,
            "options": self.options,
            "extras": self.extras,
            "warnings": list(self.warnings),
            "allocations": [a.to_dict() for a in self.allocations],
        }

    #: ``extras`` entries that describe this rank only (its tenants' devices), not the job.
    RANK_EXTRAS = ("tenants",)

    def fingerprint(self) -> str:
        """Hash of the job-wide part (everything but ``rank``, warnings, the per-host allocations and
        this rank's own extras): equal on every rank of a consistent job, whatever host it runs on."""
        d = self.to_dict()
        for key in ("rank", "warnings", "allocations"):
            d.pop(key)
        d["extras"] = {k: v for k, v in d["extras"].items() if k not in self.RANK_EXTRAS}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def host_fingerprint(self) -> str:
        """Hash of the job-wide part and the allocations listed: equal on every rank of one host."""
        d = self.to_dict()
        d.pop("rank")
        d.pop("warnings")
        d["extras"] = {k: v for k, v in d["extras"].items() if k not in self.RANK_EXTRAS}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def summary(self) -> str:
        lines = [f"distmem plan: strategy={self.strategy} ranks={self.world_size} devices from {self.source}"]
        lines += ["  " + a.describe() for a in self.allocations[:64]]
        if len(self.allocations) > 64:
            lines.append(f"  ... {len(self.allocations) - 64} more ranks")
        return "\n".join(lines)
