"""Every ``DISTMEM_*`` environment variable, read in one place, lazily, and validated.

Nothing is read at import: ``import distmem`` never fails on a bad variable. Each accessor reads
the variable when it is asked for and raises :class:`~distmem.errors.ConfigError` naming the
variable, its value and the accepted form. Callers pass ``env`` to read another mapping (tests,
launch wrappers).

=====================================  ==========================================================
variable                               meaning
=====================================  ==========================================================
``DISTMEM_TIMEOUT``                    seconds a collective waits for the other ranks (default 60)
``DISTMEM_FLEET``                      declared GPUs for dry runs: ``4x16GiB``, ``a=2x80GiB;b=2x16GiB``
``DISTMEM_LIMIT``                      per-rank limit for strategy="data" (``6GiB``, ``45%``, ``0.45``)
``DISTMEM_MEMORY``                     ``auto`` | ``growth`` | ``limit``
``DISTMEM_OVERHEAD``                   per-process memory outside the allocator (``768MiB``, ``auto``)
``DISTMEM_REPORT``                     where rank 0 writes the report JSON
``DISTMEM_QUIET``                      ``1``: no progress lines on stderr
``DISTMEM_PLAIN``                      ``1``: plain tables, never rich
``DISTMEM_COMM``                       ``auto`` | ``mpi``: which transport gathers (MPI when launched by it)
``DISTMEM_LAYOUT_DIR``                 folder of the node-local layout exchange (default $XDG_RUNTIME_DIR, /dev/shm or tmp)
``DISTMEM_LAYOUT_TIMEOUT``             seconds a rank waits for its host's other ranks (default DISTMEM_TIMEOUT, else 30)
``DISTMEM_LAUNCH_TIMEOUT``             seconds ``distmem launch-tf`` lets a job run (default 3600)
``DISTMEM_TORCH_EXPANDABLE_SEGMENTS``  ``1`` / ``0``: torch's expandable segments on / off
``DISTMEM_POSTMORTEM``                 ``0``: write no out-of-memory record (default ``1``: every rank writes one)
``DISTMEM_RUN_DIR``                    the run folder: OOM records go to ``RUN_DIR/oom/`` (default: the report's folder, else runs/last)
``DISTMEM_FAIL_FAST``                  ``1`` (default) / ``0``: every rank stops within seconds when one dies
``DISTMEM_HEARTBEAT_SECRET``           the fail-fast heartbeat's secret (the same on every rank, 16+ characters; default: the transport's, else the user's key file)
``DISTMEM_CAP_*``                      the native cap's settings, written by ``distmem-exec``
=====================================  ==========================================================
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

from .errors import ConfigError

__all__ = ["raw", "timeout", "fleet", "limit", "memory", "overhead", "report_path", "quiet", "plain", "comm",
           "layout_dir", "layout_timeout", "launch_timeout", "flag", "torch_expandable_segments",
           "torch_expandable_allowed",
           "TORCH_ALLOC_CONF_VARS", "postmortem", "run_dir", "fail_fast", "heartbeat_secret", "positive_seconds",
           "validate", "MEMORY_MODES", "VARIABLES", "MAX_SECONDS"]

MEMORY_MODES = ("auto", "growth", "limit")
VARIABLES = ("DISTMEM_TIMEOUT", "DISTMEM_FLEET", "DISTMEM_LIMIT", "DISTMEM_MEMORY", "DISTMEM_OVERHEAD",
             "DISTMEM_REPORT", "DISTMEM_QUIET", "DISTMEM_PLAIN", "DISTMEM_COMM", "DISTMEM_LAYOUT_DIR",
             "DISTMEM_LAYOUT_TIMEOUT", "DISTMEM_LAUNCH_TIMEOUT", "DISTMEM_TORCH_EXPANDABLE_SEGMENTS",
             "DISTMEM_POSTMORTEM", "DISTMEM_RUN_DIR", "DISTMEM_FAIL_FAST", "DISTMEM_HEARTBEAT_SECRET")


def raw(name: str, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The variable's text, stripped; None when unset or empty."""
    value = (os.environ if env is None else env).get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


#: The longest wait any setting may ask for (ten years): above it ``threading`` and ``timedelta``
#: overflow (``Event.wait(1e300)`` raises OverflowError), and no collective should wait that long.
MAX_SECONDS = 10 * 365 * 24 * 3600.0


def positive_seconds(value: object, what: str, remedy: str = "") -> float:
    """``value`` as seconds in (0, :data:`MAX_SECONDS`] (a number or its text); ConfigError naming
    ``what`` otherwise (NaN and infinity included)."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        seconds = float("nan")
    if isinstance(value, bool) or not 0 < seconds <= MAX_SECONDS:
        raise ConfigError(f"{what}={value!r} is not a number of seconds above 0 and at most {MAX_SECONDS:.0f} "
                          "(ten years); " + (remedy or "give e.g. 60"))
    return seconds


def _seconds(name: str, default: float, env: Optional[Mapping[str, str]]) -> float:
    text = raw(name, env)
    if text is None:
        return default
    return positive_seconds(text, name, f"set e.g. {name}={default:g} (seconds), or unset it for {default:g}")


def flag(name: str, env: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """A yes/no variable: ``1/true/yes/on`` or ``0/false/no/off``; None when unset."""
    text = raw(name, env)
    if text is None:
        return None
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={text!r} is not a yes/no value; use 1 or 0")


#: The variables torch reads its allocator settings from (``PYTORCH_ALLOC_CONF`` since 2.9,
#: ``PYTORCH_CUDA_ALLOC_CONF`` before and still honoured), the newer first.
TORCH_ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def torch_expandable_segments(env: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """The user's own word on torch's expandable segments: ``DISTMEM_TORCH_EXPANDABLE_SEGMENTS``, else
    an ``expandable_segments:True/False`` item they put in ``PYTORCH_ALLOC_CONF`` or
    ``PYTORCH_CUDA_ALLOC_CONF``; None when they said nothing (distmem may then set them where a
    plan needs them)."""
    given = flag("DISTMEM_TORCH_EXPANDABLE_SEGMENTS", env)
    if given is not None:
        return given
    for var in TORCH_ALLOC_CONF_VARS:
        for item in (raw(var, env) or "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() in ("true", "1")
    return None


def torch_expandable_allowed(value: object, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the job may run with torch's expandable segments: ``value`` when given (True/False),
    else (``"auto"``/None) unless the user turned them off (:func:`torch_expandable_segments`): every
    door reads the same environment, so every door plans the same."""
    if value in (True, False):
        return bool(value)
    if value not in ("auto", None):
        raise ConfigError(f"expandable_segments={value!r}: use 'auto', True or False")
    return torch_expandable_segments(env) is not False


def timeout(env: Optional[Mapping[str, str]] = None) -> float:
    """``DISTMEM_TIMEOUT``: seconds a collective waits for the other ranks (default 60)."""
    return _seconds("DISTMEM_TIMEOUT", 60.0, env)


def layout_timeout(env: Optional[Mapping[str, str]] = None) -> float:
    """``DISTMEM_LAYOUT_TIMEOUT``: seconds a rank waits for its host's other ranks at init (default:
    ``DISTMEM_TIMEOUT`` when that is set, else 30)."""
    return _seconds("DISTMEM_LAYOUT_TIMEOUT", timeout(env) if raw("DISTMEM_TIMEOUT", env) else 30.0, env)


def launch_timeout(env: Optional[Mapping[str, str]] = None) -> float:
    """``DISTMEM_LAUNCH_TIMEOUT``: seconds ``distmem launch-tf`` lets the whole job run (default 3600)."""
    return _seconds("DISTMEM_LAUNCH_TIMEOUT", 3600.0, env)


def fleet(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``DISTMEM_FLEET``: declared GPUs (text; :func:`distmem.discover.gpus.parse_fleet` reads it)."""
    return raw("DISTMEM_FLEET", env)


def limit(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``DISTMEM_LIMIT``: a per-rank limit for strategy="data" (text; the planner parses it)."""
    return raw("DISTMEM_LIMIT", env)


def memory(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``DISTMEM_MEMORY``: ``auto``, ``growth`` or ``limit``; None when unset."""
    text = raw("DISTMEM_MEMORY", env)
    if text is not None and text not in MEMORY_MODES:
        raise ConfigError(f"DISTMEM_MEMORY={text!r} is not one of {', '.join(MEMORY_MODES)}; use 'auto' (growth "
                          "alone on a GPU, hard limit when shared), 'growth' or 'limit'")
    return text


def overhead(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``DISTMEM_OVERHEAD``: per-process memory outside the allocator (text: a size, ``auto`` or ``measure``)."""
    return raw("DISTMEM_OVERHEAD", env)


def report_path(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``DISTMEM_REPORT``: where rank 0 writes the report JSON."""
    return raw("DISTMEM_REPORT", env)


def quiet(env: Optional[Mapping[str, str]] = None) -> bool:
    """``DISTMEM_QUIET=1``: no progress lines on stderr (errors still raise)."""
    return bool(flag("DISTMEM_QUIET", env))


def plain(env: Optional[Mapping[str, str]] = None) -> bool:
    """``DISTMEM_PLAIN=1``: plain text tables, never rich."""
    return bool(flag("DISTMEM_PLAIN", env))


def postmortem(env: Optional[Mapping[str, str]] = None) -> bool:
    """``DISTMEM_POSTMORTEM``: ``0`` turns off the out-of-memory record every rank writes (default on)."""
    value = flag("DISTMEM_POSTMORTEM", env)
    return True if value is None else value


def run_dir(env: Optional[Mapping[str, str]] = None) -> str:
    """``DISTMEM_RUN_DIR``: the run folder (out-of-memory records go to its ``oom/``); default the
    folder of ``DISTMEM_REPORT`` when that is set, else ``runs/last``; relative to the working folder."""
    text = raw("DISTMEM_RUN_DIR", env)
    if text is None:
        report = report_path(env)
        text = os.path.dirname(report) if report and os.path.dirname(report) else os.path.join("runs", "last")
    return os.path.abspath(text)


def heartbeat_secret(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``DISTMEM_HEARTBEAT_SECRET``: the fail-fast heartbeat's secret where the job's transport is not
    up at ``init()`` (see :mod:`distmem.comm.heartbeat_trust`): the same text on every rank, at least
    16 characters (e.g. ``python -c 'import secrets; print(secrets.token_hex(16))'``); None when unset."""
    text = raw("DISTMEM_HEARTBEAT_SECRET", env)
    if text is not None and len(text) < 16:
        raise ConfigError(f"DISTMEM_HEARTBEAT_SECRET has {len(text)} characters; give at least 16 random ones, the "
                          "same on every rank (e.g. export DISTMEM_HEARTBEAT_SECRET=$(python -c 'import secrets; "
                          "print(secrets.token_hex(16))'))")
    return text


def fail_fast(env: Optional[Mapping[str, str]] = None) -> bool:
    """``DISTMEM_FAIL_FAST``: ``1`` (default) starts the heartbeat at ``init()`` (every rank stops within
    seconds of another's death, see :mod:`distmem.comm.heartbeat`); ``0`` leaves it off."""
    value = flag("DISTMEM_FAIL_FAST", env)
    return True if value is None else value


def comm(env: Optional[Mapping[str, str]] = None) -> str:
    """``DISTMEM_COMM``: ``auto`` (default) or ``mpi`` (use MPI whenever mpirun launched the job)."""
    text = raw("DISTMEM_COMM", env) or "auto"
    if text not in ("auto", "mpi", "framework"):
        raise ConfigError(f"DISTMEM_COMM={text!r} is not 'auto', 'mpi' or 'framework'; unset it for 'auto'")
    return text


def validate(env: Optional[Mapping[str, str]] = None) -> None:
    """Read and check every ``DISTMEM_*`` variable now (``init()`` does, before the inventory): a bad
    value fails on a laptop as it would on a GPU node. Structured values (fleet, limit, overhead)
    are checked by their readers with the variable's name."""
    timeout(env)
    layout_timeout(env)
    launch_timeout(env)
    memory(env)
    comm(env)
    for name in ("DISTMEM_QUIET", "DISTMEM_PLAIN", "DISTMEM_TORCH_EXPANDABLE_SEGMENTS", "DISTMEM_CAP_VERBOSE",
                 "DISTMEM_POSTMORTEM", "DISTMEM_FAIL_FAST"):
        flag(name, env)
    heartbeat_secret(env)
    from .units import check_size

    text = limit(env)
    if text is not None:
        check_size(text, what="DISTMEM_LIMIT", allow_fraction=True)
    text = overhead(env)
    if text is not None and text not in ("auto", "measure"):
        check_size(text, what="DISTMEM_OVERHEAD", allow_percent=False)


def layout_dir(env: Optional[Mapping[str, str]] = None) -> str:
    """``DISTMEM_LAYOUT_DIR``: the node-local folder in which ranks of a host exchange their layout
    (through a private folder of this user's inside it, see :mod:`distmem.discover.private`).

    Default: ``$XDG_RUNTIME_DIR`` when it is this user's own 0700 folder (systemd's ``/run/user/UID``:
    nobody else can create anything there), else ``/dev/shm`` where it exists, else the temp folder.
    A relative folder is taken from the working folder."""
    text = raw("DISTMEM_LAYOUT_DIR", env)
    if text is not None:
        return os.path.abspath(text)
    runtime = raw("XDG_RUNTIME_DIR", env)
    if runtime and os.path.isabs(runtime):
        import stat

        try:
            st = os.lstat(runtime)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return runtime
    import tempfile

    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
