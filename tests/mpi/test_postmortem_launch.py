"""A job of 4 ranks on the fake CUDA backend where one rank runs out of memory, launched by mpirun
and horovodrun: every rank has init()'s hooks, the failing one writes its record, and
`distmem postmortem RUN_DIR` names it, the step, the cause and by how much: the failing rank keeps
1 GiB more each step (nothing it allocates is freed), so memory grows from step to step until the
step needs more than its plan."""
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, have, horovodrun, mpirun

PROG = os.path.join(ROOT, "tests", "mpi", "progs", "oom_rank.py")
# The other ranks run to the end (they check that only the failing rank writes a record): fail fast,
# which would stop them within a second, has its own tests (tests/faults/test_fail_fast.py).
ALONE = {"DISTMEM_FAIL_FAST": "0"}


def postmortem(run_dir):
    out = subprocess.run([sys.executable, "-m", "distmem.cli", "postmortem", str(run_dir), "--json"], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def check(res, run_dir, oom_rank):
    assert not res.timed_out, res.out[-4000:]
    assert res.rc != 0  # the rank's OOM was not caught: the job fails
    assert res.out.count("finished") == 3, res.out[-4000:]
    assert "CUDA out of memory" in res.out
    page = postmortem(run_dir)
    assert page["ranks_out"] == [oom_rank], page
    e = page["entries"][0]
    assert e["step"] == 4 and e["source"] == "torch-allocator" and "Tried to allocate" in e["error"]
    assert [c["kind"] for c in e["causes"]] == ["growth", "over_plan"]
    assert e["causes"][0]["change"]["change"] == "release_kept"
    assert e["causes"][1]["over_by_bytes"] == 4 * 1024**3 - e["limit_bytes"]


@pytest.mark.parametrize("oom_rank", [2])
def test_mpirun_one_rank_out_of_memory(tmp_path, oom_rank):
    pytest.importorskip("mpi4py")
    run_dir = tmp_path / "run"
    res = mpirun(4, [PROG], timeout=240, env={"OOM_RANK": str(oom_rank), "DISTMEM_RUN_DIR": str(run_dir),
                                                "DISTMEM_FLEET": "", **ALONE})
    check(res, run_dir, oom_rank)


def test_no_record_when_turned_off(tmp_path):
    pytest.importorskip("mpi4py")
    run_dir = tmp_path / "run"
    res = mpirun(4, [PROG], timeout=240, env={"OOM_RANK": "1", "DISTMEM_RUN_DIR": str(run_dir),
                                                "DISTMEM_POSTMORTEM": "0", **ALONE})
    assert not res.timed_out and res.rc != 0 and "CUDA out of memory" in res.out
    assert not (run_dir / "oom").exists()


def test_horovodrun_one_rank_out_of_memory(tmp_path):
    if not have("horovodrun"):
        pytest.skip("horovodrun is not installed here")
    run_dir = tmp_path / "run"
    res = horovodrun(4, [PROG], env={"OOM_RANK": "1", "DISTMEM_RUN_DIR": str(run_dir), **ALONE}, timeout=300)
    check(res, run_dir, 1)
