"""Runs on every rank under mpirun. The first failing rank prints its failure and aborts the whole
job, so no other rank is left waiting in a collective."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/

from ranked_common import fail_fast, fresh_distmem  # noqa: E402,F401 - the autouse fixture


def pytest_runtest_logreport(report):
    if report.failed:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            fail_fast(report, MPI.COMM_WORLD.Get_rank(), lambda: MPI.COMM_WORLD.Abort(1))
