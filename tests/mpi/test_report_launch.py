"""Under mpirun -np 4, one rank never reaches report() (frozen by SIGSTOP until rank 0 is done):
rank 0 returns within the timeout and its report marks the missing rank; in summary mode, rank 0
returns within the timeout with a report that says the reduction is incomplete. Hard timeout on
every launch: a broken timeout shows as a killed launch here, never as a hung suite."""
import json
import os

import pytest

from helpers import mpirun

pytest.importorskip("mpi4py")

PROG = os.path.join(os.path.dirname(__file__), "progs", "missing_rank_report.py")
TIMEOUT = 3.0
# Generous: the bound proves "returns after the timeout, not when the frozen rank comes back" (it
# never would without rank 0), on a loaded 2-core machine.
SLACK = 12.0


@pytest.mark.parametrize("detail", ["full", "summary"])
def test_rank0_returns_within_timeout_when_a_rank_never_reports(tmp_path, detail):
    res = mpirun(4, [PROG], timeout=150, env={"DISTMEM_TEST_OUT": str(tmp_path), "MISSING_DETAIL": detail,
                                              "DISTMEM_TIMEOUT": str(TIMEOUT), "DISTMEM_QUIET": "1"})
    res.check()
    with open(tmp_path / f"missing-{detail}.json") as f:
        out = json.load(f)
    assert out["transport"] == "mpi" and out["late"] == 3
    assert TIMEOUT * 0.9 <= out["elapsed"] < TIMEOUT + SLACK, out
    assert "thawed by rank 0; leaving without ever calling report()" in res.out
    if detail == "full":
        assert out["missing"] == [3] and out["rows"] == [0, 1, 2] and out["kinds"][0] == "missing"
        assert "rank 3 did not report within the timeout" in out["warnings"][0]
        assert "(missing)" in res.out  # the printed table marks it too
    else:
        assert out["complete"] is False and out["ranks_reporting"] is None and out["kinds"] == ["missing"]
        assert "detail='full'" in out["warnings"][0]
