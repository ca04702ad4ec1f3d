"""What one snapshot costs on a GPU node, and that its NVML figures are right.

One JSON line: the median seconds of ``distmem.snapshot()`` (the rank's allocator figures, NVML's
process lists on its GPUs, RSS) beside the previous way of reading NVML for it - a whole inventory
(count, handles, MIG modes, memory, names, driver and process lists) on every snapshot - timed in
the same process, interleaved; ratio = snapshot / inventory-per-snapshot. It also checks that the
process-list-only refresh gives this process the same bytes on every GPU as a full inventory.

    PYTHONPATH=. python bench/report/snapshot_cost.py --out bench/results/snapshot_cost_h200.json   # a GPU node
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out")
    args = p.parse_args()
    import distmem
    from distmem.discover import gpus

    plan = distmem.init(strategy="data", framework="torch", verbose=False)
    import torch

    held = None
    if torch.cuda.is_available():
        held = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device="cuda")  # NVML then lists this pid
        torch.cuda.synchronize()
    inv = gpus.inventory(quiet=True)
    pid = os.getpid()
    same = gpus.pid_usage(gpus.with_live_processes(inv.gpus), pid) == gpus.pid_usage(gpus.inventory(quiet=True).gpus, pid)
    times = {"snapshot": [], "inventory": []}
    for i in range(args.calls + 10):
        for k in (("snapshot", "inventory") if i % 2 == 0 else ("inventory", "snapshot")):
            t0 = time.perf_counter()
            if k == "snapshot":
                distmem.snapshot()
            else:
                gpus.pid_usage(gpus.inventory(quiet=True).gpus, pid)
            if i >= 10:
                times[k].append(time.perf_counter() - t0)
    snap = distmem.snapshot()
    med = {k: statistics.median(v) for k, v in times.items()}
    line = {"bench": "snapshot_cost", "figure": "snapshot_seconds", "median_s": med["snapshot"],
            "baseline": "a whole NVML inventory per snapshot (the previous way), same process, interleaved",
            "baseline_median_s": med["inventory"], "ratio": med["snapshot"] / med["inventory"],
            "calls": args.calls, "gpus": len(inv.gpus), "inventory_source": inv.source,
            "nvml_bytes_of_this_process": {str(k): v for k, v in snap.nvml_bytes.items()},
            "same_pid_usage_as_full_inventory": same, "holding_bytes": 0 if held is None else held.numel(),
            "device": inv.gpus[0].name if inv.gpus else None, "strategy": plan.strategy,
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}}
    runner.emit(line, args.out, indent=None)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
