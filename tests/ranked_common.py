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


def synthetic_snapshot(rank: int, size: int):
    """A rank-dependent snapshot with ties (ranks 0 and 2), stages, NVML figures and a rank above its
    plan (rank 3, by its reserved pool): the summary-equals-full tests of every transport."""
    from distmem.report.aggregate import Snapshot
    from distmem.units import GiB, MiB

    peak = [3 * GiB, 5 * GiB, 3 * GiB, 9 * GiB][rank % 4] + (rank // 4) * MiB
    return Snapshot(rank=rank, size=size, local_rank=rank, host="h", pid=100 + rank, framework="torch",
                    strategy="pipeline", devices=[rank], allocation={"devices": [{"index": rank, "shared_by": 1}]},
                    limit_bytes=8 * GiB, enforced=True, current_bytes=peak // 2, peak_bytes=peak,
                    reserved_bytes=peak + GiB, nvml_bytes={rank: peak + 2 * GiB}, stage=rank % 2,
                    plan_fingerprint="ab" * 8, overhead_bytes=768 * MiB)
