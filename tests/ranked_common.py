"""What every ranked/ conftest shares (mpirun, horovodrun, the guard's horovodrun suite): a fresh
distmem around each test, and fail-fast - the first failing rank prints its failure with its rank
and ends the whole job, so no other rank is left waiting in a collective."""
import os
import sys
from typing import Callable

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def fresh_distmem():
    import distmem

    distmem.reset()
    yield
    distmem.reset()


def fail_fast(report, rank: object, end: Callable[[], None]) -> None:
    """On a failed test report: print it prefixed with ``rank``, then ``end()`` the job."""
    if report.failed:
        sys.stderr.write(f"\n[rank {rank}] FAILED {report.nodeid}\n{report.longreprtext}\n")
        sys.stderr.flush()
        end()
