"""Launch tests/horovod/ranked under `horovodrun -np 4` with the Gloo and the MPI controller (hard
timeout each), and the missing-rank program under both.

Which transport distmem uses: under --gloo, Horovod's own collectives (HorovodComm); under --mpi,
mpi4py (the ranks are MPI processes, and mpi4py's point-to-point gives per-rank timeouts). The
ranked suite also drives HorovodComm directly in MPI mode.
"""
import json
import os

import pytest

from helpers import env_bin, horovodrun, pytest_args

if not os.path.exists(os.path.join(env_bin(), "horovodrun")):
    pytest.skip("horovodrun not in this environment (the main environment has it)", allow_module_level=True)

MODES = [("gloo", "horovod"), ("mpi", "mpi")]
PROG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi", "progs",
                    "missing_rank_report.py")


@pytest.mark.parametrize("mode,transport", MODES)
def test_ranked_suite(mode, transport, tmp_path):
    res = horovodrun(4, pytest_args("horovod/ranked"), mode=mode, timeout=480,
                     env={"DISTMEM_TEST_OUT": str(tmp_path), "EXPECT_TRANSPORT": transport, "DISTMEM_QUIET": "1"})
    res.check()
    assert " passed" in res.out
    assert os.path.getsize(tmp_path / "callback" / "memory.png") > 20_000
    keep = os.environ.get("DISTMEM_KEEP_PLOTS")  # a folder: keep the PNGs to look at
    if keep:
        import shutil

        os.makedirs(keep, exist_ok=True)
        shutil.copy(tmp_path / "callback" / "memory.png", os.path.join(keep, f"callback-{mode}.png"))
        shutil.copy(tmp_path / "callback" / "timeline.json", os.path.join(keep, f"callback-{mode}.json"))


@pytest.mark.parametrize("mode,transport", MODES)
def test_rank0_returns_within_timeout_when_a_rank_never_reports(mode, transport, tmp_path):
    timeout = 3.0
    res = horovodrun(4, [PROG], mode=mode, timeout=240,
                     env={"DISTMEM_TEST_OUT": str(tmp_path), "MISSING_DETAIL": "full", "USE_HOROVOD": "1",
                          "DISTMEM_TIMEOUT": str(timeout), "DISTMEM_QUIET": "1"})
    res.check()
    with open(tmp_path / "missing-full.json") as f:
        out = json.load(f)
    assert out["transport"] == transport
    assert timeout * 0.9 <= out["elapsed"] < timeout + 12.0, out
    assert 3 in out["missing"] and out["kinds"][0] == "missing" and 0 in out["rows"]
    if transport == "mpi":
        assert out["missing"] == [3] and out["rows"] == [0, 1, 2]  # point-to-point: exactly the absent rank
    else:
        # A Horovod allgather completes for all ranks or for none: rank 0 cannot tell which rank is
        # absent, so every other rank is marked missing (the frozen one among them).
        assert out["missing"] == [1, 2, 3] and out["rows"] == [0]
