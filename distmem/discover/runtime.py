"""What this process's runtime already has: the framework in use, an initialised Horovod,
torch.distributed or MPI. The one place that asks; discover, comm, guard and the facade read it.

Every question looks at what is already imported (``sys.modules``) and never imports or
initialises anything itself: asking must not start TensorFlow, CUDA or MPI.
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Any, Dict, Optional, Sequence

from ..errors import ConfigError

__all__ = ["FRAMEWORKS", "FRAMEWORK_ALIASES", "add_framework", "detect_framework", "horovod", "torch_distributed",
           "nccl_communicators", "mpi"]

#: Frameworks distmem configures; ``add_framework`` (the apply stage's ``register``) adds more.
FRAMEWORKS = ["tensorflow", "torch", "none"]
#: Other spellings users write for them.
FRAMEWORK_ALIASES: Dict[str, str] = {"tf": "tensorflow", "keras": "tensorflow", "pytorch": "torch"}

#: Horovod's framework bindings, in the order they are looked for.
_HOROVOD = {"tensorflow": ("horovod.tensorflow", "horovod.tensorflow.keras", "horovod.keras"),
            "torch": ("horovod.torch",)}


def add_framework(name: str) -> None:
    """Make ``name`` a known framework (a registered adapter)."""
    if name not in FRAMEWORKS:
        FRAMEWORKS.insert(len(FRAMEWORKS) - 1, name)


def detect_framework(explicit: Optional[str] = None) -> str:
    """The framework to configure: the explicit choice (aliases allowed), else one already imported,
    else one installed, else ``"none"``."""
    if explicit is not None:
        name = FRAMEWORK_ALIASES.get(str(explicit).lower(), explicit)
        if name not in FRAMEWORKS:
            raise ConfigError(f"framework={explicit!r} is not one of {', '.join(FRAMEWORKS)} "
                              f"(or {', '.join(sorted(FRAMEWORK_ALIASES))})")
        return name
    for mod, name in (("tensorflow", "tensorflow"), ("horovod.tensorflow", "tensorflow"), ("keras", "tensorflow"),
                      ("torch", "torch"), ("horovod.torch", "torch")):
        if mod in sys.modules:
            return name
    for name in ("tensorflow", "torch"):
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return "none"


def horovod(framework: Optional[str] = None) -> Any:
    """The initialised Horovod module (of ``framework`` when given), or None. A half-imported or
    broken Horovod is no Horovod."""
    kinds: Sequence[str] = [framework] if framework in _HOROVOD else list(_HOROVOD)
    for kind in kinds:
        for name in _HOROVOD[kind]:
            hvd = sys.modules.get(name)
            if hvd is None:
                continue
            try:
                if hvd.is_initialized():
                    return hvd
            except Exception:  # noqa: BLE001 - not initialised, or broken: not a transport
                continue
    return None


def torch_distributed() -> Any:
    """``torch.distributed`` when its default group is initialised, else None."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist
    except Exception:  # noqa: BLE001 - a half-initialised group is no group
        return None
    return None


def nccl_communicators() -> int:
    """NCCL communicators this process holds now: 1 when torch.distributed runs the NCCL backend
    (its default group; more groups are the user's), else 0."""
    dist = torch_distributed()
    try:
        return 1 if dist is not None and dist.get_backend() == "nccl" else 0
    except Exception:  # noqa: BLE001
        return 0


def mpi() -> Any:
    """mpi4py's ``MPI`` module when MPI is initialised and not finalised, else None."""
    mod = sys.modules.get("mpi4py.MPI")
    try:
        if mod is not None and mod.Is_initialized() and not mod.Is_finalized():
            return mod
    except Exception:  # noqa: BLE001
        return None
    return None
