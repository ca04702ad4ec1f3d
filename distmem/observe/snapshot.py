"""One rank's memory at one moment: the :class:`Snapshot` and the figures read off it.

:func:`take` is the one place a snapshot is made: the framework adapter's allocator figures,
NVML's per-process bytes on the rank's GPUs, and RSS, beside the applied plan.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .. import session, settings
from ..apply import adapter
from ..discover import gpus as discover_gpus
from ..discover.identity import detect
from ..errors import DistmemError
from ..units import format_bytes

__all__ = ["Snapshot", "take", "take_row", "rss_bytes", "allocator_pool_bytes", "outside_allocator_bytes", "plan_usage",
           "usage_text", "nvml_on_planned"]


@dataclass
class Snapshot:
    """One rank's memory at one moment. Bytes throughout; None where a figure is not available.

    ``current_bytes``/``peak_bytes``: the framework allocator's in-use and peak (TensorFlow
    ``get_memory_info``, torch ``memory_allocated``/``max_memory_allocated``), summed over the
    rank's devices (``CPU:0`` without a GPU). ``reserved_bytes``: what the allocator holds from the
    driver (torch ``memory_reserved``). ``nvml_bytes``: this process's usage as NVML reports it
    (``nvidia-smi``'s process table), by device ordinal. ``rss_bytes``: resident host memory.
    ``gpu_pids``: for each device this rank uses, every pid NVML lists on it.
    ``gpu_process_bytes``: for each device this rank uses, pid -> NVML used bytes (None where NVML
    cannot attribute memory); lets the report put numbers on foreign and mis-pinned processes.
    """

    rank: int
    size: int
    local_rank: int
    host: str
    pid: int
    framework: str
    strategy: str
    devices: List[int]
    allocation: Dict[str, Any]
    limit_bytes: Optional[int]
    enforced: bool
    current_bytes: Optional[int] = None
    peak_bytes: Optional[int] = None
    reserved_bytes: Optional[int] = None
    nvml_bytes: Dict[int, Optional[int]] = field(default_factory=dict)
    rss_bytes: Optional[int] = None
    gpu_pids: Dict[int, List[int]] = field(default_factory=dict)
    gpu_uuids: Dict[int, str] = field(default_factory=dict)
    stage: Optional[int] = None
    step: Optional[int] = None
    time: float = field(default_factory=time.time)
    plan_fingerprint: str = ""
    host_fingerprint: str = ""
    plan_source: str = ""
    overhead_bytes: Optional[int] = None
    native: Optional[Dict[str, Any]] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    gpu_process_bytes: Dict[int, Dict[int, Optional[int]]] = field(default_factory=dict)

    @property
    def nvml_total(self) -> Optional[int]:
        vals = [v for v in self.nvml_bytes.values() if v is not None]
        return sum(vals) if vals else None

    @property
    def peak_or_current(self) -> Optional[int]:
        """The allocator peak, or the current figure where no peak is kept."""
        return self.peak_bytes if self.peak_bytes is not None else self.current_bytes

    def to_dict(self) -> Dict[str, Any]:
        """Plain data (JSON- and pickle-ready). Field by field, not ``dataclasses.asdict``: asdict
        deep-copies every nested value and was most of a report's cost on the sending ranks. The
        nested values are copied one level (they are plain dicts and lists of plain values)."""
        d = {name: getattr(self, name) for name in _FIELD_NAMES}
        d["devices"] = list(self.devices)
        d["allocation"] = dict(self.allocation)
        d["extra"] = dict(self.extra)
        d["native"] = dict(self.native) if self.native is not None else None
        d["gpu_pids"] = {str(k): list(v) for k, v in self.gpu_pids.items()}
        d["nvml_bytes"] = {str(k): v for k, v in self.nvml_bytes.items()}
        d["gpu_uuids"] = {str(k): v for k, v in self.gpu_uuids.items()}
        d["gpu_process_bytes"] = {str(k): {str(p): b for p, b in v.items()} for k, v in self.gpu_process_bytes.items()}
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Snapshot":
        # The usual row has exactly the known fields (a C-level key check); older or newer files
        # may have fewer or more.
        kw = dict(d) if d.keys() <= _SNAPSHOT_FIELDS else {k: v for k, v in d.items() if k in _SNAPSHOT_FIELDS}
        for key in ("nvml_bytes", "gpu_pids", "gpu_uuids"):
            m = kw.get(key)
            kw[key] = {int(k): v for k, v in m.items()} if m else {}
        m = kw.get("gpu_process_bytes")
        kw["gpu_process_bytes"] = {int(k): {int(p): b for p, b in (v or {}).items()} for k, v in m.items()} if m else {}
        return cls(**kw)


_FIELD_NAMES = tuple(Snapshot.__dataclass_fields__)
_SNAPSHOT_FIELDS = frozenset(_FIELD_NAMES)


def allocator_pool_bytes(s: Snapshot) -> Optional[int]:
    """What the framework allocator holds from the driver, as best the snapshot tells.

    ``reserved_bytes`` where the framework reports it (torch); else the allocator peak, because
    TensorFlow's BFC allocator keeps every chunk it has grown to and never returns it, so its pool
    is its peak, not its current use (subtracting ``current`` would count the free part of the pool
    as memory outside the allocator); else the current figure.
    """
    if s.reserved_bytes is not None:
        return s.reserved_bytes
    return s.peak_or_current


def plan_usage(s: Snapshot) -> Optional[int]:
    """What counts against the rank's planned bytes: the larger of the allocator's peak and what it
    holds from the driver (torch's hard limit caps the reserved pool, not the allocated bytes; a
    pool at its cap means cache flushes, fragmentation and the next spike an OOM)."""
    vals = [v for v in (s.peak_or_current, s.reserved_bytes) if v is not None]
    return max(vals) if vals else None


def usage_text(s: Snapshot, used: int) -> str:
    peak = s.peak_or_current
    if s.reserved_bytes is not None and used == s.reserved_bytes and peak is not None and peak < used:
        return f"holds {format_bytes(used)} in its allocator (reserved; peak allocated {format_bytes(peak)})"
    return f"peaked at {format_bytes(used)}"


def nvml_on_planned(s: Snapshot) -> Optional[int]:
    """NVML's bytes for this process on the devices its plan gave it (memory on other GPUs belongs to
    the shared-GPU warning, not to this rank's own overhead)."""
    if not s.devices:
        return s.nvml_total
    vals = [v for d, v in s.nvml_bytes.items() if d in s.devices and v is not None]
    return sum(vals) if vals else None


def outside_allocator_bytes(s: Snapshot) -> Optional[int]:
    """NVML's figure for this process on its planned devices minus the allocator pool: CUDA context,
    cuBLAS/cuDNN workspaces, NCCL buffers. None without NVML or allocator figures."""
    nv, pool = nvml_on_planned(s), allocator_pool_bytes(s)
    if nv is None or pool is None:
        return None
    return nv - pool




def rss_bytes() -> Optional[int]:
    """This process's resident host memory (``ps``'s RSS) in bytes; None where it cannot be read.

    Linux: ``/proc/self/statm``, kept open and re-read from its start (what psutil reads, without
    building a Process object and opening the file on every snapshot); reopened after a fork.
    Elsewhere psutil."""
    global _STATM
    pid = _pid()
    try:
        if _STATM is None or _STATM[0] != pid:
            if _STATM is not None:  # inherited from the parent of a fork: its /proc entry, not ours
                os.close(_STATM[1])
            _STATM = (pid, os.open(f"/proc/{pid}/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        return int(os.pread(_STATM[1], 128, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError, AttributeError):
        _STATM = None
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - neither /proc nor psutil: no figure
        return None


_PID: List[int] = []


def _pid() -> int:
    """``os.getpid()``, asked once per process (a system call costs microseconds on some VMs, and a
    snapshot is taken on every report); forgotten in a forked child."""
    if not _PID:
        _PID.append(os.getpid())
    return _PID[0]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_PID.clear)

_STATM: Optional[Tuple[int, int]] = None  # (pid, fd of /proc/<pid>/statm)
try:
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):  # not POSIX
    _PAGE = 4096


def take(step: Optional[int] = None) -> Snapshot:
    """This rank's memory now: allocator, NVML per-process and RSS figures beside its applied plan."""
    return Snapshot(**_figures(step))


def take_row(step: Optional[int] = None) -> Dict[str, Any]:
    """:func:`take` as the plain row a rank sends to rank 0 (``Snapshot.from_dict`` reads it back),
    without building the Snapshot: what every rank but the root does on each full report."""
    return _figures(step)


def _figures(step: Optional[int]) -> Dict[str, Any]:
    state = session.state
    plan = state.plan
    if plan is None:
        raise DistmemError("distmem.snapshot()/report() need a plan: call distmem.init() first")
    mine = plan.mine
    fw = state.framework or "none"
    st = adapter(fw).stats(plan)
    topo = state.topology or detect()
    pid = _pid()
    nvml: Dict[int, Optional[int]] = {}
    gpu_pids: Dict[int, List[int]] = {}
    uuids: Dict[int, str] = {}
    procs: Dict[int, Dict[int, Optional[int]]] = {}
    inv = state.inventory
    if inv is not None and inv.real:
        live = discover_gpus.with_live_processes(inv.gpus)
        nvml = discover_gpus.pid_usage(live, pid)
        planned = {d.index for d in mine.devices}
        for g in live:
            if g.index in nvml or g.index in planned:
                uuids[g.index] = g.uuid
            if g.index in planned:
                procs[g.index] = g.holders()
                gpu_pids[g.index] = list(procs[g.index])
    native_status = None
    if settings.raw("DISTMEM_CAP_BYTES"):
        try:
            from ..apply import native

            native_status = native.status()
        except Exception as exc:  # noqa: BLE001 - the report must not fail on the optional cap
            native_status = {"error": str(exc)}
    return dict(rank=mine.rank, size=plan.world_size, local_rank=mine.local_rank, host=mine.host or topo.host,
                pid=pid, framework=fw, strategy=plan.strategy, devices=[d.index for d in mine.devices],
                allocation=session.allocation_dict(plan),
                limit_bytes=mine.limit_bytes if mine.limit_bytes is not None else mine.breakdown.get("planned_bytes"),
                enforced=bool(state.applied and not state.applied.get("dry_run"))
                and any(d.enforce for d in mine.devices),
                current_bytes=st.get("current_bytes"),
                peak_bytes=st.get("peak_bytes"), reserved_bytes=st.get("reserved_bytes"), nvml_bytes=nvml,
                rss_bytes=rss_bytes(), gpu_pids=gpu_pids, gpu_uuids=uuids, gpu_process_bytes=procs,
                stage=mine.stage, step=step, plan_fingerprint=session.fingerprint(plan),
                host_fingerprint=session.host_fingerprint(plan), plan_source=plan.source,
                overhead_bytes=plan.overhead_bytes, native=native_status, time=time.time(),
                extra={"framework_devices": st.get("devices", [])})
