"""Runs on every rank under mpirun. The first failing rank prints its failure and aborts the whole
job, so no other rank is left waiting in a collective."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


@pytest.fixture(autouse=True)
def _fresh_distmem():
    import distmem

    distmem.reset()
    yield
    distmem.reset()


def pytest_runtest_logreport(report):
    if report.failed:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            sys.stderr.write(f"\n[rank {MPI.COMM_WORLD.Get_rank()}] FAILED {report.nodeid}\n{report.longreprtext}\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
