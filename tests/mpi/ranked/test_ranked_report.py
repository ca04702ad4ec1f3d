"""Runs on every rank under mpirun (sizes 1, 2, 4): the summary report equals the full one on the
same job, periodic reports stay in step, and ranks put on one planned-exclusive GPU are named.

The only thing faked is NVML's per-GPU process list (no GPU here): ``_fake_nvml`` swaps
``distmem.discover.gpus.inventory`` for declared GPUs whose process lists say which pids run there,
flagged ``source="nvml"`` so that distmem reads them as it reads NVML. Everything else is real:
the plan, the snapshot code path, MPI transport, aggregation and warnings.
"""
import json
import os

import pytest
from mpi4py import MPI

import distmem
from distmem import comm as dcomm
from distmem.discover import gpus as ddevices
from distmem.report.aggregate import Snapshot, aggregate
from distmem.report.summary import summary_report
from distmem.units import GiB, MiB
from ranked_common import synthetic_snapshot

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
OUT = os.environ.get("DISTMEM_TEST_OUT", "/tmp")

_COMMON = ("ranks_reporting", "ranks_missing", "total_current_bytes", "total_peak_bytes", "max_peak_bytes",
           "min_peak_bytes", "mean_peak_bytes", "imbalance", "max_peak_rank", "total_limit_bytes",
           "min_headroom_bytes", "min_headroom_rank", "total_nvml_bytes", "stage_imbalance")


def test_summary_equals_full_on_real_snapshots():
    """The same job, real TensorFlow allocator figures (CPU:0), rank-dependent allocations."""
    import tensorflow as tf

    distmem.init(strategy="data", fleet="2x16GiB", framework="tensorflow", verbose=False)
    held = tf.zeros((256 * (1 + RANK % 3), 1024))  # 1, 2, 3, 1 MiB: ties between ranks 0 and 3
    snap = distmem.snapshot()  # one read of the live allocator, seen through both paths
    full = distmem.report(timeout=30, detail="full", print_table=False, snapshot=snap)
    summ = distmem.report(timeout=30, detail="summary", print_table=RANK == 0, snapshot=snap)
    del held
    if RANK != 0:
        assert full is None and summ is None
        return
    assert summ.detail == "summary" and summ.ranks == [] and summ.aggregates["transport"] == "mpi"
    assert full.aggregates["ranks_reporting"] == SIZE
    for key in _COMMON:
        assert summ.aggregates.get(key) == full.aggregates.get(key), (key, summ.aggregates, full.aggregates)
    assert full.aggregates["max_peak_bytes"] >= MiB


def test_summary_protocol_equals_aggregate_over_mpi():
    c = dcomm.get_comm()
    mine = synthetic_snapshot(RANK, SIZE)
    rows, missing = c.gather(mine.to_dict(), 0, 30)
    summ = summary_report(mine, c, 30)
    if RANK != 0:
        assert summ is None
        return
    full = aggregate([Snapshot.from_dict(r) for r in rows], SIZE, missing)
    for key in _COMMON:
        assert summ.aggregates.get(key) == full.aggregates.get(key), key
    assert set(summ.kinds()) == set(full.kinds())
    if SIZE == 4:
        assert full.aggregates["max_peak_rank"] == 3 and summ.aggregates["summary"]["min_peak_rank"] == 0
        above = [f for f in summ.findings if f["kind"] == "above_plan"][0]
        assert above["worst_rank"] == 3 and above["used_bytes"] == 10 * GiB  # reserved: peak + 1 GiB


def test_report_every_gathers_at_the_same_steps_on_every_rank(tmp_path):
    distmem.init(strategy="data", fleet="2x16GiB", framework="none", verbose=False)
    path = os.path.join(OUT, f"ranked-timeline-{SIZE}.json")
    from distmem.report.periodic import ReportEvery

    ev = ReportEvery(4, path=path, prometheus=os.path.join(OUT, f"ranked-{SIZE}.prom"))
    results = [ev.step() for _ in range(10)]
    final = ev.close()
    if RANK != 0:
        assert all(r is None for r in results) and final is None and ev.points == []
        return
    assert [i + 1 for i, r in enumerate(results) if r is not None] == [4, 8]
    assert [p["step"] for p in final.timeline] == [4, 8, 10]
    assert all(p["ranks"] == list(range(SIZE)) for p in final.timeline)
    with open(path) as f:
        assert len(json.load(f)["timeline"]) == 3


def _fake_nvml(monkeypatch, procs_by_gpu):
    """TEST-ONLY seam: NVML's process lists, on declared GPUs. ``procs_by_gpu`` maps ordinal -> pids."""
    def fake_inventory(env=None, quiet=False):
        inv = ddevices.fleet_inventory(f"{max(SIZE, 2)}x16GiB")
        for g in inv.gpus:
            g.uuid = f"GPU-fake-{g.index}"
            g.processes = [ddevices.GpuProcess(pid, 900 * MiB) for pid in procs_by_gpu.get(g.index, [])]
        inv.source = "nvml"  # read it as NVML's answer: this is the one faked input
        return inv

    def fake_live(gpus):  # a snapshot re-reads only the process lists (discover.gpus.with_live_processes)
        import dataclasses

        return [dataclasses.replace(g, processes=[ddevices.GpuProcess(pid, 900 * MiB)
                                                  for pid in procs_by_gpu.get(g.index, [])]) for g in gpus]

    monkeypatch.setattr(ddevices, "inventory", fake_inventory)
    monkeypatch.setattr(ddevices, "with_live_processes", fake_live)


@pytest.mark.parametrize("detail", ["full", "summary"])
def test_two_ranks_on_one_planned_exclusive_gpu_are_named(monkeypatch, detail):
    if SIZE < 2:
        pytest.skip("needs 2+ ranks")
    pids = dcomm.get_comm().allgather(os.getpid(), 30)
    distmem.reset()
    # Every rank has its own GPU in the plan (as many GPUs as ranks); rank 1 also runs on GPU 0.
    procs = {r: [pids[r]] for r in range(SIZE)}
    procs[0] = [pids[0], pids[1]]
    _fake_nvml(monkeypatch, procs)
    plan = distmem.init(strategy="data", framework="none", verbose=False)
    assert [d.index for d in plan.mine.devices] == [RANK] and plan.mine.devices[0].shared_by == 1
    rep = distmem.report(timeout=30, detail=detail, print_table=RANK == 0)
    if RANK != 0:
        return
    shared = [f for f in rep.findings if f["kind"] == "shared_gpu"]
    assert len(shared) == 1, rep.warnings
    assert shared[0]["ranks"] == [0, 1], shared
    assert "rank 1" in shared[0]["message"] and ("rank 0" in shared[0]["message"] or "ranks 0, 1" in shared[0]["message"])
    if detail == "full":
        assert shared[0]["planned_ranks"] == [0] and shared[0]["gpu"] == "GPU-fake-0"


def test_sum_maxloc_one_round_equals_the_generic_rounds():
    """MPI's one-round SUM + MAXLOC gives the same sums, maxima and lowest holders as the generic
    three all-reduces of ``Comm.allreduce_sum_maxloc`` (ties, -inf everywhere, negative values)."""
    import random

    from distmem.comm.base import Comm

    distmem.init(strategy="data", fleet="2x16GiB", framework="none", verbose=False)
    c = dcomm.get_comm()
    assert c.name == "mpi" and type(c).allreduce_sum_maxloc is not Comm.allreduce_sum_maxloc
    rnd = random.Random(7 + RANK)
    ninf = float("-inf")
    for trial in range(20):
        sums = [rnd.random() * 1e12 for _ in range(5)] + [float(RANK)]
        maxima = [float(rnd.randint(0, 3)),  # ties between ranks
                  ninf,  # nobody holds it
                  float(RANK % 2) * 7.0 if RANK % 2 else ninf,  # odd ranks only
                  -float(RANK),  # the highest value at rank 0
                  rnd.random() * 2 ** 45]
        one = c.allreduce_sum_maxloc(sums, maxima, timeout=30)
        generic = Comm.allreduce_sum_maxloc(c, sums, maxima, timeout=30)
        assert one[1] == generic[1] and one[2] == generic[2], (trial, one, generic)
        assert all(abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(one[0], generic[0])), (one[0], generic[0])
        assert one[2][1] is None and one[1][1] == ninf
        assert one[2][3] == 0 and one[0][-1] == sum(range(SIZE))
        if SIZE > 1:
            assert one[2][2] == 1  # lowest odd rank
