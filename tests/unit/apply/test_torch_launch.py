"""examples/torch_train.py on CPU under the two launchers PyTorch users have: `mpirun -np 2` (gradients
averaged with mpi4py; report gathered over MPI) and `torchrun --nproc_per_node 2` (DDP over Gloo; report
gathered through torch.distributed). Each launch has a hard timeout."""
import json
import os

import pytest

pytest.importorskip("torch")

from helpers import ROOT, env_bin, have, mpirun, run  # noqa: E402

pytestmark = pytest.mark.mpi
EXAMPLE = os.path.join(ROOT, "examples", "torch_train.py")


def _report(path, ranks, transport):
    with open(path) as f:
        rep = json.load(f)
    assert [r["rank"] for r in rep["ranks"]] == list(range(ranks)) and rep["missing"] == []
    assert {r["framework"] for r in rep["ranks"]} == {"torch"}
    assert rep["aggregates"]["transport"] == transport
    assert len({r["pid"] for r in rep["ranks"]}) == ranks
    return rep


def test_example_under_mpirun_reports_every_rank(tmp_path):
    pytest.importorskip("mpi4py")
    out = tmp_path / "report.json"
    res = mpirun(2, [EXAMPLE, "--steps", "4", "--comm", "mpi", "--report", str(out)], timeout=180,
                 env={"DISTMEM_FLEET": "2x16GiB"})
    res.check()
    rep = _report(out, 2, "mpi")
    assert [r["allocation"]["devices"][0]["index"] for r in rep["ranks"]] == [0, 1]
    assert "step 3 loss" in res.out


@pytest.mark.skipif(not have("torchrun"), reason="torchrun not installed")
def test_example_under_torchrun_gathers_through_torch_distributed(tmp_path):
    out = tmp_path / "report.json"
    exe = os.path.join(env_bin(), "torchrun") if os.path.exists(os.path.join(env_bin(), "torchrun")) else "torchrun"
    res = run([exe, "--standalone", "--nproc_per_node", "2", EXAMPLE, "--steps", "4", "--report", str(out)],
              timeout=180, env={"OMP_NUM_THREADS": "1"})
    res.check()
    _report(out, 2, "torch.distributed")


@pytest.mark.skipif(not have("torchrun"), reason="torchrun not installed")
def test_summary_through_torch_distributed_equals_the_full_aggregate(tmp_path):
    """torchrun -np 4 (Gloo): the summary's reductions (sum and max posted together, then the
    lowest holders) give the full report's aggregates, holders and warning kinds."""
    out = tmp_path / "summary.json"
    prog = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "mpi", "progs",
                        "summary_torch_dist.py")
    exe = os.path.join(env_bin(), "torchrun") if os.path.exists(os.path.join(env_bin(), "torchrun")) else "torchrun"
    res = run([exe, "--standalone", "--nproc_per_node", "4", prog, str(out)], timeout=240,
              env={"OMP_NUM_THREADS": "1", "DISTMEM_QUIET": "1"})
    res.check()
    got = json.loads(out.read_text())
    assert got["transport"] == "torch.distributed" and got["size"] == 4
    assert got["differ"] == {}, got["differ"]
    assert got["kinds"][0] == got["kinds"][1]
    assert got["min_peak_rank"] == 0 and got["above_worst_rank"] == 3
