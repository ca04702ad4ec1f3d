"""The memory a measurement may use where it runs: the host's for a CPU measurement, the GPU's for a
GPU one. A target batch is measured only where its step is predicted to fit in it."""
from __future__ import annotations

from typing import Optional, Tuple

__all__ = ["memory_at_hand", "HOST_SHARE", "GPU_SHARE"]

#: The share of the host's available memory (``MemAvailable``) a CPU measurement may plan to use:
#: the measuring process runs beside the user's own, and an over-run is the kernel's OOM killer,
#: not an error a measurement can catch.
HOST_SHARE = 0.5

#: The share of a GPU's free memory a GPU measurement may plan to use (an over-run there is an
#: out-of-memory error the ladder catches and measures below).
GPU_SHARE = 0.9


def _host_available() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import os
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def memory_at_hand(device: str, given: Optional[int] = None) -> Tuple[int, str]:
    """``(bytes, where they come from)`` a measurement on ``device`` (``"CPU:0"``, ``"GPU:0"``,
    ``"cuda:0"``) may use: ``given`` when the caller states it, else :data:`HOST_SHARE` of the
    host's available memory for a CPU, :data:`GPU_SHARE` of the first visible GPU's free memory."""
    if given is not None:
        return int(given), "memory_at_hand given"
    if str(device).upper().startswith("CPU"):
        avail = _host_available()
        if avail is None:
            return 0, "the host's available memory could not be read"
        return int(avail * HOST_SHARE), f"{HOST_SHARE:.0%} of the host's available memory (MemAvailable)"
    from ...discover.gpus import inventory
    gpus = inventory(quiet=True).gpus
    if not gpus:
        return 0, "NVML sees no GPU"
    return int(gpus[0].free_bytes * GPU_SHARE), f"{GPU_SHARE:.0%} of GPU {gpus[0].index}'s free memory (NVML)"
