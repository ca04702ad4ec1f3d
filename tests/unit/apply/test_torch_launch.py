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


@pytest.mark.skipif(not have("torchrun"), reason="torchrun not installed")
def test_ddp_example_plans_the_buckets_and_trains_under_torchrun(tmp_path):
    """examples/ddp_train.py under torchrun -np 2 (DDP over Gloo, CPU): one search for the job, every
    rank's demand counting DDP's buckets (a plan without them is smaller by the rebuilt set and the
    copy), the training runs, and the check says there is no CUDA peak to hold on a CPU."""
    out = tmp_path / "ddp.json"
    exe = os.path.join(env_bin(), "torchrun") if os.path.exists(os.path.join(env_bin(), "torchrun")) else "torchrun"
    example = os.path.join(ROOT, "examples", "ddp_train.py")
    res = run([exe, "--standalone", "--nproc_per_node", "2", example, "--width", "512", "--depth", "2", "--steps", "2",
               "--check", "5", "--out", str(out)], timeout=240,
              env={"OMP_NUM_THREADS": "1", "DISTMEM_FLEET": "1x16GiB", "DISTMEM_QUIET": "1"})
    res.check()
    got = json.loads(out.read_text())
    assert got["backend"] == "gloo" and [r["rank"] for r in got["rows"]] == [0, 1]
    demands = {r["demand"] for r in got["rows"]}
    assert len(demands) == 1  # one job, one answer
    assert "no CUDA allocator peak" in res.out
    # the same search without the wrapper plans less: the buckets are in the demand
    import sys
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import ddp_train
    from distmem.plan.fit import fit

    kw = dict(global_batch_size=128, gpus="1x16GiB", input_shape=(512,), optimizer="adamw", precision="float32",
              pipelines=[1], shardings="none", micro_batches=[64], fixed_local_size=2, estimate="model")
    plain = fit(ddp_train.build(512, 2, "meta"), **kw).chosen.heaviest.allocator_bytes
    from distmem.plan.wrappers import Wrapper
    with_ddp = fit(ddp_train.build(512, 2, "meta"), wrapper=Wrapper("ddp", 2), **kw).chosen.heaviest.allocator_bytes
    assert with_ddp > plain and demands == {with_ddp}  # the example's ranks were planned with the buckets
