"""``torchrun --nproc_per_node 2 examples/ddp_train.py`` on a machine without a GPU and without
DISTMEM_FLEET (issue 35): it ended in torchrun's ChildFailedError traceback (strategy="auto" had no
GPUs to hold layouts against). It plans against a declared fleet there (a dry run, said in the
plan's lines), trains over Gloo on the CPU and exits 0."""
import os

import pytest

from helpers import ROOT, env_bin, have, run

pytest.importorskip("torch")


@pytest.mark.skipif(not have("torchrun"), reason="torchrun not installed")
def test_ddp_example_runs_on_a_cpu_machine_as_the_readme_launches_it():
    exe = os.path.join(env_bin(), "torchrun") if os.path.exists(os.path.join(env_bin(), "torchrun")) else "torchrun"
    env = {k: v for k, v in os.environ.items() if k != "DISTMEM_FLEET"}
    env.update(OMP_NUM_THREADS="1")
    saved, os.environ = os.environ, env  # helpers.run starts from os.environ: no DISTMEM_FLEET in it
    try:
        res = run([exe, "--nproc_per_node", "2", os.path.join(ROOT, "examples", "ddp_train.py"), "--width", "256",
                   "--depth", "2", "--steps", "2"], timeout=300)
    finally:
        os.environ = saved
    res.check()
    assert "Traceback" not in res.out and "ChildFailedError" not in res.out
    from distmem.discover.gpus import inventory

    if not inventory(quiet=True).gpus:  # the machine the finding was made on: planned, not applied
        assert "dry run, nothing applied" in res.out and "no CUDA allocator peak" in res.out
