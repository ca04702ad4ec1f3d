"""Stage: observe. Takes the applied plan (``distmem.session``) and returns this rank's
:class:`Snapshot` now: the framework allocator's current / peak / reserved bytes (through the
framework adapter), NVML's per-process bytes on the rank's GPUs, and its resident host memory."""
from __future__ import annotations

from .snapshot import Snapshot, take

__all__ = ["Snapshot", "take"]
