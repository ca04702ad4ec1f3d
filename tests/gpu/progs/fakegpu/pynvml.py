"""A fake ``pynvml`` over fakegpu.state, for CPU dry runs of the GPU harness (never used on a GPU)."""
from types import SimpleNamespace

import state

nvmlMemory_v2 = 0x02000028


class NVMLError(Exception):
    pass


def nvmlInit():
    return None


def nvmlShutdown():
    return None


def nvmlDeviceGetCount():
    return state.COUNT


def nvmlDeviceGetHandleByIndex(i):
    if not 0 <= i < state.COUNT:
        raise NVMLError("Invalid Argument")
    return i


def nvmlDeviceGetHandleByUUID(uuid):
    u = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    for i in range(state.COUNT):
        if u.lower().replace("gpu-", "") == state.uuid(i):
            return i
    raise NVMLError("Not Found")


def nvmlDeviceGetUUID(h):
    return "GPU-" + state.uuid(h)


def nvmlDeviceGetHandleByUUID(uuid):
    uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    for i in range(state.COUNT):
        if uuid in ("GPU-" + state.uuid(i), state.uuid(i)):
            return i
    raise NVMLError("Not Found")


def nvmlDeviceGetMaxMigDeviceCount(h):
    return 0


def nvmlDeviceGetMigDeviceHandleByIndex(h, i):
    raise NVMLError("Not Supported")


def nvmlDeviceGetName(h):
    return "NVIDIA H200 (fake)"


def nvmlSystemGetDriverVersion():
    return "580.00-fake"


def nvmlDeviceGetMigMode(h):
    raise NVMLError("Not Supported")


def _used(h):
    procs = state.snapshot()["gpus"][str(h)]
    return {int(p): v["ctx"] + v["mem"] for p, v in procs.items()}


def nvmlDeviceGetMemoryInfo(h, version=None):
    used = sum(_used(h).values())
    free = state.NVML_TOTAL - state.DRIVER_RESERVED - used
    if version:
        return SimpleNamespace(version=version, total=state.NVML_TOTAL, reserved=state.DRIVER_RESERVED,
                               used=used, free=free)
    return SimpleNamespace(total=state.NVML_TOTAL, used=state.NVML_TOTAL - free, free=free)


def nvmlDeviceGetComputeRunningProcesses(h):
    return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in sorted(_used(h).items())]


def nvmlDeviceGetGraphicsRunningProcesses(h):
    return []
