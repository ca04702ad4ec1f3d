"""Stage: discover. Takes the process's environment (launcher variables, Horovod, MPI), NVML and
``CUDA_VISIBLE_DEVICES`` (or a declared fleet) and returns who this rank is (:mod:`.identity`:
rank, size, host, the launcher's local rank) and which physical GPUs it can use (:mod:`.gpus`,
through the one NVML binding :mod:`.nvml`). Nothing here touches CUDA or a framework's GPU.
"""
from __future__ import annotations

from .gpus import Gpu, Inventory, fleet_inventory, inventory, parse_fleet, parse_visible_devices
from .identity import Topology, detect, from_env, launcher_of

__all__ = ["Gpu", "Inventory", "inventory", "fleet_inventory", "parse_fleet", "parse_visible_devices", "Topology",
           "detect", "from_env", "launcher_of"]
