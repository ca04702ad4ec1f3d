"""Run under torchrun (Gloo): the summary report through torch.distributed's all-reduces equals the
full aggregate of the same synthetic snapshots (ties, stages, a rank above its plan). Rank 0 writes
the comparison to the file named by argv[1]."""
import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/
from ranked_common import synthetic_snapshot  # noqa: E402

import distmem
from distmem import comm as dcomm
from distmem.report.aggregate import Snapshot, aggregate
from distmem.report.summary import summary_report

KEYS = ("ranks_reporting", "ranks_missing", "total_current_bytes", "total_peak_bytes", "max_peak_bytes",
        "min_peak_bytes", "mean_peak_bytes", "imbalance", "max_peak_rank", "total_limit_bytes",
        "min_headroom_bytes", "min_headroom_rank", "total_nvml_bytes", "stage_imbalance")


def main():
    dist.init_process_group("gloo")
    distmem.init(strategy="data", fleet="4x16GiB", framework="none", verbose=False)
    c = dcomm.get_comm()
    rank, size = c.rank, c.size
    mine = synthetic_snapshot(rank, size)
    rows, missing = c.gather(mine.to_dict(), 0, 30)
    summ = summary_report(mine, c, 30)
    if rank == 0:
        full = aggregate([Snapshot.from_dict(r) for r in rows], size, missing)
        out = {"transport": c.name, "size": size,
               "differ": {k: [summ.aggregates.get(k), full.aggregates.get(k)] for k in KEYS
                          if summ.aggregates.get(k) != full.aggregates.get(k)},
               "kinds": [sorted(set(summ.kinds())), sorted(set(full.kinds()))],
               "min_peak_rank": summ.aggregates["summary"]["min_peak_rank"],
               "above_worst_rank": [f for f in summ.findings if f["kind"] == "above_plan"][0]["worst_rank"]}
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
