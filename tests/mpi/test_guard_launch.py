"""Launch the guard's ranked suite (tests/mpi/ranked/test_ranked_guard.py) under mpirun at 1, 2 and 4
ranks, each with a hard timeout: one rank's OOM must leave every rank in step, never hanging."""
import os

import pytest

from helpers import ROOT, mpirun

pytest.importorskip("mpi4py")

RANKED = os.path.join(ROOT, "tests", "mpi", "ranked")


@pytest.mark.parametrize("np", [1, 2, 4])
def test_guard_ranked_suite(np, tmp_path):
    args = ["-m", "pytest", os.path.join(RANKED, "test_ranked_guard.py"), "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", "--rootdir", RANKED]
    res = mpirun(np, args, timeout=420, env={"DISTMEM_GUARD_RANKED": "1", "DISTMEM_TEST_OUT": str(tmp_path)})
    res.check()
    assert " passed" in res.out and "failed" not in res.out, res.out[-3000:]
