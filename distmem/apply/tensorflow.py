"""TensorFlow adapter: pin, grow or limit, and read allocator stats.

The calls are the ones TensorFlow documents for this: ``tf.config.set_visible_devices`` (pin),
``tf.config.experimental.set_memory_growth`` (grow on demand, alone on a GPU), and
``tf.config.set_logical_device_configuration`` with ``memory_limit`` in MiB (a hard limit; several
logical devices on one GPU for tenants). Growth *inside* a limit is TensorFlow's
``TF_FORCE_GPU_ALLOW_GROWTH=true``, which must be set before TensorFlow creates its GPU devices.

They must run before TensorFlow initialises its devices (any op, ``list_logical_devices``, a
strategy). Afterwards TensorFlow refuses changes; an identical re-apply is accepted, a different one
raises :class:`TooLateError` naming what came too early.
"""
from __future__ import annotations

import os
import sys
from collections import OrderedDict
from typing import Any, Dict, List, Optional

from ..errors import ConfigError, TooLateError
from ..units import format_bytes, to_mib_floor

__all__ = ["apply", "stats", "reset_peak", "logical_devices", "started", "too_late", "TOO_LATE_HINT"]

TOO_LATE_HINT = ("call distmem.init() right after the imports, before any TensorFlow op, model build, "
                 "tf.config.list_logical_devices() or tf.distribute strategy is created (hvd.init() may come "
                 "before or after it)")


def _tf():
    import tensorflow as tf

    return tf


def _too_late(what: str, live: Any, wanted: Any) -> TooLateError:
    return TooLateError(f"TensorFlow already initialised its devices, so distmem cannot {what}: live "
                        f"configuration {live}, planned {wanted}; {TOO_LATE_HINT}")


def _limits_of(configs: Optional[List[Any]]) -> Optional[List[Optional[int]]]:
    if configs is None:
        return None
    return [getattr(c, "memory_limit", None) for c in configs]


def _configs_text(configs: Optional[List[Any]], kind: str) -> str:
    """A logical device configuration in words: ``[6144, 8192] MiB`` on a GPU; on the CPU, which
    TensorFlow cannot cap, the number of logical devices."""
    if kind == "CPU":
        n = len(configs) if configs else 1
        return f"{n} logical CPU device{'' if n == 1 else 's'}"
    return f"logical devices {_limits_of(configs)} MiB" if configs else "one device, no limit"


def _set_logical(cfg: Any, device: Any, wanted: List[Any], what: str, kind: str = "GPU",
                 planned: Optional[str] = None) -> str:
    try:
        cfg.set_logical_device_configuration(device, wanted)
        return f"{device.name}: {_configs_text(wanted, kind)}"
    except RuntimeError:
        live = cfg.get_logical_device_configuration(device)
        if _limits_of(live) == _limits_of(wanted):
            return f"{device.name}: already {_configs_text(wanted, kind)}"
        raise _too_late(what, _configs_text(live, kind), planned or _configs_text(wanted, kind)) from None


def _apply_cpu(cfg: Any, count: int, plan: Any = None) -> List[str]:
    cpus = cfg.list_physical_devices("CPU")
    wanted = [cfg.LogicalDeviceConfiguration() for _ in range(count)]
    tenants = (plan.extras.get("tenants") if plan is not None else None) or []
    planned = _configs_text(wanted, "CPU") + (" for tenants " + ", ".join(
        f"{t['name']} ({t['device']}, {format_bytes(t['limit_bytes'])} recorded)" for t in tenants) if tenants else "")
    return [_set_logical(cfg, cpus[0], wanted, f"split the CPU into {count} logical devices", "CPU", planned)]


def started() -> Optional[List[str]]:
    """The logical devices TensorFlow already created (e.g. ``["CPU:0"]``), or None while it has
    not initialised them. Never initialises them: it reads the eager context's handle, which
    TensorFlow sets at its first op, model build, device listing or strategy."""
    from ..estimate.isolated import tf_context_started

    if not tf_context_started():
        return None
    try:
        return [d.name.replace("/device:", "") for d in _tf().config.list_logical_devices()]
    except Exception:  # noqa: BLE001 - started, whatever the listing says
        return ["?"]


def too_late(plan: Any, live: Optional[List[str]]) -> Optional[TooLateError]:
    """Dry runs (no GPU, or a declared fleet): nothing is applied, but a GPU node would refuse
    ``plan`` once TensorFlow has started its devices, so the same order is the same error here."""
    if live is None:
        return None
    mine = plan.mine
    planned = (mine.describe() if mine.devices else
               f"rank {mine.rank}: no GPU here; on a GPU node distmem pins and limits its GPU")
    return TooLateError(
        f"TensorFlow already initialised its devices before distmem.init() (live configuration: "
        f"{', '.join(live) or 'none'}, nothing set by distmem), so distmem cannot apply this rank's plan (planned: "
        f"{planned}). This dry run ({_dry_source(plan)}) applies nothing, but a GPU node refuses the same order; "
        f"{TOO_LATE_HINT}")


def _dry_source(plan: Any) -> str:
    return "no GPU, no declared fleet" if plan.source == "none" else f"devices from {plan.source}"


def prepare(plan: Any = None) -> List[str]:
    """Before TensorFlow creates its devices, in dry runs too: give the CPU allocator statistics.

    TensorFlow's default CPU allocator keeps no statistics unless oneDNN is on (the default on Intel
    CPUs, not on AMD), so ``get_memory_info('CPU:0')`` would fail on half the machines. The BFC CPU
    allocator (``TF_CPU_ALLOCATOR_USE_BFC``, read when the CPU device is created) keeps them; a value
    the user set is left alone."""
    done: List[str] = []
    if "CUDA_DEVICE_ORDER" not in os.environ:
        # CUDA's default order (fastest first) can differ from NVML's (PCI bus) on a node with mixed
        # GPUs: TensorFlow's GPU:i would then be another card than the one planned.
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        done.append("CUDA_DEVICE_ORDER=PCI_BUS_ID (TensorFlow's GPU order = NVML's)")
    if "TF_CPU_ALLOCATOR_USE_BFC" not in os.environ:
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
        done.append("TF_CPU_ALLOCATOR_USE_BFC=true (CPU allocator statistics)")
    return done


def _check_same_gpu(cfg: Any, device: Any, slot: Any, rank: int) -> None:
    """TensorFlow exposes no GPU UUID; compare the card's model name with NVML's for the planned GPU,
    which catches TensorFlow and NVML numbering a mixed node differently. ConfigError when they differ."""
    details = getattr(cfg.experimental, "get_device_details", None)
    if details is None or not slot.name or slot.name == "declared":
        return
    try:
        name = (details(device) or {}).get("device_name")
    except (RuntimeError, ValueError):
        return
    if name and name.strip().lower() not in slot.name.strip().lower() and slot.name.strip().lower() not in name.lower():
        raise ConfigError(
            f"rank {rank}: TensorFlow's {device.name} is a {name} but the plan meant NVML GPU {slot.nvml_index} "
            f"({slot.name}, {slot.uuid}): TensorFlow and NVML number the GPUs differently "
            f"(CUDA_DEVICE_ORDER={os.environ.get('CUDA_DEVICE_ORDER', 'unset')}); export CUDA_DEVICE_ORDER=PCI_BUS_ID "
            "for every rank before TensorFlow starts")


def apply(plan: Any, *, tf_config: Any = None) -> Dict[str, Any]:
    """Configure TensorFlow for ``plan.mine``. ``tf_config`` replaces ``tf.config`` in tests."""
    alloc = plan.mine
    slots = alloc.devices
    if any(s.enforce and s.growth for s in slots) and "TF_FORCE_GPU_ALLOW_GROWTH" not in os.environ:
        # Read by TensorFlow's GPU allocator when it is created, i.e. at device initialisation.
        os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
    cfg = tf_config if tf_config is not None else _tf().config
    actions: List[str] = []
    cpu_split = int(plan.extras.get("cpu_logical_devices") or 0)
    gpus = cfg.list_physical_devices("GPU")
    if not gpus or not slots:
        if cpu_split > 1:
            actions += _apply_cpu(cfg, cpu_split, plan)
        out: Dict[str, Any] = {"framework": "tensorflow", "applied": actions, "gpus_seen": len(gpus)}
        if slots and not gpus and plan.source == "nvml":
            out["warnings"] = [
                f"TensorFlow sees no GPU but NVML lists {len(slots)} planned for rank {alloc.rank} "
                f"({', '.join(s.name or '?' for s in slots)}): nothing was applied and TensorFlow runs on the CPU. "
                "Is tensorflow-cpu installed, or CUDA missing? pip install tensorflow[and-cuda]"]
        return out
    by_index: "OrderedDict[int, list]" = OrderedDict()
    for s in slots:
        by_index.setdefault(s.index, []).append(s)
    for idx in by_index:
        if idx >= len(gpus):
            raise ConfigError(f"the plan gives rank {alloc.rank} GPU {idx}, but TensorFlow sees only {len(gpus)} "
                              f"GPU(s) ({[g.name for g in gpus]}); check CUDA_VISIBLE_DEVICES on this node")
    want_visible = [gpus[i] for i in by_index]
    try:
        cfg.set_visible_devices(want_visible, "GPU")
        actions.append(f"visible GPUs {[g.name for g in want_visible]}")
    except RuntimeError:
        live = cfg.get_visible_devices("GPU")
        if [g.name for g in live] != [g.name for g in want_visible]:
            raise _too_late(f"pin rank {alloc.rank} to {[g.name for g in want_visible]}",
                            [g.name for g in live], [g.name for g in want_visible]) from None
        actions.append("visible GPUs already as planned")
    for idx, group in by_index.items():
        device = gpus[idx]
        _check_same_gpu(cfg, device, group[0], alloc.rank)
        if len(group) == 1 and not group[0].enforce:
            try:
                cfg.experimental.set_memory_growth(device, True)
                actions.append(f"{device.name}: memory growth")
            except (RuntimeError, ValueError):
                if not cfg.experimental.get_memory_growth(device):
                    raise _too_late(f"turn on memory growth for {device.name}", "growth off", "growth on") from None
                actions.append(f"{device.name}: memory growth already on")
            continue
        wanted = [cfg.LogicalDeviceConfiguration(memory_limit=to_mib_floor(s.planned_bytes)) for s in group]
        for s in group:
            if to_mib_floor(s.planned_bytes) < 1:
                raise ConfigError(f"planned limit {format_bytes(s.planned_bytes)} on GPU {idx} is below 1 MiB")
        actions.append(_set_logical(cfg, device, wanted,
                                    f"limit {device.name} to {[to_mib_floor(s.planned_bytes) for s in group]} MiB"))
    if cpu_split > 1:
        actions += _apply_cpu(cfg, cpu_split, plan)
    return {"framework": "tensorflow", "applied": actions, "gpus_seen": len(gpus)}


def logical_devices() -> List[str]:
    """Names of the logical devices whose allocator stats describe this rank (GPUs, else CPU:0)."""
    tf = _tf()
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name.replace("/device:", "") for d in gpus] if gpus else ["CPU:0"]


def stats(plan: Any = None) -> Dict[str, Any]:
    """Allocator figures from ``tf.config.experimental.get_memory_info`` (works for CPU:0 too)."""
    if "tensorflow" not in sys.modules:
        return {"framework": "tensorflow", "current_bytes": None, "peak_bytes": None, "reserved_bytes": None,
                "devices": []}
    tf = _tf()
    devices = []
    for name in logical_devices():
        try:
            info = tf.config.experimental.get_memory_info(name)
        except (ValueError, RuntimeError):
            continue  # an allocator without stats (e.g. a CPU built without them)
        devices.append({"device": name, "current_bytes": int(info["current"]), "peak_bytes": int(info["peak"])})
    total = lambda key: sum(d[key] for d in devices) if devices else None  # noqa: E731
    return {"framework": "tensorflow", "current_bytes": total("current_bytes"), "peak_bytes": total("peak_bytes"),
            "reserved_bytes": None, "devices": devices}


def reset_peak(plan: Any = None) -> None:
    """Start a new peak measurement (``tf.config.experimental.reset_memory_stats``)."""
    tf = _tf()
    for name in logical_devices():
        try:
            tf.config.experimental.reset_memory_stats(name)
        except (ValueError, RuntimeError):
            pass


