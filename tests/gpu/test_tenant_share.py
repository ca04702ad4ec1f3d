"""A tenant alone on a real GPU gets no more than the data strategy's equal share (one budget: the
driver's reserved bytes come off both), and that share is what CUDA can really hand out.

Planned from NVML's real inventory (plan_from_env on this machine); CUDA's own total and free
bytes are read in a fresh process (torch.cuda.mem_get_info) so this process never starts CUDA.
"""
import json
import os
import subprocess
import sys

import distmem
from distmem.units import MiB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cuda_free_total():
    code = "import torch, json; f, t = torch.cuda.mem_get_info(0); print(json.dumps([f, t]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0")))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_tenant_alone_gets_the_data_share_and_cuda_can_give_it(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    distmem.reset()
    data = distmem.plan_from_env("data", framework="none")
    tenant = distmem.plan_from_env("tenants", framework="none", tenants={"alone": "auto"})
    assert data.source == "nvml" and tenant.source == "nvml", (data.source, tenant.source)
    gpu = data.mine.devices[0]
    share = gpu.planned_bytes
    slice_ = tenant.mine.devices[0].planned_bytes
    free, cuda_total = _cuda_free_total()
    reserved = gpu.total_bytes - cuda_total
    # one formula for both: total - driver reserved - reserve - foreign - overhead, in whole MiB
    want = ((gpu.total_bytes - max(reserved, 0) - data.reserve_bytes - data.overhead_bytes) // MiB) * MiB
    assert slice_ <= share, f"tenant alone {slice_} > data share {share}"
    assert abs(share - want) <= 64 * MiB, (share, want, reserved)
    # what CUDA can hand out holds the share and the process's memory outside the allocator
    assert share + data.overhead_bytes <= cuda_total, (share, data.overhead_bytes, cuda_total)
    distmem.reset()
