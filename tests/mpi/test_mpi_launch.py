"""Launch the ranked suite under mpirun at sizes 1, 2 and 4 (hard timeout each), and check that a
failing rank fails the run instead of hanging it."""
import os

import pytest

from helpers import mpirun, pytest_args

pytest.importorskip("mpi4py")


@pytest.mark.parametrize("np", [1, 2, 4])
def test_ranked_suite(np, tmp_path):
    res = mpirun(np, pytest_args("mpi/ranked"), timeout=240, env={"DISTMEM_TEST_OUT": str(tmp_path)})
    res.check()
    assert " passed" in res.out


def test_failing_rank_fails_the_job_quickly():
    res = mpirun(4, [os.path.join(os.path.dirname(__file__), "progs", "fail_rank.py")], timeout=120,
                 env={"DISTMEM_TIMEOUT": "5", "FAIL_RANK": "1"})
    assert not res.timed_out, res.out[-3000:]
    assert res.rc != 0
    assert "failing on purpose" in res.out
