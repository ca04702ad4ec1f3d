"""Every rank under horovodrun -np 4 (Gloo and MPI): the report over the transport distmem picks,
summary equal to full, and two ranks on one planned-exclusive GPU named by the warning (only the
NVML process list is faked, as in tests/mpi/ranked/test_ranked_report.py)."""
import os

import horovod.tensorflow as hvd
import pytest

import distmem
from distmem import comm as dcomm
from distmem.discover import gpus as ddevices
from distmem.report.aggregate import Snapshot, aggregate
from distmem.report.summary import summary_report
from distmem.units import GiB, MiB

RANK, SIZE = hvd.rank(), hvd.size()
_COMMON = ("ranks_reporting", "ranks_missing", "total_current_bytes", "total_peak_bytes", "max_peak_bytes",
           "min_peak_bytes", "mean_peak_bytes", "imbalance", "max_peak_rank", "total_limit_bytes",
           "min_headroom_bytes", "min_headroom_rank", "total_nvml_bytes", "stage_imbalance")


def test_transport_is_the_expected_one():
    want = os.environ.get("EXPECT_TRANSPORT")
    assert dcomm.get_comm().name == want and dcomm.get_comm().size == SIZE


def test_full_and_summary_agree_on_real_snapshots():
    import tensorflow as tf

    distmem.init(strategy="data", fleet="2x16GiB", framework="tensorflow", verbose=False)
    held = tf.zeros((256 * (1 + RANK % 3), 1024))
    # One snapshot through both paths: two reads of a live allocator differ by what Horovod's own
    # collectives allocated in between (5 KiB seen in CI), which says nothing about the two paths.
    snap = distmem.snapshot()
    full = distmem.report(timeout=60, print_table=RANK == 0, snapshot=snap)
    summ = distmem.report(timeout=60, detail="summary", print_table=False, snapshot=snap)
    del held
    if RANK != 0:
        assert full is None and summ is None
        return
    assert [s.rank for s in full.ranks] == list(range(SIZE)) and full.missing == []
    for key in _COMMON:
        assert summ.aggregates.get(key) == full.aggregates.get(key), key


@pytest.mark.parametrize("detail", ["full", "summary"])
def test_horovod_transport_directly(detail):
    """The Horovod transport itself (under --mpi distmem would otherwise pick mpi4py)."""
    c = dcomm.HorovodComm(hvd)
    mine = Snapshot(rank=RANK, size=SIZE, local_rank=RANK, host="h", pid=os.getpid(), framework="tensorflow",
                    strategy="data", devices=[RANK], allocation={}, limit_bytes=8 * GiB, enforced=True,
                    current_bytes=GiB, peak_bytes=(2 + 5 * (RANK == 2)) * GiB, plan_fingerprint="cd" * 8,
                    overhead_bytes=768 * MiB)
    if detail == "full":
        rows, missing = c.gather(mine.to_dict(), 0, 60)
        rep = aggregate([Snapshot.from_dict(r) for r in rows], SIZE, missing) if RANK == 0 else None
    else:
        rep = summary_report(mine, c, 60)
    if RANK == 0:
        assert rep.aggregates["max_peak_rank"] == (2 if SIZE > 2 else 0)
        assert rep.aggregates["total_current_bytes"] == SIZE * GiB
    else:
        assert rep is None


def _fake_nvml(monkeypatch, procs_by_gpu):
    """TEST-ONLY seam: NVML's per-GPU process lists on declared GPUs (no GPU on this machine)."""
    def fake_inventory(env=None, quiet=False):
        inv = ddevices.fleet_inventory(f"{SIZE}x16GiB")
        for g in inv.gpus:
            g.uuid = f"GPU-fake-{g.index}"
            g.processes = [ddevices.GpuProcess(pid, 900 * MiB) for pid in procs_by_gpu.get(g.index, [])]
        inv.source = "nvml"
        return inv

    def fake_live(gpus):  # a snapshot re-reads only the process lists (discover.gpus.with_live_processes)
        import dataclasses

        return [dataclasses.replace(g, processes=[ddevices.GpuProcess(pid, 900 * MiB)
                                                  for pid in procs_by_gpu.get(g.index, [])]) for g in gpus]

    monkeypatch.setattr(ddevices, "inventory", fake_inventory)
    monkeypatch.setattr(ddevices, "with_live_processes", fake_live)


@pytest.mark.parametrize("detail", ["full", "summary"])
def test_two_ranks_on_one_planned_exclusive_gpu(monkeypatch, detail):
    pids = hvd.allgather_object(os.getpid(), name=f"pids.{detail}")
    procs = {r: [pids[r]] for r in range(SIZE)}
    procs[0] = [pids[0], pids[1]]  # rank 1 deliberately on GPU 0 as well
    _fake_nvml(monkeypatch, procs)
    plan = distmem.init(strategy="data", framework="none", verbose=False)
    assert [d.index for d in plan.mine.devices] == [hvd.local_rank()]
    rep = distmem.report(timeout=60, detail=detail, print_table=RANK == 0)
    if RANK == 0:
        (f,) = [f for f in rep.findings if f["kind"] == "shared_gpu"]
        assert f["ranks"] == [0, 1], f
