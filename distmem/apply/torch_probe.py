"""The per-process overhead probe: memory a process holds outside PyTorch's caching allocator
(CUDA context, cuBLAS/cuDNN workspaces), measured in a short subprocess on a GPU.

``python -m distmem.apply.torch_probe [DEVICE ...]`` prints the figures as JSON lines.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any, Dict, Optional, Sequence

from ..errors import DistmemError
from ..units import MiB

__all__ = ["measure_context", "measure_context_overhead", "measure_child", "MEASURE_TAG", "OVERHEAD_ROUNDING"]

#: The probe's figure is rounded up to this: never below what NVML measured, at most 64 MiB above.
OVERHEAD_ROUNDING = 64 * MiB


MEASURE_TAG = "DISTMEM_MEASURE "


def measure_child(index: int) -> Dict[str, Any]:
    """Runs in a fresh process: start CUDA on ``index``, run a cuBLAS and a cuDNN step with backward,
    and read this process's NVML usage beside the caching allocator's reserved bytes."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    from ..discover.gpus import inventory, nvml_query, pid_usage

    def nvml_device_used() -> Optional[int]:
        gpus = inventory(quiet=True).gpus
        return gpus[index].used_bytes if index < len(gpus) else None

    def nvml_mine() -> Optional[int]:
        return pid_usage(inventory(quiet=True).gpus, os.getpid()).get(index)

    used_before = nvml_device_used()
    import torch

    torch.cuda.set_device(index)
    torch.zeros(1, device=index)
    torch.cuda.synchronize(index)
    after_init = nvml_mine()
    used_after_init = nvml_device_used()
    reserved_init = torch.cuda.memory_reserved(index)
    # A training step: cuBLAS (fp32 and bf16 under autocast, forward and backward) and cuDNN convolution.
    dev = torch.device("cuda", index)
    lin = torch.nn.Linear(1024, 1024).to(dev)
    conv = torch.nn.Conv2d(16, 32, 3, padding=1).to(dev)
    bn = torch.nn.BatchNorm2d(32).to(dev)
    x = torch.randn(64, 1024, device=dev, requires_grad=True)
    img = torch.randn(8, 16, 64, 64, device=dev, requires_grad=True)
    loss = lin(x).square().mean() + bn(conv(img)).relu().mean()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss + lin(x).float().square().mean()
    loss.backward()
    torch.cuda.synchronize(index)
    after_step = nvml_mine()
    used_after_step = nvml_device_used()
    reserved_step = torch.cuda.memory_reserved(index)
    free, total = torch.cuda.mem_get_info(index)
    method = "process"
    if after_step is None:
        # NVML cannot attribute memory to our pid (a container's pid namespace): fall back to the
        # device's used memory before and after, which is exact only when nothing else starts meanwhile.
        method = "device-delta"
        if used_before is not None and used_after_step is not None:
            after_init = used_after_init - used_before if used_after_init is not None else None
            after_step = used_after_step - used_before
    overhead = None if after_step is None else after_step - reserved_step
    props = torch.cuda.get_device_properties(index)
    return {"device": index, "name": props.name, "method": method, "nvml_after_init_bytes": after_init,
            "reserved_after_init_bytes": reserved_init, "nvml_after_step_bytes": after_step,
            "reserved_after_step_bytes": reserved_step, "overhead_bytes": overhead,
            "overhead_after_init_bytes": None if after_init is None else after_init - reserved_init,
            "cuda_total_bytes": int(total), "cuda_free_bytes": int(free), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "driver": nvml_query("nvmlSystemGetDriverVersion", default=None)}


def measure_context(device: int = 0, *, timeout: float = 120.0) -> Dict[str, Any]:
    """Measure, in a short subprocess on CUDA ordinal ``device``, the memory a process holds outside
    PyTorch's caching allocator: NVML's figure for the process (``nvidia-smi``'s process table) after
    CUDA starts and after a cuBLAS + cuDNN training step with backward, minus ``torch.cuda.memory_reserved``.

    Returns the raw figures in bytes (``overhead_bytes`` is the one plans need). Raises
    :class:`DistmemError` when no GPU or NVML is available or the child fails.
    """
    from .. import children  # an isolated sys.path: never a module from the working folder

    code = ("import json\n"
            "from distmem.apply.torch_probe import measure_child, MEASURE_TAG\n"
            "print(MEASURE_TAG + json.dumps(measure_child(%d)), flush=True)\n" % int(device))
    env = dict(os.environ)
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    try:
        proc = children.run(code=code, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise DistmemError(f"measuring the CUDA context on GPU {device} took over {timeout:.0f} s; pass "
                           "overhead='768MiB' (or your own figure) instead of overhead='measure'") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MEASURE_TAG)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise DistmemError(f"measuring the CUDA context on GPU {device} failed (exit code {proc.returncode}): "
                           f"{' | '.join(tail)}; pass overhead='768MiB' (or your own figure) instead of 'measure'")
    figures = json.loads(lines[-1][len(MEASURE_TAG):])
    if figures.get("overhead_bytes") is None:
        raise DistmemError(f"NVML could not attribute GPU memory to the measuring process on GPU {device} "
                           f"({figures}); pass overhead= explicitly")
    return figures


def measure_context_overhead(device: int = 0, *, timeout: float = 120.0, agree: bool = True) -> int:
    """Per-process memory outside PyTorch's allocator on this machine, in bytes, for a plan's ``overhead=``:
    :func:`measure_context`'s ``overhead_bytes`` rounded up to a multiple of :data:`OVERHEAD_ROUNDING`
    (64 MiB). So the figure is never below what NVML measured after a training step and at most 64 MiB
    above it; NCCL communicators, CUDA graphs and other libraries' buffers are not in it (add them).

    With ``agree`` (default) in a job of several ranks, every rank measures its own GPU and all take
    the largest value (one all-reduce), so every rank computes the same plan. Takes a few seconds.
    """
    raw = int(measure_context(device, timeout=timeout)["overhead_bytes"])
    value = max(1, math.ceil(raw / OVERHEAD_ROUNDING)) * OVERHEAD_ROUNDING
    if agree:
        from ..discover.identity import detect

        if detect().size > 1:
            from ..comm import get_comm

            value = int(get_comm().allreduce([float(value)], "max")[0])
    return value


def _main(argv: Sequence[str]) -> int:
    """``python -m distmem.apply.torch_probe [DEVICE ...]``: print the measured figures as JSON lines."""
    for arg in argv or ["0"]:
        figures = measure_context(int(arg))
        figures["overhead_rounded_bytes"] = max(1, math.ceil(figures["overhead_bytes"] / OVERHEAD_ROUNDING)) \
            * OVERHEAD_ROUNDING
        print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
