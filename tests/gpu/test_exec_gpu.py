"""distmem-exec on real GPUs (issue 35): `mpirun -np 2` and `-np 4` of `distmem-exec -- python
exec_gpu.py` over the machine's GPUs. Every rank runs under its plan's cap (init(enforce="native")
refuses any other), CUDA reports the cap as the device's total, and the plan's checks judge the device,
not the cap: no rank warns that k ranks do not fit "a total of" the cap (on one H200 every rank of
`mpirun -np 2` did: "2 ranks x (limit 69.0 GiB + overhead) = 139.5 GiB, but CUDA reports a total of
69.0 GiB"). The cap counts what torch reserved, and nothing was denied."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "progs"))

import launch  # noqa: E402

MiB = launch.MiB
pytestmark = pytest.mark.gpus(1)


@pytest.mark.parametrize("np", [2, 4])
def test_every_rank_runs_under_its_plans_cap(np):
    data = launch.scenario("exec_gpu.py", np, wrapper=launch.DISTMEM_EXEC)
    rows = sorted(data["rows"], key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == list(range(np))
    for r in rows:
        who = f"rank {r['rank']} (pid {r['pid']}, {r['shared_by']} on its GPU)"
        assert r["active"] and r["cap"] == r["limit"] == r["planned"], (who, r)
        assert f"rank {r['rank']}, GPU" in (r["origin"] or ""), (who, r["origin"])
        assert not [w for w in r["warnings"] if "CUDA reports a total" in w or "exceeds" in w], (who, r["warnings"])
        assert r["denials"] == 0, (who, r)
        if not data["fake"]:  # the fake GPU is Python: no driver for the library to count
            assert r["cuda_total"] == r["cap"], f"{who}: CUDA reports {r['cuda_total']}, the cap is {r['cap']}"
            assert r["reserved"] <= r["cap_used"] <= r["cap"], (who, r)
    launch.evidence(f"exec-np{np}", {"rows": rows})
