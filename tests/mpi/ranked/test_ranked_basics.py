"""The same body at size 1, 2 and 4: the launcher makes the ranks, each test reads its rank."""
import os

import pytest
from mpi4py import MPI

import distmem
from distmem import comm as dcomm
from distmem.discover.identity import detect

WORLD = MPI.COMM_WORLD


def test_topology_matches_mpi():
    topo = detect()
    assert (topo.rank, topo.size) == (WORLD.Get_rank(), WORLD.Get_size())
    local = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    assert (topo.local_rank, topo.local_size) == (local.Get_rank(), local.Get_size())
    local.Free()


def test_every_rank_computes_the_identical_plan():
    plan = distmem.init(strategy="data", fleet="2x16GiB", verbose=False)
    prints = distmem.check_plan(timeout=30)
    assert len(prints) == WORLD.Get_size() and len(set(prints)) == 1
    full = dcomm.get_comm().allgather(plan.to_dict() | {"rank": None, "warnings": []}, timeout=30)
    assert all(p == full[0] for p in full)
    assert plan.mine.rank == WORLD.Get_rank()


def test_report_has_one_row_per_rank(tmp_path_factory):
    distmem.init(strategy="data", fleet="2x16GiB", verbose=False)
    path = os.path.join(os.environ.get("DISTMEM_TEST_OUT", "/tmp"), f"ranked-report-{WORLD.Get_size()}.json")
    rep = distmem.report(path=path, timeout=30, print_table=WORLD.Get_rank() == 0)
    if WORLD.Get_rank() != 0:
        assert rep is None
        return
    assert [s.rank for s in rep.ranks] == list(range(WORLD.Get_size()))
    assert sorted(s.local_rank for s in rep.ranks) == list(range(WORLD.Get_size()))
    assert len({s.pid for s in rep.ranks}) == WORLD.Get_size()
    assert rep.missing == [] and rep.aggregates["transport"] == "mpi"
    import json

    with open(path) as f:
        data = json.load(f)
    assert [r["rank"] for r in data["ranks"]] == list(range(WORLD.Get_size()))
    for row in data["ranks"]:
        assert {"rank", "local_rank", "host", "pid", "devices", "allocation"} <= set(row)
        assert row["allocation"]["mode"] in ("limit", "growth")


def test_allreduce_ops():
    c = dcomm.get_comm()
    r, n = WORLD.Get_rank(), WORLD.Get_size()
    assert c.allreduce([1, r], "sum") == [n, n * (n - 1) / 2]
    assert c.allreduce([r], "max") == [n - 1]
    assert c.allreduce([r], "min") == [0]


def test_gather_times_out_and_names_the_missing_rank():
    c = dcomm.get_comm()
    n = WORLD.Get_size()
    if n == 1:
        pytest.skip("needs 2+ ranks")
    late = n - 1
    if WORLD.Get_rank() == late:
        WORLD.Barrier()  # skip the gather: the others must not wait forever
        return
    rows, missing = c.gather({"r": WORLD.Get_rank()}, 0, timeout=1.0)
    if WORLD.Get_rank() == 0:
        assert missing == [late]
        assert rows[late] is None and rows[0] == {"r": 0}
    WORLD.Barrier()
