"""distmem.report() on real GPUs against independent reads: for every rank of `mpirun -np 2` and
`-np 4` over the machine's GPUs, the report's NVML figure for the process equals pynvml's own read taken right after (within
NVML's 1 MiB reporting grain, 2 MiB allowed), its allocator figures equal torch.cuda's, its list of
processes on the GPU equals NVML's, and the allocator's reserve fits inside what NVML attributes."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "progs"))

import launch  # noqa: E402

MiB = launch.MiB
pytestmark = pytest.mark.gpus(1)


@pytest.mark.parametrize("np", [2, 4])
def test_report_matches_independent_reads(np):
    data = launch.scenario("pin_report.py", np)
    rep = data["report"]
    assert rep is not None and rep["missing"] == [] and len(rep["ranks"]) == np, rep and rep["missing"]
    rows = {r["rank"]: r for r in data["rows"]}
    plan = {a["rank"]: a for a in data["plan"]["allocations"]}
    for snap in rep["ranks"]:
        r = rows[snap["rank"]]
        who = f"rank {snap['rank']}"
        dev, phys = str(r["planned_index"]), str(r["physical_nvml_index"])
        assert snap["pid"] == r["pid"] and snap["framework"] == "torch" and snap["devices"] == [r["planned_index"]]
        assert dev in snap["nvml_bytes"], f"{who}: the report has no NVML figure for GPU {dev}: {snap['nvml_bytes']}"
        mine, indep = snap["nvml_bytes"][dev], r["after_report"][phys]
        assert abs(mine - indep) <= 2 * MiB, f"{who}: report says {mine} B on GPU {dev}, NVML read {indep} B"
        assert snap["current_bytes"] == r["torch"]["allocated"], (who, snap["current_bytes"], r["torch"])
        assert snap["peak_bytes"] == r["torch"]["peak"], (who, snap["peak_bytes"], r["torch"])
        assert snap["reserved_bytes"] == r["torch"]["reserved"], (who, snap["reserved_bytes"], r["torch"])
        assert snap["current_bytes"] >= (snap["rank"] + 1) * 256 * MiB, f"{who}: its hold is not in the report"
        assert snap["reserved_bytes"] <= indep, f"{who}: allocator reserve {snap['reserved_bytes']} > NVML {indep}"
        assert sorted(snap["gpu_pids"][dev]) == r["pids_on_gpu"], (who, snap["gpu_pids"], r["pids_on_gpu"])
        assert snap["limit_bytes"] == plan[snap["rank"]]["limit_bytes"]
        n = len(data["nvml"])  # ranks beyond one per GPU share one: a hard limit
        assert snap["enforced"] == (np > n), f"{who}: enforced={snap['enforced']} with {np} ranks on {n} GPU(s)"
        row = snap["extra"]["framework_devices"][0]
        if snap["enforced"]:
            assert row["limit_bytes"] <= snap["limit_bytes"], (who, row)
    assert not [w for w in rep["warnings"] if "was planned for rank" in w], rep["warnings"]
    launch.evidence(f"report-np{np}", {"aggregates": rep["aggregates"], "warnings": rep["warnings"],
                                        "ranks": [{k: s[k] for k in ("rank", "nvml_bytes", "current_bytes",
                                                                     "reserved_bytes", "limit_bytes")}
                                                  for s in rep["ranks"]]})
