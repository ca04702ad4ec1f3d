"""The overlapped guard step under a real mpirun -np 4 (tests/mpi/progs/guard_overlap.py): with fail
fast on (init()'s default) the verdict rides in the gradient all-reduce from the second step on; an
OOM on one rank is decided on that same step by every rank, and the run ends with the same
fallbacks and bit-identical weights as the blocking protocol on every rank."""
import json
import os

import pytest

from helpers import mpirun

pytest.importorskip("mpi4py")

PROG = os.path.join(os.path.dirname(__file__), "progs", "guard_overlap.py")


def test_overlapped_guard_decides_like_the_blocking_one(tmp_path):
    res = mpirun(4, [PROG], timeout=240, env={"OUT": str(tmp_path), "DISTMEM_QUIET": "1"})
    res.check()
    rows = json.loads((tmp_path / "overlap.json").read_text())
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["heartbeat"], "fail fast did not start under mpirun"
        assert r["overlapped"]["overlapped"] is True and r["blocking"]["overlapped"] is False
        assert r["overlapped"]["carried"] is True  # the verdict rode in the gradient Allreduce
        assert r["overlapped"]["fallbacks"] == r["blocking"]["fallbacks"] == [[4, [2], 16, 8]]
        assert r["overlapped"]["checksum"] == r["blocking"]["checksum"] == rows[0]["blocking"]["checksum"]
