"""GPU inventory through NVML (``nvidia-ml-py``), behind one query helper.

NVML creates no CUDA context, so reading the inventory is safe before any framework starts.
Without NVML or without GPUs the inventory is empty and distmem runs in CPU mode; a declared fleet
(``DISTMEM_FLEET=4x16GiB``) stands in for real GPUs in dry runs.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from ..errors import ConfigError
from ..units import TOO_LARGE, parse_bytes
from .nvml import nvml_available, nvml_error, nvml_handle_module, nvml_query, text

__all__ = ["GpuProcess", "Gpu", "Inventory", "nvml_query", "nvml_available", "inventory", "VISIBLE_ITEM",
           "parse_visible_devices", "parse_fleet", "fleet_inventory", "fleet_uuid", "fleet_hosts", "process_usage",
           "pid_usage", "FLEET_FORM", "MAX_FLEET_GPUS", "with_live_processes"]

log = logging.getLogger("distmem")


@dataclass
class GpuProcess:
    """A process holding memory on a GPU, as NVML reports it (``nvidia-smi``'s process table).

    ``used_bytes`` is None where NVML cannot attribute memory (some containers and MIG setups).
    """

    pid: int
    used_bytes: Optional[int]


@dataclass
class Gpu:
    """One visible GPU. ``index`` is its ordinal as CUDA frameworks see it (position in
    CUDA_VISIBLE_DEVICES); ``nvml_index`` is ``nvidia-smi``'s index. Byte figures are
    ``nvidia-smi --query-gpu=memory.total,memory.used,memory.free`` in bytes."""

    index: int
    nvml_index: Optional[int]
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int = 0
    free_bytes: int = 0
    processes: List[GpuProcess] = field(default_factory=list)
    mig: bool = False
    #: Memory the driver and firmware keep (``nvidia-smi -q``: FB Memory Usage / Reserved; NVML's v2
    #: memory query). CUDA's total (``cudaMemGetInfo``) is ``total_bytes - reserved_bytes``: on an
    #: H200 NVML reports 143771 MiB and CUDA about 143160 MiB.
    reserved_bytes: int = 0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def holders(self) -> Dict[int, Optional[int]]:
        """pid -> bytes NVML attributes to it on this GPU (None where it cannot attribute)."""
        return {p.pid: p.used_bytes for p in self.processes}


def pid_usage(gpus: Sequence[Gpu], pid: int) -> Dict[int, Optional[int]]:
    """Bytes ``pid`` holds on each of ``gpus`` where NVML lists it, by ordinal: the one
    which-process-holds-what lookup (reports, foreign-memory warnings, ``process_usage``)."""
    return {g.index: p.used_bytes for g in gpus for p in g.processes if p.pid == pid}


@dataclass
class Inventory:
    """The GPUs this process may use. ``source`` is ``nvml``, ``fleet:<spec>`` or ``none``."""

    gpus: List[Gpu]
    source: str
    driver: Optional[str] = None
    visible_spec: Optional[str] = None
    note: str = ""

    @property
    def real(self) -> bool:
        """True when the GPUs were read from NVML, False for a declared fleet or none."""
        return self.source == "nvml"

    def to_dict(self) -> Dict[str, Any]:
        return {"gpus": [g.to_dict() for g in self.gpus], "source": self.source, "driver": self.driver,
                "visible_spec": self.visible_spec, "note": self.note}


VISIBLE_ITEM = re.compile(r"^(\d+|GPU-[0-9a-fA-F-]+|MIG-[0-9a-zA-Z/-]+)$")


def parse_visible_devices(spec: Optional[str], physical_uuids: Sequence[str],
                          mig_uuids: Optional[Dict[str, int]] = None) -> List[int | str]:
    """Resolve ``CUDA_VISIBLE_DEVICES`` against the node's GPUs.

    ``physical_uuids`` lists GPU UUIDs in NVML order; ``mig_uuids`` maps MIG UUIDs to their parent
    GPU's NVML index. Returns, in visible order, an NVML index (int) per whole GPU or the MIG UUID
    (str) per MIG instance. ``None`` (unset) means every GPU; ``""``, ``-1`` and ``NoDevFiles``
    mean none. Items may be indices, full or unique-prefix ``GPU-`` UUIDs, or ``MIG-`` UUIDs.
    """
    n = len(physical_uuids)
    if spec is None:
        return list(range(n))
    spec = spec.strip()
    if spec in ("", "-1", "NoDevFiles", "none"):
        return []
    out: List[int | str] = []
    for raw in spec.split(","):
        item = raw.strip()
        if not VISIBLE_ITEM.match(item):
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES={spec!r}: cannot read item {item!r}; use GPU indices (0,1), "
                "GPU UUIDs (GPU-8c1f...) or MIG UUIDs (MIG-...) separated by commas; "
                f"this node has {n} GPU(s)")
        if item.isdigit():
            idx = int(item)
            if idx >= n:
                raise ConfigError(f"CUDA_VISIBLE_DEVICES={spec!r}: index {idx} does not exist; this node "
                                  f"has {n} GPU(s), indices 0..{n - 1}")
            value: int | str = idx
        elif item.startswith("GPU-"):
            hits = [i for i, u in enumerate(physical_uuids) if u.lower().startswith(item.lower())]
            if len(hits) != 1:
                raise ConfigError(f"CUDA_VISIBLE_DEVICES={spec!r}: {item!r} matches {len(hits)} GPU(s) "
                                  f"of {list(physical_uuids)}; give a full UUID from `nvidia-smi -L`")
            value = hits[0]
        else:
            migs = mig_uuids or {}
            hits_m = [u for u in migs if u.lower().startswith(item.lower())]
            if len(hits_m) != 1:
                raise ConfigError(f"CUDA_VISIBLE_DEVICES={spec!r}: MIG device {item!r} matches "
                                  f"{len(hits_m)} MIG instance(s); `nvidia-smi -L` lists their UUIDs")
            value = hits_m[0]
        if value in out:
            raise ConfigError(f"CUDA_VISIBLE_DEVICES={spec!r}: {item!r} names a device listed twice")
        out.append(value)
    return out


def _processes(handle: Any) -> List[GpuProcess]:
    procs: List[GpuProcess] = []
    seen = set()
    for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        for p in nvml_query(fn, handle, default=[]) or []:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            used = getattr(p, "usedGpuMemory", None)
            procs.append(GpuProcess(pid=int(p.pid), used_bytes=int(used) if used is not None else None))
    return procs


_HANDLES: Dict[str, Any] = {}


def with_live_processes(gpus: Sequence[Gpu]) -> List[Gpu]:
    """``gpus`` (an inventory read earlier) with their process lists read now: the only NVML query
    a snapshot needs. Names, UUIDs and totals do not change; re-reading the whole inventory (count,
    handles, MIG modes, memory, names, driver) on every report cost about 1 ms per rank on an H200
    node. Handles are looked up by UUID once per process (MIG instances included)."""
    out: List[Gpu] = []
    for g in gpus:
        handle = _HANDLES.get(g.uuid)
        if handle is None and g.uuid:
            handle = nvml_query("nvmlDeviceGetHandleByUUID", g.uuid, default=None)
            if handle is not None:
                _HANDLES[g.uuid] = handle
        out.append(dataclasses.replace(g, processes=_processes(handle)) if handle is not None
                   else dataclasses.replace(g, processes=[]))
    return out


def _reserved(handle: Any) -> int:
    """Bytes the driver keeps on the GPU, from NVML's v2 memory query; 0 where the driver or binding lacks it."""
    version = getattr(nvml_handle_module(), "nvmlMemory_v2", None)
    info = nvml_query("nvmlDeviceGetMemoryInfo", handle, version, default=None) if version else None
    return int(getattr(info, "reserved", 0) or 0)


def _gpu(ordinal: int, handle: Any, nvml_index: Optional[int], mig: bool) -> Gpu:
    mem = nvml_query("nvmlDeviceGetMemoryInfo", handle, default=None)
    return Gpu(index=ordinal, nvml_index=nvml_index,
               uuid=text(nvml_query("nvmlDeviceGetUUID", handle, default="")),
               name=text(nvml_query("nvmlDeviceGetName", handle, default="unknown")),
               total_bytes=int(mem.total) if mem else 0, used_bytes=int(mem.used) if mem else 0,
               free_bytes=int(mem.free) if mem else 0, processes=_processes(handle), mig=mig,
               reserved_bytes=_reserved(handle))


def inventory(env: Optional[Dict[str, str]] = None, quiet: bool = False) -> Inventory:
    """The GPUs visible to this process, read from NVML; empty (CPU mode) when there are none."""
    env = dict(os.environ if env is None else env)
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if not nvml_available():
        note = f"no GPU inventory: {nvml_error()}; running in CPU mode"
        if not quiet:
            log.info("distmem: %s", note)
        return Inventory([], "none", visible_spec=spec, note=note)
    count = nvml_query("nvmlDeviceGetCount", default=0)
    handles = [nvml_query("nvmlDeviceGetHandleByIndex", i) for i in range(count)]
    uuids = [text(nvml_query("nvmlDeviceGetUUID", h, default="")) for h in handles]
    migs: Dict[str, int] = {}
    mig_handles: Dict[str, Any] = {}
    for i, h in enumerate(handles):
        current = nvml_query("nvmlDeviceGetMigMode", h, default=None)
        if current and current[0] == 1:
            for j in range(nvml_query("nvmlDeviceGetMaxMigDeviceCount", h, default=0)):
                mh = nvml_query("nvmlDeviceGetMigDeviceHandleByIndex", h, j, default=None)
                if mh is not None:
                    u = text(nvml_query("nvmlDeviceGetUUID", mh, default=""))
                    migs[u], mig_handles[u] = i, mh
    visible = parse_visible_devices(spec, uuids, migs)
    if spec is None and migs:
        # A GPU in MIG mode cannot be used whole: CUDA enumerates its MIG instances instead.
        by_parent: Dict[int, List[str]] = {}
        for u, parent in migs.items():
            by_parent.setdefault(parent, []).append(u)
        visible = [x for v in visible for x in (by_parent.get(int(v)) or [v])]
    gpus = [_gpu(o, mig_handles[v], migs[v], True) if isinstance(v, str) else _gpu(o, handles[v], v, False)
            for o, v in enumerate(visible)]
    driver = text(nvml_query("nvmlSystemGetDriverVersion", default="")) or None
    note = "" if gpus else "NVML found no visible GPU; running in CPU mode"
    if note and not quiet:
        log.info("distmem: %s", note)
    return Inventory(gpus, "nvml", driver=driver, visible_spec=spec, note=note)


_FLEET = re.compile(r"^\s*(?:(\d+)\s*[xX*]\s*)?([0-9.]+)\s*([A-Za-z%]*)\s*$")
#: The most GPUs a fleet may declare for one host: no node holds more (NVLink domains of 72-576 GPUs
#: span many nodes), and a plan lists every one of them.
MAX_FLEET_GPUS = 1024
FLEET_FORM = "COUNTxSIZE such as 4x16GiB, mixed sizes as 2x80GiB,2x40GiB, per host as a=2x80GiB;b=4x16GiB (*= any host)"


def fleet_uuid(host: str, index: int) -> str:
    """The stable UUID of declared GPU ``index`` of ``host``: the same on every rank and every run,
    different between hosts, in the ``GPU-<uuid>`` form ``CUDA_VISIBLE_DEVICES`` accepts."""
    import uuid

    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"distmem-fleet://{host}/{index}"))


def fleet_hosts(spec: str, what: str = "fleet") -> Dict[str, str]:
    """Per-host parts of a fleet: ``"a=2x80GiB;b=2x16GiB"`` -> ``{"a": "2x80GiB", "b": "2x16GiB"}``;
    a spec without ``=`` is every host's (key ``"*"``)."""
    spec = (spec or "").strip()
    if not spec:
        raise ConfigError(f"{what}={spec!r} is empty; write {FLEET_FORM}")
    if "=" not in spec:
        return {"*": spec}
    out: Dict[str, str] = {}
    for part in spec.split(";"):
        if not part.strip():
            continue
        host, sep, gpus = part.partition("=")
        if not sep or not host.strip() or not gpus.strip():
            raise ConfigError(f"{what}={spec!r}: cannot read {part.strip()!r}; write {FLEET_FORM}")
        out[host.strip()] = gpus.strip()
    return out


def parse_fleet(spec: str, host: Optional[str] = None, what: str = "fleet") -> List[int]:
    """Totals in bytes of the declared GPUs of ``host``: ``"4x16GiB"`` -> four of 16 GiB;
    ``"2x80GiB,2x40GiB"`` mixes sizes; ``"a=2x80GiB;b=4x16GiB"`` differs per host (``*=`` for the rest)."""
    parts = fleet_hosts(spec, what)
    if host is not None and host in parts:
        mine = parts[host]
    elif "*" in parts:
        mine = parts["*"]
    elif host is None:
        mine = next(iter(parts.values()))
    else:
        raise ConfigError(f"{what}={spec!r} declares GPUs for host(s) {', '.join(sorted(parts))} but not for this "
                          f"host {host!r}; add {host}=COUNTxSIZE or a default *=COUNTxSIZE")
    totals: List[int] = []
    for part in mine.split(","):
        m = _FLEET.match(part)
        if not m:
            raise ConfigError(f"{what}={spec!r}: cannot read {part.strip()!r}; write {FLEET_FORM}")
        if not m.group(3) or m.group(3).endswith("%"):
            raise ConfigError(f"{what}={spec!r}: {part.strip()!r} gives no unit; GPU sizes need one, e.g. "
                              f"{m.group(1) or 1}x{m.group(2)}GiB ({FLEET_FORM})")
        count = int(m.group(1) or 1) if len(m.group(1) or "") <= 9 else MAX_FLEET_GPUS + 1
        if count < 1:
            raise ConfigError(f"{what}={spec!r}: a GPU count must be at least 1, got {count} in {part.strip()!r}")
        if len(totals) + count > MAX_FLEET_GPUS:
            raise ConfigError(f"{what}={spec!r}: {part.strip()!r} makes more than {MAX_FLEET_GPUS} GPUs on one host "
                              f"(already {len(totals)} before it); a fleet declares each host's GPUs, e.g. 8x80GiB, "
                              "and a job of many hosts names them per host (a=8x80GiB;b=8x80GiB) or with *=")
        try:
            size = parse_bytes(m.group(2) + m.group(3), what=f"{what} {part.strip()!r}")
        except ConfigError as exc:
            if TOO_LARGE in str(exc):  # a size beyond any machine: say so, with the bound
                raise ConfigError(f"{what}={spec!r}: {part.strip()!r}: {str(exc).split(': ', 1)[-1]}") from None
            # "4x" reads as 4 of unit "x": say what a fleet item looks like, not a size
            raise ConfigError(f"{what}={spec!r}: cannot read {part.strip()!r} as COUNTxSIZE; write {FLEET_FORM}") from None
        if size < 1024**3 // 4:
            # "4x16" (bytes) likely meant 4x16GiB; a size already in GiB (4x0GiB) has no nearby meaning
            guess = f"{m.group(1) or 1}x{m.group(2)}GiB"
            hint = (f" - did you mean {guess}?" if guess.lower() != part.strip().lower() and float(m.group(2)) > 0
                    else "; give each GPU's memory, e.g. 4x16GiB")
            raise ConfigError(f"{what}={spec!r}: {part.strip()!r} declares GPUs of {size} bytes; a GPU has at least "
                              f"256 MiB{hint}")
        totals += [size] * count
    return totals


def fleet_inventory(spec: str, host: Optional[str] = None, visible: Optional[str] = None,
                    what: str = "fleet") -> Inventory:
    """An inventory of the declared GPUs of ``host`` for dry runs, filtered by ``visible`` (the
    ``CUDA_VISIBLE_DEVICES`` text: indices, UUIDs or unique UUID prefixes) exactly as NVML's would
    be; nothing is applied to hardware. GPU ``i`` of the host has the UUID :func:`fleet_uuid`."""
    name = host if host is not None else "host0"
    totals = parse_fleet(spec, host, what)
    uuids = [fleet_uuid(name, i) for i in range(len(totals))]
    chosen = parse_visible_devices(visible, uuids)
    gpus = [Gpu(index=o, nvml_index=int(v), uuid=uuids[int(v)], name="declared", total_bytes=totals[int(v)],
                free_bytes=totals[int(v)]) for o, v in enumerate(chosen)]
    return Inventory(gpus, f"fleet:{spec}", visible_spec=visible,
                     note="declared fleet (dry run): limits are planned, not applied")


def process_usage(pid: Optional[int] = None) -> Dict[int, Optional[int]]:
    """NVML-measured bytes this process (default: ours) holds on each visible GPU, by ordinal.

    Only GPUs where the process appears are listed; a value of None means NVML lists the process
    but cannot attribute memory to it.
    """
    if not nvml_available():
        return {}
    return pid_usage(inventory(quiet=True).gpus, os.getpid() if pid is None else pid)
