"""PyTorch adapter: pin, limit and read allocator stats; measure the per-process CUDA overhead.

The calls are PyTorch's own: ``torch.cuda.set_device`` (pin), ``torch.cuda.set_per_process_memory_fraction``
(a hard limit on the caching allocator, as a fraction of the total ``cudaMemGetInfo`` reports; distmem
converts the plan's bytes to that fraction once) and ``PYTORCH_CUDA_ALLOC_CONF`` /
``PYTORCH_ALLOC_CONF`` (allocator settings such as expandable segments, read when CUDA starts).
PyTorch always grows on demand, so a rank alone on its GPU is pinned and nothing else.

Order matters: ``set_device``, ``set_per_process_memory_fraction`` and ``mem_get_info`` create a
CUDA context on the device they touch, so the adapter calls them only for planned devices and only
after pinning. If CUDA already holds a context on a device this rank was not planned for,
:func:`apply` raises :class:`TooLateError` naming what came too early; a context on the planned
device itself is accepted (pinning the same device again changes nothing).

``DeviceSlot.index`` is the CUDA ordinal (position in ``CUDA_VISIBLE_DEVICES``). distmem's NVML
inventory lists GPUs in PCI bus order, so before CUDA starts the adapter sets
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` when it is unset (CUDA's default, fastest first, can differ on
mixed machines), and after pinning it checks the GPU's UUID against NVML's.

Every CUDA call goes through a small backend (:class:`TorchCuda`), so that all the logic here runs
in CPU-only tests against a fake with the same methods.
"""
from __future__ import annotations

import math
import os
import sys
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from .. import session, settings
from ..errors import ConfigError, DistmemError, TooLateError
from ..units import MiB, format_bytes

__all__ = ["apply", "prepare", "stats", "reset_peak", "device", "started", "too_late", "TorchCuda", "set_backend",
           "to_fraction", "plan_needs_expandable", "allocator_settable", "TOO_LATE_HINT", "OVERHEAD_TOLERANCE"]

TOO_LATE_HINT = ("call distmem.init(framework='torch') right after the imports, before anything starts CUDA "
                 "(a tensor or module on 'cuda', .cuda(), torch.cuda.set_device, torch.cuda.mem_get_info, "
                 "dist.init_process_group with NCCL); or launch each rank with CUDA_VISIBLE_DEVICES set "
                 "to its GPU")

#: How far a measurement may sit from the overhead a plan subtracts: the plan is never below what
#: NVML measured after a training step and at most this much above it (rounding plus run-to-run
#: jitter of cuBLAS/cuDNN workspaces, observed within a few MiB).
OVERHEAD_TOLERANCE = 128 * MiB

#: Allocator setting distmem may write, and the environment variables PyTorch reads it from
#: (``PYTORCH_ALLOC_CONF`` since 2.9; ``PYTORCH_CUDA_ALLOC_CONF`` before, still honoured).
_CONF_VARS = settings.TORCH_ALLOC_CONF_VARS

# Limits set by apply(), by CUDA ordinal, for stats(): {"limit_bytes", "fraction", "total_bytes"}.
_applied: Dict[int, Dict[str, Any]] = {}


class TorchCuda:
    """The CUDA calls distmem makes, on real ``torch.cuda``. Tests pass a fake with the same methods.

    Only ``set_device``, ``mem_get_info`` and ``set_memory_fraction`` may create a CUDA context; the
    others read state without starting CUDA.
    """

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.cuda = torch.cuda
        self.version = str(torch.__version__)

    def available(self) -> bool:
        return bool(self.cuda.is_available())

    def device_count(self) -> int:
        return int(self.cuda.device_count())

    def is_initialized(self) -> bool:
        return bool(self.cuda.is_initialized())

    def contexts(self) -> Optional[List[int]]:
        """CUDA ordinals that already hold a primary context, or None where torch cannot tell."""
        has = getattr(self.torch._C, "_cuda_hasPrimaryContext", None)
        if has is None:
            return None
        return [i for i in range(self.device_count()) if has(i)]

    def current_device(self) -> int:
        return int(self.cuda.current_device())

    def set_device(self, index: int) -> None:
        self.cuda.set_device(index)

    def mem_get_info(self, index: int) -> Tuple[int, int]:
        free, total = self.cuda.mem_get_info(index)
        return int(free), int(total)

    def set_memory_fraction(self, fraction: float, index: int) -> None:
        self.cuda.set_per_process_memory_fraction(float(fraction), index)

    def device_total(self, index: int) -> int:
        """The device's own total (``cudaGetDeviceProperties``' ``totalGlobalMem``, ``cuDeviceTotalMem``):
        equal to ``mem_get_info``'s total (150109880320 bytes on an H200), except under distmem's
        native cap, which rewrites ``cuMemGetInfo`` alone."""
        return int(self.cuda.get_device_properties(index).total_memory)

    def memory_stats(self, index: int) -> Dict[str, Any]:
        return dict(self.cuda.memory_stats(index))

    def reset_peak(self, index: int) -> None:
        self.cuda.reset_peak_memory_stats(index)

    def device_uuid(self, index: int) -> Optional[str]:
        props = self.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        return str(uuid) if uuid is not None else None

    def set_allocator_settings(self, conf: str) -> bool:
        """Apply allocator settings at run time where this torch allows it; False where it cannot."""
        setter = getattr(self.cuda.memory, "_set_allocator_settings", None)
        if setter is None:
            return False
        setter(conf)
        return True


_backend: Dict[str, Any] = {"override": None}


def set_backend(backend: Optional[Any]) -> None:
    """Use this backend instead of real ``torch.cuda`` (test harnesses; None restores the real one)."""
    _backend["override"] = backend


def _default_backend() -> Any:
    return _backend["override"] if _backend["override"] is not None else TorchCuda()


def to_fraction(planned_bytes: int, total_bytes: int) -> float:
    """The fraction of ``total_bytes`` that ``set_per_process_memory_fraction`` needs so that the
    allocator's cap, ``int(fraction * total)``, is at most ``planned_bytes`` (never above the plan)
    and at most a byte below it. Capped at 1.0."""
    if total_bytes <= 0:
        raise ConfigError(f"CUDA reports a total of {total_bytes} bytes; cannot convert a limit of "
                          f"{format_bytes(planned_bytes)} into a fraction")
    if planned_bytes >= total_bytes:
        return 1.0
    fraction = planned_bytes / total_bytes
    for _ in range(64):  # the quotient is off by a rounding step at most: a few ulps down always suffice
        if int(fraction * total_bytes) <= planned_bytes:
            return fraction
        fraction = math.nextafter(fraction, 0.0)
    raise ConfigError(f"cannot express {planned_bytes} bytes as a fraction of {total_bytes} without exceeding it")


def _too_late(what: str, live: str, planned: str) -> TooLateError:
    return TooLateError(f"CUDA already started in this process, so distmem cannot {what}: live {live}, "
                        f"planned {planned}; {TOO_LATE_HINT}")


def plan_needs_expandable(plan: Any) -> bool:
    """Whether ``plan``'s limits hold only with torch's expandable segments (``strategy="auto"``: the
    chosen layout's largest allocation is larger than its limit's headroom, ``FitResult.expandable_segments``)."""
    fit = (getattr(plan, "extras", None) or {}).get("fit") or {}
    return bool(fit.get("expandable_segments"))


_WHY_FIT = ("the chosen layout's largest allocation is larger than its limit's headroom: without them torch's "
            "caching allocator can strand a block that size and run out below the limit")


def _torch_version() -> str:
    """This torch's version without importing it (``prepare`` runs before anything imports torch)."""
    mod = sys.modules.get("torch")
    if mod is not None:
        return str(getattr(mod, "__version__", "0.0"))
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # noqa: BLE001 - not installed: the older variable name
        return "0.0"


def prepare(plan: Any = None) -> List[str]:
    """Before CUDA starts, in dry runs too: the allocator settings ``plan`` needs. Where the plan's
    limits hold only with expandable segments and the user said nothing about them
    (``DISTMEM_TORCH_EXPANDABLE_SEGMENTS``, an ``expandable_segments`` item of their own), set
    ``expandable_segments:True`` in the variable this torch reads, merged with what is there; the
    line returned says so. A process that already started CUDA is told in the line (``apply`` then
    sets them at run time, for the segments still to come)."""
    if plan is None or not plan_needs_expandable(plan) or settings.torch_expandable_segments() is not None:
        return []
    name = _write_conf(True, _torch_version())
    line = f"{name}={os.environ[name]} ({_WHY_FIT})"
    if started() is not None:
        line += "; CUDA had already started in this process: segments made before keep their kind"
    return [line]


def allocator_settable(*, backend: Any = None) -> bool:
    """Whether allocator settings set now still take effect: CUDA has not started, or this torch
    changes them at run time (``torch.cuda.memory._set_allocator_settings``)."""
    if started(backend=backend) is None:
        return True
    b = backend if backend is not None else _default_backend()
    if isinstance(b, TorchCuda):
        return getattr(b.cuda.memory, "_set_allocator_settings", None) is not None
    return callable(getattr(b, "set_allocator_settings", None))


def _want_expandable(explicit: Optional[bool]) -> Optional[bool]:
    if explicit is not None:
        return bool(explicit)
    try:
        return settings.flag("DISTMEM_TORCH_EXPANDABLE_SEGMENTS")
    except ConfigError:
        raise ConfigError(f"DISTMEM_TORCH_EXPANDABLE_SEGMENTS={settings.raw('DISTMEM_TORCH_EXPANDABLE_SEGMENTS')!r}: "
                          "use 1 (turn expandable segments on), 0 (off) or leave it unset (keep PyTorch's allocator "
                          "settings)") from None


def _conf_var(version: str) -> str:
    """The variable to write when the user set neither: the one this torch reads without warning."""
    for name in _CONF_VARS:
        if os.environ.get(name):
            return name
    try:
        major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return "PYTORCH_CUDA_ALLOC_CONF"
    return "PYTORCH_ALLOC_CONF" if (major, minor) >= (2, 9) else "PYTORCH_CUDA_ALLOC_CONF"


def _write_conf(want: bool, version: str) -> str:
    """Put ``expandable_segments:True/False`` in the variable this torch reads, the user's other
    settings there kept; returns the variable's name."""
    item = f"expandable_segments:{'True' if want else 'False'}"
    name = _conf_var(version)
    parts = [p.strip() for p in os.environ.get(name, "").split(",")
             if p.strip() and not p.strip().startswith("expandable_segments")]
    os.environ[name] = ",".join(parts + [item])
    return name


def _set_expandable(want: bool, backend: Any, initialised: bool) -> str:
    item = f"expandable_segments:{'True' if want else 'False'}"
    name = _write_conf(want, getattr(backend, "version", "0.0"))
    # The allocator may have parsed its settings when torch was imported; set them at run time too.
    try:
        live = backend.set_allocator_settings(item)
    except Exception as exc:  # noqa: BLE001 - an older torch or another allocator backend
        if initialised:
            raise _too_late(f"set {item}", f"allocator settings unchanged ({exc})", item) from None
        live = False
    return f"{name}={os.environ[name]}" + (" (and at run time)" if live else "")


def _nvml_uuid(nvml_index: Optional[int]) -> Optional[str]:
    if nvml_index is None:
        return None
    from ..discover.gpus import nvml_query

    handle = nvml_query("nvmlDeviceGetHandleByIndex", nvml_index, default=None)
    if handle is None:
        return None
    uuid = nvml_query("nvmlDeviceGetUUID", handle, default=None)
    return uuid.decode() if isinstance(uuid, bytes) else uuid


def _check_same_gpu(plan: Any, idx: int, nvml_index: Optional[int], backend: Any) -> Optional[str]:
    """Compare the UUID of CUDA ordinal ``idx`` with the NVML GPU the plan meant; ConfigError if they differ."""
    if plan.source != "nvml" or "MIG" in os.environ.get("CUDA_VISIBLE_DEVICES", ""):
        return None
    try:
        cuda_uuid = backend.device_uuid(idx)
    except Exception:  # noqa: BLE001 - the check is a safeguard, not a requirement
        return None
    nvml_uuid = _nvml_uuid(nvml_index)
    if not cuda_uuid or not nvml_uuid:
        return None
    norm = lambda u: u.lower().replace("gpu-", "")  # noqa: E731 - torch prints UUIDs without NVML's prefix
    if norm(cuda_uuid) != norm(nvml_uuid):
        raise ConfigError(
            f"CUDA ordinal {idx} is GPU {cuda_uuid} but the plan meant NVML GPU {nvml_index} ({nvml_uuid}): CUDA "
            f"and NVML number the GPUs differently (CUDA_DEVICE_ORDER={os.environ.get('CUDA_DEVICE_ORDER', 'unset')}); "
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID for every rank before anything starts CUDA")
    return nvml_uuid


def apply(plan: Any, *, backend: Any = None, expandable_segments: Optional[bool] = None) -> Dict[str, Any]:
    """Configure PyTorch for ``plan.mine``: pin the rank's first planned GPU and hard-limit the caching
    allocator on every planned GPU whose slot is enforced.

    ``expandable_segments`` (default: ``DISTMEM_TORCH_EXPANDABLE_SEGMENTS``, else untouched) turns the
    allocator's expandable segments on or off. ``backend`` replaces ``torch.cuda`` in tests.
    Returns what was done: ``applied`` (lines), ``gpus_seen``, ``devices`` (per ordinal: total, fraction,
    limit).
    """
    alloc = plan.mine
    slots = list(alloc.devices)
    out: Dict[str, Any] = {"framework": "torch", "applied": [], "gpus_seen": 0, "devices": {}}
    if not slots:
        return out  # a CPU rank: nothing to pin, and CUDA stays untouched
    b = backend if backend is not None else _default_backend()
    actions: List[str] = out["applied"]
    initialised = b.is_initialized()
    if not initialised and "CUDA_DEVICE_ORDER" not in os.environ:
        # Read when CUDA starts; makes CUDA ordinals follow NVML's (PCI bus) order, which the plan uses.
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        actions.append("CUDA_DEVICE_ORDER=PCI_BUS_ID")
    groups: "OrderedDict[int, list]" = OrderedDict()
    for s in slots:
        groups.setdefault(s.index, []).append(s)
    first = slots[0].index
    if initialised:  # refuse before changing anything
        live = b.contexts()
        if live is None:
            live = [b.current_device()]
        stray = [i for i in live if i not in groups]
        if stray:
            raise _too_late(f"pin rank {alloc.rank} to cuda:{first}",
                            f"context(s) on {', '.join(f'cuda:{i}' for i in stray)}",
                            ", ".join(f"cuda:{i}" for i in groups))
    want = _want_expandable(expandable_segments)
    if want is None and plan_needs_expandable(plan) and settings.torch_expandable_segments() is None:
        # the plan's limits hold only with them, and the user said nothing: set them for the job
        try:
            actions.append(_set_expandable(True, b, initialised) + f" ({_WHY_FIT})")
        except TooLateError as exc:
            plan.warnings.append(f"the plan's limits assume torch's expandable segments, but {exc}; plan with "
                                 "DISTMEM_TORCH_EXPANDABLE_SEGMENTS=0 (limits with room for the largest block)")
    elif want is not None:
        actions.append(_set_expandable(want, b, initialised))
    if not b.available():
        note = (f"torch {getattr(b, 'version', '?')} sees no CUDA device (a CPU-only build, or "
                "CUDA_VISIBLE_DEVICES hides the GPUs), so the plan's "
                f"{', '.join(f'GPU {s.index}' for s in slots)} limits are not applied")
        if plan.source == "nvml":
            plan.warnings.append(note)
        actions.append("nothing applied: " + note)
        return out
    n = b.device_count()
    out["gpus_seen"] = n
    for idx in groups:
        if not 0 <= idx < n:
            raise ConfigError(f"the plan gives rank {alloc.rank} GPU {idx}, but torch sees only {n} CUDA device(s) "
                              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); plan and "
                              "launch with the same CUDA_VISIBLE_DEVICES on this node")
    b.set_device(first)
    actions.append(f"pinned to cuda:{first}" + (" (CUDA had already started there)" if initialised else ""))
    for idx, group in groups.items():
        out["devices"][idx] = _limit_device(plan, idx, group, b, initialised, actions)
    return out


def _limit_device(plan: Any, idx: int, group: list, b: Any, initialised: bool, actions: List[str]) -> Dict[str, Any]:
    """Hard-limit (or leave growing) CUDA device ``idx`` for the plan's slots ``group`` on it; what was done."""
    uuid = _check_same_gpu(plan, idx, group[0].nvml_index, b)
    planned = sum(s.planned_bytes for s in group)
    info: Dict[str, Any] = {"planned_bytes": planned, "uuid": uuid, "enforced": False}
    if not any(s.enforce for s in group):
        actions.append(f"cuda:{idx}: grows on demand, budget {format_bytes(planned)} (not enforced)")
        _applied.pop(idx, None)
        return info
    free, total = b.mem_get_info(idx)
    if initialised:
        reserved = int(b.memory_stats(idx).get("reserved_bytes.all.current", 0) or 0)
        if reserved > planned:
            raise _too_late(f"limit cuda:{idx} to {format_bytes(planned)}",
                            f"the caching allocator already holds {format_bytes(reserved)}",
                            f"{format_bytes(planned)}")
    # torch takes its fraction of what cuMemGetInfo reports (the cap, under distmem's native cap);
    # whether the GPU holds k ranks is a question about the device itself.
    fraction = to_fraction(planned, total)
    b.set_memory_fraction(fraction, idx)
    limit = int(fraction * total)
    device, capped = _device_total(b, idx, total)
    info.update(enforced=True, total_bytes=total, free_bytes=free, fraction=fraction, limit_bytes=limit)
    if capped:
        info["device_total_bytes"] = device
    _applied[idx] = {"limit_bytes": limit, "fraction": fraction, "total_bytes": total}
    line = f"cuda:{idx}: hard limit {format_bytes(planned)} = {fraction:.6f} of {format_bytes(total)}"
    if len(group) > 1:
        line += (f" (one allocator per device in torch: {len(group)} slices "
                 f"{[s.label or s.planned_bytes for s in group]} share this one limit)")
    actions.append(line)
    if planned > total:
        plan.warnings.append(
            f"GPU {idx}: planned {format_bytes(planned)} exceeds the native cap of {format_bytes(total)} "
            "(DISTMEM_CAP_BYTES), so the limit is the cap; launch with distmem-exec's cap from the same plan "
            "(no --cap) or lower limit=" if capped else
            f"GPU {idx}: planned {format_bytes(planned)} exceeds the {format_bytes(total)} CUDA reports, so the "
            "limit is the whole device; lower limit= or reserve=")
    k = max(s.shared_by for s in group)
    need = k * (planned + plan.overhead_bytes)
    if k > 1 and need > device:
        plan.warnings.append(
            f"GPU {idx}: {k} ranks x (limit {format_bytes(planned)} + per-process overhead "
            f"{format_bytes(plan.overhead_bytes)}) = {format_bytes(need)}, but CUDA reports a total of "
            f"{format_bytes(device)} (NVML's total is larger by what the driver keeps): the last rank to grow can "
            f"run out {format_bytes(need - device)} below its share; pass reserve= at least "
            f"{format_bytes(plan.reserve_bytes + need - device)}")
    return info


def _device_total(b: Any, idx: int, reported: int) -> Tuple[int, bool]:
    """(CUDA's total of device ``idx``, whether distmem's native cap is what ``mem_get_info`` reported):
    under the cap ``cuMemGetInfo`` says min(device, cap), so the device's own total is asked for."""
    from . import native

    st = native.status(idx)
    if not st["active"] or st["cap_bytes"] is None or reported > st["cap_bytes"]:
        return reported, False
    device = max(int(b.device_total(idx)), reported)
    return device, device > reported


def started(*, backend: Any = None) -> Optional[List[int]]:
    """The CUDA ordinals that already hold a context in this process (the current device where torch
    cannot tell), or None while CUDA has not started. Never starts CUDA; never imports torch."""
    if backend is None and _backend["override"] is None and "torch" not in sys.modules:
        return None
    b = backend if backend is not None else _default_backend()
    if not b.is_initialized():
        return None
    live = b.contexts()
    return live if live is not None else [b.current_device()]


def too_late(plan: Any, live: Optional[List[int]]) -> Optional[TooLateError]:
    """Dry runs (no GPU, or a declared fleet): nothing is applied, but a GPU node refuses ``plan``
    when CUDA already holds a context on a device this rank was not planned for (or on any device,
    for a rank planned without a GPU): the same order is the same error here."""
    if live is None:
        return None
    planned = sorted({s.index for s in plan.mine.devices})
    stray = [i for i in live if i not in planned]
    if planned and not stray:
        return None
    err = _too_late(f"pin rank {plan.mine.rank} to " + (f"cuda:{planned[0]}" if planned else "its GPU"),
                    f"context(s) on {', '.join(f'cuda:{i}' for i in stray) or 'none'}",
                    ", ".join(f"cuda:{i}" for i in planned) or "no GPU on this machine")
    source = "no GPU, no declared fleet" if plan.source == "none" else f"devices from {plan.source}"
    return TooLateError(f"{err} (this dry run, {source}, applies nothing, but a GPU node refuses the same order)")


def _indices(plan: Any, backend: Any) -> List[int]:
    if plan is not None and plan.mine.devices:
        return sorted({s.index for s in plan.mine.devices})
    return [backend.current_device()]


def stats(plan: Any = None, *, backend: Any = None) -> Dict[str, Any]:
    """Caching-allocator figures from ``torch.cuda.memory_stats``, summed over the rank's planned GPUs:
    ``current_bytes`` (``allocated_bytes.all.current``, what ``torch.cuda.memory_allocated`` returns),
    ``peak_bytes`` (``.peak``), ``reserved_bytes`` (``reserved_bytes.all.current``: what the allocator
    holds from the driver; ``nvidia-smi`` shows this plus the CUDA context). All None while CUDA has
    not started (stats never start it) or without torch."""
    empty = {"framework": "torch", "current_bytes": None, "peak_bytes": None, "reserved_bytes": None, "devices": []}
    if backend is None and "torch" not in sys.modules:
        return empty
    b = backend if backend is not None else _default_backend()
    if not b.available() or not b.is_initialized():
        return empty
    devices = []
    for idx in _indices(plan, b):
        st = b.memory_stats(idx)
        row = {"device": f"cuda:{idx}", "current_bytes": int(st.get("allocated_bytes.all.current", 0)),
               "peak_bytes": int(st.get("allocated_bytes.all.peak", 0)),
               "reserved_bytes": int(st.get("reserved_bytes.all.current", 0)),
               "reserved_peak_bytes": int(st.get("reserved_bytes.all.peak", 0)),
               "num_ooms": int(st.get("num_ooms", 0))}
        if idx in _applied:
            row["limit_bytes"] = _applied[idx]["limit_bytes"]
        devices.append(row)
    total = lambda key: sum(d[key] for d in devices) if devices else None  # noqa: E731
    return {"framework": "torch", "current_bytes": total("current_bytes"), "peak_bytes": total("peak_bytes"),
            "reserved_bytes": total("reserved_bytes"), "devices": devices}


def reset_peak(plan: Any = None, *, backend: Any = None) -> None:
    """Start a new peak measurement on the rank's GPUs (``torch.cuda.reset_peak_memory_stats``)."""
    if backend is None and "torch" not in sys.modules:
        return
    b = backend if backend is not None else _default_backend()
    if not b.available() or not b.is_initialized():
        return
    for idx in _indices(plan, b):
        b.reset_peak(idx)


def device(plan: Any = None) -> Any:
    """The ``torch.device`` this rank should put its model on: its planned GPU, or the CPU when the plan
    has none for it or torch has no CUDA (a dry run on a CPU machine)."""
    import torch

    if plan is None:
        plan = session.current_plan()
    if plan is None:
        raise DistmemError("distmem.frameworks.torch.device() needs a plan: call distmem.init(framework='torch') first")
    idx = plan.mine.device
    if idx is None or not torch.cuda.is_available() or idx >= torch.cuda.device_count():
        return torch.device("cpu")
    return torch.device("cuda", idx)
