"""The native hard cap, seen from Python: is ``libdistmem_cap.so`` active here, what does it count,
and how to launch a command under it (``distmem-exec``).

The library (``native/``, built by ``scripts/build_native.sh``) is loaded with ``LD_PRELOAD`` and
caps every CUDA allocation of the process, whoever makes it (framework allocator, cuBLAS/cuDNN
workspaces, NCCL buffers), at ``DISTMEM_CAP_BYTES``. It must be in the process from its start, so
Python cannot switch it on; it can only check (``status``, ``require_active``) and launch
(``launch_env``; the ``distmem-exec`` command is :mod:`distmem.cli.exec`). See docs/native.md.
"""
from __future__ import annotations

import ctypes
import os
import shlex
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from .. import settings
from ..errors import ConfigError, DistmemError
from ..units import MiB, format_bytes, parse_bytes

__all__ = ["NativeCapError", "LIBRARY_NAME", "ENV_CAP", "ENV_LIB", "ENV_DEVICE", "ENV_GPU_BUDGET", "ENV_PLAN",
           "ENV_ORIGIN", "ENV_GROUP", "ABI_VERSION", "MIN_CAP", "MAX_CAP", "find_library", "library_path",
           "check_library", "loaded_library", "is_active", "status", "require_active", "parse_cap", "cap_spec",
           "caps_from_plan", "launch_env"]

#: File name of the library; ``distmem/_native/`` holds the built copy.
LIBRARY_NAME = "libdistmem_cap.so"
#: The cap the library enforces: bytes (or "10GiB"), or per device ordinal "0:8GiB,1:4GiB,*:2GiB".
ENV_CAP = "DISTMEM_CAP_BYTES"
#: Overrides where distmem looks for the library.
ENV_LIB = "DISTMEM_CAP_LIB"
#: The device ordinal(s) the cap was planned for (set by distmem-exec; read by ``status``).
ENV_DEVICE = "DISTMEM_CAP_DEVICE"
#: Optional budget shared by all capped processes on each physical GPU (same syntax as ENV_CAP).
ENV_GPU_BUDGET = "DISTMEM_CAP_GPU_BYTES"
#: Fingerprint of the plan distmem-exec computed the cap from (``Plan.fingerprint()``).
ENV_PLAN = "DISTMEM_CAP_PLAN"
#: "SPEC WHO": the DISTMEM_CAP_BYTES text distmem-exec set and how it got it (for error messages).
ENV_ORIGIN = "DISTMEM_CAP_ORIGIN"
#: Numeric group id that shares the GPU-wide budget across users (default: each user alone).
ENV_GROUP = "DISTMEM_CAP_SHM_GROUP"

#: The library's interface version this module reads (``DISTMEM_CAP_ABI_VERSION``).
ABI_VERSION = 2
#: Bounds of a cap or budget, in bytes: below 1 MiB nothing useful runs; above 2^63 - 1 the library
#: cannot count (and 2^64 - 1 is its "unlimited").
MIN_CAP = MiB
MAX_CAP = 2**63 - 1
_UNLIMITED = 2**64 - 1
#: What ld.so cannot take in an LD_PRELOAD entry: it splits the list at spaces and colons and
#: expands $ORIGIN-style tokens.
_PRELOAD_UNSAFE = " \t\n\r:$"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # distmem/, beside _native/
_DEFAULT_TOLERANCE = 1 * MiB

CapLike = Union[int, str, Mapping[int, int]]


class NativeCapError(DistmemError, RuntimeError):
    """The native cap is required but absent, misconfigured, not the plan's, or cannot be loaded."""


class _Stats(ctypes.Structure):
    # Mirrors distmem_cap_stats_t in native/include/distmem_cap.h.
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "cap_bytes", "used_bytes", "peak_bytes", "denials", "last_denied_bytes", "live_allocations",
        "total_allocations")]


class _Info(ctypes.Structure):
    # Mirrors distmem_cap_info_t in native/include/distmem_cap.h.
    _fields_ = [("abi_version", ctypes.c_uint32), ("max_devices", ctypes.c_uint32),
                ("config_ok", ctypes.c_uint32), ("capped", ctypes.c_uint32),
                ("default_cap_bytes", ctypes.c_uint64), ("dlsym_lookups", ctypes.c_uint64),
                ("procaddr_lookups", ctypes.c_uint64), ("wrapped_calls", ctypes.c_uint64),
                ("denials", ctypes.c_uint64)]


class _Shared(ctypes.Structure):
    # Mirrors distmem_cap_shared_t in native/include/distmem_cap.h.
    _fields_ = [(name, ctypes.c_uint64) for name in ("budget_bytes", "used_bytes", "processes", "active")]


# ---- finding the library -------------------------------------------------------------------------

def find_library() -> Optional[str]:
    """Absolute path of the library to preload: ``$DISTMEM_CAP_LIB``, else ``distmem/_native/``.

    None when neither exists.
    """
    override = settings.raw(ENV_LIB)
    if override:
        return os.path.abspath(override) if os.path.isfile(override) else None
    path = os.path.join(_PACKAGE_DIR, "_native", LIBRARY_NAME)
    return path if os.path.isfile(path) else None


def library_path() -> str:
    """Like ``find_library`` but raises ``NativeCapError`` naming where it looked and how to build."""
    path = find_library()
    if path:
        return path
    override = settings.raw(ENV_LIB)
    if override:
        raise NativeCapError(f"{ENV_LIB}={override} does not name a file; point it at a built {LIBRARY_NAME} "
                             f"or unset it to use {os.path.join(_PACKAGE_DIR, '_native', LIBRARY_NAME)}")
    raise NativeCapError(f"{LIBRARY_NAME} is not built: {os.path.join(_PACKAGE_DIR, '_native', LIBRARY_NAME)} "
                         "does not exist. Build it with 'scripts/build_native.sh' (needs cmake and a C "
                         f"compiler, no CUDA toolkit) or set {ENV_LIB}=/path/to/{LIBRARY_NAME}")


def check_library(path: str) -> str:
    """``path`` made absolute, once it names a file ld.so can preload from there; NativeCapError else."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise NativeCapError(f"the cap library {full} does not exist (or is not a file); build it with "
                             f"scripts/build_native.sh or point --library / {ENV_LIB} at a built {LIBRARY_NAME}")
    bad = sorted({c for c in full if c in _PRELOAD_UNSAFE})
    if bad:
        shown = ", ".join({" ": "a space", ":": "a colon", "$": "a '$'"}.get(c, repr(c)) for c in bad)
        raise NativeCapError(f"the cap library's path {full!r} holds {shown}: ld.so splits LD_PRELOAD at spaces and "
                             "colons (and expands '$' tokens), so it would not load it and the command would run "
                             "uncapped. Copy the library to a path without them (or install distmem, e.g. its venv, "
                             f"there) and pass --library or {ENV_LIB}")
    return full


def loaded_library() -> Optional[str]:
    """Path of the cap library mapped into this process (from /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith("libdistmem_cap"):
                    return parts[5].strip()
    except OSError:
        pass
    return None


def _symbols() -> Optional[ctypes.CDLL]:
    """The process's global symbol scope if the library answers there (preloaded), else None.

    A copy loaded later with dlopen(RTLD_LOCAL) is not in that scope, and rightly does not count:
    it interposes nothing.
    """
    try:
        lib = ctypes.CDLL(None)
        lib.distmem_cap_get_info.restype = ctypes.c_int
        lib.distmem_cap_get_info.argtypes = [ctypes.POINTER(_Info), ctypes.c_size_t]
        lib.distmem_cap_get_stats.restype = ctypes.c_int
        lib.distmem_cap_get_stats.argtypes = [ctypes.c_int, ctypes.POINTER(_Stats), ctypes.c_size_t]
        lib.distmem_cap_spec.restype = ctypes.c_char_p
        lib.distmem_cap_config_error.restype = ctypes.c_char_p
    except (OSError, AttributeError):
        return None
    try:  # optional: a library without the GPU-wide budget still caps
        lib.distmem_cap_get_shared.restype = ctypes.c_int
        lib.distmem_cap_get_shared.argtypes = [ctypes.c_int, ctypes.POINTER(_Shared), ctypes.c_size_t]
        lib.distmem_cap_shared_error.restype = ctypes.c_char_p
        lib.distmem_cap_shared_error.argtypes = [ctypes.c_int]
    except AttributeError:
        pass
    return lib


def is_active() -> bool:
    """True when the cap library is preloaded into this process and answering."""
    return _symbols() is not None


def _planned_devices() -> List[int]:
    raw = os.environ.get(ENV_DEVICE, "")
    out = []
    for part in raw.split(","):
        part = part.strip()
        if part.isdigit():
            out.append(int(part))
    return out


def _cap(value: int) -> Optional[int]:
    return None if value == _UNLIMITED else int(value)


# ---- status ----------------------------------------------------------------------------------------

def status(device: Optional[int] = None) -> Dict[str, Any]:
    """What the native cap sees in this process. Never raises; ``active`` says whether it is there.

    Top-level figures describe ``device`` (default: the first ordinal distmem-exec planned for, else
    0), in bytes: ``cap_bytes`` (None: counted, not capped), ``used_bytes`` (live allocations made
    through the wrapped CUDA entry points: framework pools, cuBLAS/cuDNN workspaces, NCCL buffers
    alike, but not the CUDA context itself), ``peak_bytes``, ``denials`` (allocations refused with
    CUDA_ERROR_OUT_OF_MEMORY). ``devices`` lists every device with a cap or any activity. Compare
    ``used_bytes`` with the framework's reserved bytes and NVML's per-process figure: NVML also
    counts the context (about 600 MiB on an H200 with CUDA 13). ``gpu_budget`` (None unless
    ``DISTMEM_CAP_GPU_BYTES`` is set) gives the budget this user's capped processes on the GPU share
    and, once this process has allocated there, what they hold together and how many they are;
    its ``error`` says why the budget cannot be enforced (every allocation there is then denied).
    """
    planned = _planned_devices()
    dev = device if device is not None else (planned[0] if planned else 0)
    out: Dict[str, Any] = {
        "active": False, "library": loaded_library(), "spec": settings.raw(ENV_CAP), "config_ok": None,
        "config_error": None, "device": dev, "planned_devices": planned, "cap_bytes": None,
        "used_bytes": None, "peak_bytes": None, "denials": None, "last_denied_bytes": None,
        "live_allocations": None, "total_allocations": None, "devices": [], "lookups": None,
        "wrapped_calls": None, "reports_cap_as_total": False, "plan_fingerprint": settings.raw(ENV_PLAN),
        "gpu_budget": None,
    }
    lib = _symbols()
    if lib is None:
        return out
    info = _Info()
    if lib.distmem_cap_get_info(ctypes.byref(info), ctypes.sizeof(info)) != 0 or info.abi_version != ABI_VERSION:
        out["config_error"] = (f"library ABI version {info.abi_version} is not the {ABI_VERSION} this distmem "
                               "reads; rebuild it with scripts/build_native.sh")
        return out
    out.update(
        active=True,
        spec=(lib.distmem_cap_spec() or b"").decode(errors="replace"),
        config_ok=bool(info.config_ok),
        config_error=(lib.distmem_cap_config_error() or b"").decode(errors="replace") or None,
        lookups={"dlsym": int(info.dlsym_lookups), "cuGetProcAddress": int(info.procaddr_lookups)},
        wrapped_calls=int(info.wrapped_calls),
        reports_cap_as_total=bool(info.capped),
    )
    if out["library"] is None:
        out["library"] = "(preloaded; path not found in /proc/self/maps)"
    devices = []
    for d in range(int(info.max_devices)):
        s = _Stats()
        if lib.distmem_cap_get_stats(d, ctypes.byref(s), ctypes.sizeof(s)) != 0:
            continue
        row = {"device": d, "cap_bytes": _cap(s.cap_bytes), "used_bytes": int(s.used_bytes),
               "peak_bytes": int(s.peak_bytes), "denials": int(s.denials),
               "last_denied_bytes": int(s.last_denied_bytes), "live_allocations": int(s.live_allocations),
               "total_allocations": int(s.total_allocations)}
        if d == dev:
            out.update({k: v for k, v in row.items() if k != "device"})
        if s.total_allocations or s.denials or d in planned or d == dev:
            devices.append(row)
    out["devices"] = devices
    sh = _Shared()
    get_shared = getattr(lib, "distmem_cap_get_shared", None)
    shared_error = getattr(lib, "distmem_cap_shared_error", None)
    error = (shared_error(dev) or b"").decode(errors="replace") if shared_error else ""
    if get_shared and get_shared(dev, ctypes.byref(sh), ctypes.sizeof(sh)) == 0 and (sh.budget_bytes != _UNLIMITED
                                                                                     or error):
        out["gpu_budget"] = {"budget_bytes": _cap(sh.budget_bytes), "used_bytes": int(sh.used_bytes) if sh.active else None,
                             "processes": int(sh.processes) if sh.active else None, "joined": bool(sh.active),
                             "error": error or None}
    return out


def _launch_hint(cap_bytes: Optional[int]) -> str:
    argv = [os.path.basename(sys.executable) or "python"] + (sys.argv if sys.argv and sys.argv[0] else ["train.py"])
    if argv[1:2] == ["-c"]:
        argv = argv[:2] + ["..."]
    cmd = shlex.join(argv)
    lib = find_library() or f"/path/to/{LIBRARY_NAME}"
    cap = str(cap_bytes) if cap_bytes else "<bytes>"
    build = "" if find_library() else " (build the library first: scripts/build_native.sh)"
    return (f"launch through distmem-exec, which computes this rank's cap from the same plan:\n"
            f"    distmem-exec -- {cmd}\n"
            f"    horovodrun -np 4 distmem-exec -- {cmd}\n"
            f"  or preload it yourself:\n"
            f"    LD_PRELOAD={lib} {ENV_CAP}={cap} {cmd}{build}")


def require_active(cap_bytes: Optional[int] = None, device: Optional[int] = None, *,
                   tolerance_bytes: int = _DEFAULT_TOLERANCE) -> Dict[str, Any]:
    """Raise ``NativeCapError`` unless the cap library is active here and enforces ``cap_bytes``.

    ``cap_bytes`` is the plan's figure for this rank (``plan.mine.limit_bytes``); None checks only
    that the library is active. The library's cap on ``device`` (default as in ``status``) must lie
    within ``tolerance_bytes`` of it. Returns ``status(device)``.
    """
    st = status(device)
    if not st["active"]:
        preload = os.environ.get("LD_PRELOAD")
        why = (f"LD_PRELOAD={preload} names it but the loader did not load it (see the loader's message at "
               "start-up: wrong path or architecture?)" if preload and "libdistmem_cap" in preload
               else f"LD_PRELOAD is {'set to ' + repr(preload) if preload else 'unset'}")
        raise NativeCapError(f"enforce='native' needs {LIBRARY_NAME} preloaded into this process (pid {os.getpid()}), "
                             f"and it is not: {why}. The library must be there from the process's start, so "
                             f"{_launch_hint(cap_bytes)}")
    if not st["config_ok"]:
        raise NativeCapError(f"the native cap is loaded but {ENV_CAP}={st['spec']!r} is invalid "
                             f"({st['config_error']}); every GPU allocation is being denied. Launch through "
                             f"distmem-exec or set {ENV_CAP} to bytes, e.g. {cap_bytes or 10737418240}")
    if cap_bytes is None:
        return st
    have = st["cap_bytes"]
    dev = st["device"]
    if have is None:
        raise NativeCapError(f"the native cap is loaded but does not cap GPU {dev} ({ENV_CAP}={st['spec']!r}); the "
                             f"plan gives this rank {format_bytes(cap_bytes)} ({cap_bytes} bytes). Launch through "
                             f"distmem-exec, or set {ENV_CAP}={cap_bytes}")
    if abs(have - int(cap_bytes)) > tolerance_bytes:
        origin = _origin(st["spec"])
        raise NativeCapError(f"the native cap on GPU {dev} is {format_bytes(have)} ({have} bytes, {ENV_CAP}="
                             f"{st['spec']!r}; {origin}) but the plan gives this rank {format_bytes(cap_bytes)} "
                             f"({cap_bytes} bytes). Pass distmem-exec the same strategy and options as init() "
                             f"(e.g. distmem-exec --strategy pipeline -o stages=9GiB,7GiB -- ...), so both come from one "
                             f"plan, or set {ENV_CAP}={cap_bytes}")
    return st


def _origin(spec: Optional[str]) -> str:
    """Where the cap in force came from, for messages: distmem-exec (how) or the environment."""
    recorded = settings.raw(ENV_ORIGIN) or ""
    set_spec, _, who = recorded.partition(" ")
    if who and set_spec == (spec or ""):
        return f"set by {who}"
    if who:
        return f"set in the environment after {who} had set {ENV_CAP}={set_spec}"
    return "set in the environment, not by distmem-exec"


# ---- launching -------------------------------------------------------------------------------------

def parse_cap(value: Any, what: str = "cap") -> int:
    """``value`` as a cap or budget in bytes, within [MIN_CAP, MAX_CAP]; ConfigError naming both else."""
    try:
        n = parse_bytes(value, what=f"{what} {value}")
    except OverflowError:
        raise ConfigError(f"{what} {value} is too large: the largest the native cap can count is {MAX_CAP} bytes "
                          "(2^63 - 1, 8 EiB)") from None
    if n > MAX_CAP:
        raise ConfigError(f"{what} {value} is {n} bytes, above the largest the native cap can count, {MAX_CAP} bytes "
                          f"(2^63 - 1, 8 EiB; {_UNLIMITED} is its 'unlimited', not a size)")
    if n < MIN_CAP:
        raise ConfigError(f"{what} {value} is {n} bytes, below the smallest cap, {MIN_CAP} bytes (1 MiB): nothing "
                          "that uses a GPU runs in less; give e.g. 10GiB")
    return n


def cap_spec(cap: CapLike) -> str:
    """The ``DISTMEM_CAP_BYTES`` text for a cap: one size for every device, or ``{ordinal: bytes}``."""
    if isinstance(cap, Mapping):
        if not cap:
            raise NativeCapError("no devices to cap: the mapping of device ordinal to bytes is empty")
        parts = []
        for dev, value in sorted(cap.items()):
            if not isinstance(dev, int) or dev < 0 or dev > 63:
                raise NativeCapError(f"device ordinal {dev!r} is not an integer in 0..63")
            parts.append(f"{dev}:{parse_cap(value, what=f'cap of device {dev}')}")
        return ",".join(parts)
    return str(parse_cap(cap))


def caps_from_plan(plan: Any) -> Dict[int, int]:
    """``{device ordinal: bytes}`` for this rank's slots in ``plan`` (slices of one GPU add up)."""
    caps: Dict[int, int] = {}
    for slot in plan.mine.devices:
        caps[int(slot.index)] = caps.get(int(slot.index), 0) + int(slot.planned_bytes)
    return caps


def launch_env(cap: CapLike, *, library: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
               devices: Optional[Sequence[int]] = None, gpu_budget: Optional[CapLike] = None,
               gpu_group: Optional[int] = None) -> Dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) that runs a command under the cap.

    Puts the library first in ``LD_PRELOAD`` (replacing any other copy of it), sets
    ``DISTMEM_CAP_BYTES`` from ``cap``, with ``devices`` ``DISTMEM_CAP_DEVICE``, and with
    ``gpu_budget`` ``DISTMEM_CAP_GPU_BYTES`` (what this user's capped processes on a GPU may hold
    together; with ``gpu_group``, a numeric group id, what that group's may). Raises NativeCapError
    for a library ld.so could not preload from its path, ConfigError for a cap or budget out of
    bounds or a budget below the cap.
    """
    lib = check_library(library if library else library_path())
    out = dict(os.environ if env is None else env)
    others = [p for p in out.get("LD_PRELOAD", "").replace(":", " ").split()
              if os.path.basename(p) != LIBRARY_NAME]
    out["LD_PRELOAD"] = " ".join([lib] + others)
    out[ENV_CAP] = cap_spec(cap)
    if devices is None and isinstance(cap, Mapping):
        devices = sorted(cap)
    if devices is not None:
        out[ENV_DEVICE] = ",".join(str(int(d)) for d in devices)
    for name in (ENV_GPU_BUDGET, ENV_GROUP, ENV_ORIGIN, ENV_PLAN):
        out.pop(name, None)
    if gpu_budget is not None:
        budget = parse_cap(gpu_budget, what="--gpu-budget")
        caps = cap.values() if isinstance(cap, Mapping) else [cap]
        largest = max(parse_cap(c) for c in caps)
        if budget < largest:
            raise ConfigError(f"--gpu-budget {gpu_budget} ({budget} bytes) is below the cap {_shown(cap, largest)} "
                              f"({largest} bytes): the budget holds all capped processes on a GPU together, so it must "
                              "be at least one process's cap; raise it or lower the cap")
        out[ENV_GPU_BUDGET] = str(budget)
    if gpu_group is not None:
        if gpu_budget is None:
            raise ConfigError("a group for the GPU-wide budget needs the budget itself: add --gpu-budget SIZE")
        out[ENV_GROUP] = str(int(gpu_group))
    return out


def _shown(cap: CapLike, largest: int) -> str:
    if isinstance(cap, Mapping):
        return format_bytes(largest)
    return str(cap)
