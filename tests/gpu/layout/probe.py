"""One rank on a real GPU: distmem.init(framework="torch"), one training step, then what NVML sees.

    mpirun -np N [-x CUDA_VISIBLE_DEVICES=...] python tests/gpu/layout/probe.py CASE

Prints ``LAYOUT {json}`` per rank: the plan's slot (ordinal, UUID, shared_by, enforced, planned bytes),
the UUID of torch's current device, and every GPU NVML lists this pid on (UUID -> bytes)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from mpi4py import MPI  # noqa: E402

import distmem  # noqa: E402

plan = distmem.init(framework="torch", verbose=False)
import pynvml  # noqa: E402
import torch  # noqa: E402

slot = plan.mine.devices[0]
x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
(x @ x).sum().backward()
torch.cuda.synchronize()
pynvml.nvmlInit()
mine = {}
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
        if p.pid == os.getpid():
            mine[str(pynvml.nvmlDeviceGetUUID(h))] = p.usedGpuMemory
rep = distmem.report(print_table=False, timeout=60)
print("LAYOUT " + json.dumps({"case": sys.argv[1], "rank": MPI.COMM_WORLD.Get_rank(), "cvd": os.environ.get(
    "CUDA_VISIBLE_DEVICES"), "slot": {"index": slot.index, "uuid": slot.uuid, "shared_by": slot.shared_by,
    "enforce": slot.enforce, "planned": slot.planned_bytes}, "torch_uuid": "GPU-" + str(
    torch.cuda.get_device_properties(torch.cuda.current_device()).uuid), "nvml_mine": mine,
    "report_hosts": None if rep is None else rep.aggregates.get("hosts")}), flush=True)
