import json

import pytest

from distmem.errors import ConfigError
from distmem.discover.identity import Topology, detect, from_env, launcher_of


def test_single_process_without_launcher():
    topo = detect({})
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (0, 1, 0, 1)
    assert topo.source in ("single", "horovod", "mpi4py")


def test_openmpi_variables():
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    topo = from_env(env, host="n")
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.host_index) == (5, 8, 1, 4, 1)
    assert launcher_of(env) == "mpirun"
    env["HOROVOD_HOSTNAME"] = "localhost"
    assert launcher_of(env) == "horovodrun-mpi"


def test_horovodrun_gloo_variables():
    env = {"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "3", "HOROVOD_LOCAL_SIZE": "4",
           "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1"}
    topo = from_env(env, host="n")
    assert (topo.rank, topo.local_rank, topo.source, topo.launcher) == (3, 3, "horovodrun", "horovodrun-gloo")


def test_mpich_slurm_torchrun():
    assert from_env({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}).local_rank == 0
    slurm = from_env({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NTASKS_PER_NODE": "4(x2)"})
    assert (slurm.rank, slurm.local_rank, slurm.local_size, slurm.source) == (6, 2, 4, "slurm")
    tr = from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "TORCHELASTIC_RUN_ID": "x"})
    assert (tr.rank, tr.source) == (1, "torchrun")
    # RANK/WORLD_SIZE alone are too generic: no launcher claimed
    assert from_env({"RANK": "1", "WORLD_SIZE": "2"}) is None


def test_tf_config_local_rank_from_shared_host():
    cfg = {"cluster": {"worker": ["hostA:1", "hostA:2", "hostB:1", "hostB:2"]}, "task": {"type": "worker", "index": 3}}
    topo = from_env({"TF_CONFIG": json.dumps(cfg)}, host="x")
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.host) == (3, 4, 1, 2, "hostB")
    chief = {"cluster": {"chief": ["h:1"], "worker": ["h:2"]}, "task": {"type": "worker", "index": 0}}
    assert from_env({"TF_CONFIG": json.dumps(chief)}).rank == 1
    with pytest.raises(ConfigError, match="TF_CONFIG is not valid JSON"):
        from_env({"TF_CONFIG": "{nope"})


def test_inconsistent_variables_are_an_error():
    with pytest.raises(ConfigError, match="rank=4 size=4"):
        from_env({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="not an integer"):
        from_env({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "4"})


def test_topology_never_imports_gpu_frameworks():
    import subprocess
    import sys

    code = ("import sys, distmem.discover.identity as t, distmem.discover.gpus as d; t.detect(); d.inventory(quiet=True); "
            "bad=[m for m in ('tensorflow','torch','jax','cupy') if m in sys.modules]; print(bad); assert not bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_node_index_and_count():
    t = Topology(rank=9, size=12, local_rank=1, local_size=4)
    assert (t.host_index, t.num_hosts) == (2, 3)


@pytest.mark.parametrize("env", [
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2000000000", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
     "OMPI_COMM_WORLD_LOCAL_SIZE": "2000000000"},
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
     "SLURM_TASKS_PER_NODE": "1(x2000000000)"},
])
def test_launcher_counts_beyond_any_job_are_a_config_error(env):
    """Issue 26, finding 14: counts are bounded before anything is built from them (a host of 2e9
    ranks made the exchange list 2e9 placeholders; 1(x2000000000) built a 2e9-element list)."""
    with pytest.raises(ConfigError):
        from_env(env, host="h")
