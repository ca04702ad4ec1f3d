"""distmem's messages never meet the job's own MPI traffic: while every rank runs reports, guard flag
all-reduces and plan checks, the job exchanges its own point-to-point messages on COMM_WORLD with
distmem's old tag range and wildcard receives (ANY_SOURCE, ANY_TAG) - and receives exactly its own."""
import os
import pickle
import sys

import pytest
from mpi4py import MPI

import distmem
import distmem.guard as guard
from distmem import comm as dcomm
from distmem.guard.flags import Status, decode, encode

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def test_wildcard_receives_see_only_the_jobs_messages():
    if SIZE < 2:
        pytest.skip("needs 2+ ranks")
    distmem.init(strategy="data", fleet="2x16GiB", framework="none", verbose=False)
    c = dcomm.get_comm()
    flags = guard.flag_reducer(c)
    # Every rank but 0 posts messages to rank 0 with tags distmem used to take (7101..) first,
    # then all ranks run distmem collectives, then rank 0 drains with wildcard receives.
    sent = []
    reqs = []
    for i in range(5):
        if RANK != 0:
            payload = pickle.dumps(("user", RANK, i))
            reqs.append(WORLD.Isend([payload, MPI.BYTE], dest=0, tag=7101 + i))
            sent.append(payload)
    for step in range(3):
        rep = distmem.report(timeout=30, print_table=False)
        summ = distmem.report(timeout=30, detail="summary", print_table=False)
        verdict = decode(flags.reduce(encode(RANK, SIZE, Status.OK), 30), SIZE)
        assert verdict.ok
        distmem.check_plan(timeout=30)
        if RANK == 0:
            assert rep.aggregates["ranks_reporting"] == SIZE and summ.aggregates["ranks_reporting"] == SIZE
    assert c.isolated is True  # on distmem's own communicator
    if RANK == 0:
        got = []
        status = MPI.Status()
        for _ in range(5 * (SIZE - 1)):
            WORLD.Probe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            buf = bytearray(status.Get_count(MPI.BYTE))
            WORLD.Recv([buf, MPI.BYTE], source=status.Get_source(), tag=status.Get_tag())
            got.append(pickle.loads(buf))
        assert all(g[0] == "user" for g in got), got
        assert sorted(got) == sorted(("user", r, i) for r in range(1, SIZE) for i in range(5))
        assert not WORLD.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)  # nothing of distmem's left on WORLD
    MPI.Request.Waitall(reqs)
    WORLD.Barrier()
