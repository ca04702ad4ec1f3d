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

STRATEGIES = ("data", "pipeline", "model", "tenants")
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
    node: str
    strategy: str
    mode: str  # "growth" | "limit" | "cpu"
    devices: List[DeviceSlot] = field(default_factory=list)
    stage: Optional[int] = None
    replica: Optional[int] = None
    demand_bytes: Optional[int] = None
    breakdown: Dict[str, int] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

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
        for d in self.devices:
            how = "hard limit" if d.enforce else "growth, budget"
            lab = f" [{d.label}]" if d.label else ""
            parts.append(f"GPU {d.index}{lab} {how} {format_bytes(d.planned_bytes)}"
                         + (f" shared by {d.shared_by}" if d.shared_by > 1 else ""))
        return f"rank {self.rank} (local {self.local_rank}){stage}: " + "; ".join(parts)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["limit_bytes"] = self.limit_bytes
        return d


@dataclass
class Plan:
    """The whole job's plan. Every rank computes the same one; ``rank`` says which row is ours."""

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
        return self.allocations[self.rank]

    def for_rank(self, rank: int) -> Allocation:
        if not 0 <= rank < len(self.allocations):
            raise ConfigError(f"rank {rank} is outside this plan of {len(self.allocations)} ranks")
        return self.allocations[rank]

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

    def fingerprint(self) -> str:
        """Hash of everything but ``rank`` and warnings: equal on every rank of a consistent job."""
        d = self.to_dict()
        d.pop("rank")
        d.pop("warnings")
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def summary(self) -> str:
        lines = [f"distmem plan: strategy={self.strategy} ranks={self.world_size} devices from {self.source}"]
        lines += ["  " + a.describe() for a in self.allocations[:64]]
        if len(self.allocations) > 64:
            lines.append(f"  ... {len(self.allocations) - 64} more ranks")
        return "\n".join(lines)
