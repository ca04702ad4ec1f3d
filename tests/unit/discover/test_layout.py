"""The plan follows the layout the job really has (issue: observed layout), without a GPU.

Ranks are real processes here: each case starts one Python process per rank with the variables
its launcher documents, a declared fleet, and a layout folder per simulated host (the hosts of
tests/cluster are real; these cover the same rules in seconds). Every case failed on the code that
planned by ``local_rank = rank % local_size`` on identical nodes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Dict, List

import pytest

from distmem.discover.gpus import fleet_inventory, fleet_uuid, parse_fleet
from distmem.discover.identity import Topology, detect, from_env, host_name
from distmem.discover.layout import LayoutTimeoutError, RankView, Layout, exchange
from distmem.errors import ConfigError
from distmem.plan import make_plan
from distmem.units import GiB, MiB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PROBE = r"""
import json, os, sys
sys.path.insert(0, %r)
import distmem
plan = distmem.plan_from_env("data", **json.loads(os.environ.get("PROBE_OPTIONS", "{}")))
m = plan.mine
print("PROBE " + json.dumps({"rank": m.rank, "local_rank": m.local_rank, "host": m.host,
      "devices": [{"index": d.index, "uuid": d.uuid, "shared_by": d.shared_by, "enforce": d.enforce,
                   "planned": d.planned_bytes} for d in m.devices], "fingerprint": plan.fingerprint()}))
""" % ROOT


def run_ranks(envs: List[Dict[str, str]], timeout: float = 60) -> List[dict]:
    """Start one process per env (all at once), return each one's PROBE line."""
    procs = []
    for env in envs:
        full = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM", "HOROVOD_",
                                                                         "TORCHELASTIC", "DISTMEM_", "CUDA_VISIBLE"))}
        full.update(env)
        full["DISTMEM_QUIET"] = "1"
        procs.append(subprocess.Popen([sys.executable, "-c", PROBE], env=full, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        so, se = p.communicate(timeout=timeout)
        assert p.returncode == 0, se
        out.append(json.loads(next(l for l in so.splitlines() if l.startswith("PROBE "))[6:]))
    return out


def ompi(rank: int, size: int, local: int, local_size: int, job: str, folder: str, **extra: str) -> Dict[str, str]:
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
           "OMPI_COMM_WORLD_LOCAL_RANK": str(local), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
           "OMPI_MCA_ess_base_jobid": job, "DISTMEM_LAYOUT_DIR": folder, "DISTMEM_LAYOUT_TIMEOUT": "20"}
    env.update(extra)
    return env


@pytest.fixture
def job():
    return uuid.uuid4().hex


def test_map_by_node_takes_the_launchers_local_rank(tmp_path, job):
    """mpirun --map-by node on 2 hosts x 2 ranks: rank 2 is local rank 1 of host a -> GPU 1, alone."""
    hosts = {0: "a", 1: "b", 2: "a", 3: "b"}
    local = {0: 0, 1: 0, 2: 1, 3: 1}
    envs = [ompi(r, 4, local[r], 2, job, str(tmp_path / hosts[r]), DISTMEM_FLEET="2x16GiB") for r in range(4)]
    rows = {r["rank"]: r for r in run_ranks(envs)}
    assert rows[2]["local_rank"] == 1 and rows[2]["devices"][0]["index"] == 1
    assert all(r["devices"][0]["shared_by"] == 1 and not r["devices"][0]["enforce"] for r in rows.values())
    assert len({r["fingerprint"] for r in rows.values()}) == 1


def test_one_gpu_per_rank_by_cuda_visible_devices_is_private(tmp_path, job):
    """A wrapper gives each of 4 ranks its own GPU: each sees one GPU (ordinal 0), alone, growth."""
    host = host_name()
    envs = [ompi(r, 4, r, 4, job, str(tmp_path), DISTMEM_FLEET="4x16GiB", CUDA_VISIBLE_DEVICES=str(r))
            for r in range(4)]
    rows = sorted(run_ranks(envs), key=lambda r: r["rank"])
    for r in rows:
        (d,) = r["devices"]
        assert d["index"] == 0 and d["uuid"] == fleet_uuid(host, r["rank"]), r
        assert d["shared_by"] == 1 and not d["enforce"], r


def test_every_rank_told_the_same_gpu_splits_it(tmp_path, job):
    envs = [ompi(r, 4, r, 4, job, str(tmp_path), DISTMEM_FLEET="4x16GiB", CUDA_VISIBLE_DEVICES="2")
            for r in range(4)]
    rows = run_ranks(envs)
    assert {r["devices"][0]["uuid"] for r in rows} == {fleet_uuid(host_name(), 2)}
    assert all(r["devices"][0]["shared_by"] == 4 and r["devices"][0]["enforce"] for r in rows)
    want = ((16 * GiB - 256 * MiB - 4 * 768 * MiB) // 4) // MiB * MiB
    assert all(r["devices"][0]["planned"] == want for r in rows)


def test_uneven_hosts_and_different_gpus_per_host(tmp_path, job):
    """horovodrun -H a:4,b:2 with 80 GiB GPUs on a and 16 GiB on b: planned per host."""
    fleet = "a=2x80GiB;b=2x16GiB"
    ranks = [("a", 0, 4), ("a", 1, 4), ("a", 2, 4), ("a", 3, 4), ("b", 0, 2), ("b", 1, 2)]
    envs = []
    for r, (h, lr, ls) in enumerate(ranks):
        envs.append({"HOROVOD_RANK": str(r), "HOROVOD_SIZE": "6", "HOROVOD_LOCAL_RANK": str(lr),
                     "HOROVOD_LOCAL_SIZE": str(ls), "HOROVOD_HOSTNAME": h, "HOROVOD_GLOO_RENDEZVOUS_ADDR": "x",
                     "HOROVOD_GLOO_RENDEZVOUS_PORT": job, "DISTMEM_FLEET": fleet,
                     "DISTMEM_LAYOUT_DIR": str(tmp_path)})
    rows = {r["rank"]: r for r in run_ranks(envs)}
    for r in range(4):  # 4 ranks on a's 2 GPUs: two per GPU, hard limits of an 80 GiB card
        d = rows[r]["devices"][0]
        assert rows[r]["host"] == "a" and d["uuid"] == fleet_uuid("a", r % 2) and d["shared_by"] == 2
        assert d["planned"] == ((80 * GiB - 256 * MiB - 2 * 768 * MiB) // 2) // MiB * MiB
    for r in (4, 5):  # b: alone on 16 GiB cards
        d = rows[r]["devices"][0]
        assert rows[r]["host"] == "b" and d["shared_by"] == 1 and d["planned"] == 16 * GiB - 256 * MiB - 768 * MiB
    assert len({r["fingerprint"] for r in rows.values()}) == 1


def test_torchrun_inside_sbatch_wins_over_the_batch_step():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "7", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "r"}
    t = from_env(env)
    assert (t.rank, t.size, t.local_rank, t.local_size, t.source, t.host) == (3, 4, 1, 2, "torchrun", "n1")


def test_mpirun_inside_a_slurm_allocation_wins():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    t = from_env(env)
    assert (t.rank, t.local_rank, t.source) == (5, 1, "openmpi")


def test_slurm_uneven_tasks_per_node():
    env = {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
           "SLURM_TASKS_PER_NODE": "4,1", "SLURMD_NODENAME": "n2"}
    t = from_env(env)
    assert (t.local_rank, t.local_size, t.host) == (0, 1, "n2")


def test_detection_stops_at_the_first_source(monkeypatch):
    """With launcher variables present, MPI's node split (a collective) is never called."""
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"mpi4py.MPI.{name} called although the environment answered")

    monkeypatch.setitem(sys.modules, "mpi4py.MPI", Untouchable())
    t = detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (t.rank, t.size) == (1, 2)


def test_a_rank_that_never_arrives_is_named(tmp_path):
    topo = Topology(rank=0, size=2, local_rank=0, local_size=2, host="h", source="openmpi", launcher="mpirun")
    env = {"OMPI_MCA_ess_base_jobid": uuid.uuid4().hex}
    with pytest.raises(LayoutTimeoutError, match=r"local rank\(s\) 1 did not arrive") as err:
        exchange(topo, fleet_inventory("2x16GiB", "h"), timeout=0.3, directory=str(tmp_path), env=env)
    assert err.value.missing == [1] and "DISTMEM_LAYOUT_TIMEOUT" in str(err.value)


KILLED_RANK = r"""
import os, sys
sys.path.insert(0, %r)
from distmem.discover import layout
from distmem.discover.gpus import fleet_inventory
from distmem.discover.identity import Topology
topo = Topology(rank=7, size=8, local_rank=1, local_size=2, host="h", source="openmpi", launcher="mpirun")
me = layout.RankView(7, "h", 1, fleet_inventory("2x16GiB", "h").gpus, os.getpid())
key = layout.job_key({"OMPI_MCA_ess_base_jobid": "reused"})
layout._publish(sys.argv[1], key, "h", topo, 1, layout._record(topo, me, key, 1))
os._exit(0)  # killed: no exit handler runs, the record stays behind with its lock released
""" % ROOT


def test_stale_records_of_a_dead_earlier_job_are_ignored_and_swept(tmp_path):
    """A complete, well-formed record of local rank 1 under the same job key, left by a process
    that is gone (killed before its exit handler): never trusted, and swept by the next exchange."""
    subprocess.run([sys.executable, "-c", KILLED_RANK, str(tmp_path)], check=True, timeout=60)
    left = list(tmp_path.glob("distmem-layout-*/*/h/1.1.*.json"))
    assert len(left) == 1
    topo = Topology(rank=0, size=8, local_rank=0, local_size=2, host="h", source="openmpi", launcher="mpirun")
    with pytest.raises(LayoutTimeoutError, match=r"local rank\(s\) 1 did not arrive"):
        exchange(topo, fleet_inventory("2x16GiB", "h"), timeout=0.3, directory=str(tmp_path),
                 env={"OMPI_MCA_ess_base_jobid": "reused"})
    assert not left[0].exists()  # the dead rank's record went in the sweep before this rank wrote


def test_exchange_cost_is_small_and_the_decision_identical(tmp_path):
    """Two real processes meet; their layouts are identical (the timing figure is in bench/comm/layout_exchange.py)."""
    job = uuid.uuid4().hex
    envs = [ompi(r, 2, r, 2, job, str(tmp_path), DISTMEM_FLEET="1x16GiB") for r in range(2)]
    rows = run_ranks(envs)
    assert all(r["devices"][0]["shared_by"] == 2 for r in rows)


@pytest.mark.parametrize("limit, frac", [("0.5", 0.5), (0.5, 0.5), ("0.25", 0.25)])
def test_a_number_as_text_means_that_number(limit, frac):
    inv = fleet_inventory("1x16GiB")
    plan = make_plan("data", Topology(), inv, limit=limit)
    assert plan.mine.limit_bytes == int(16 * GiB * frac) // MiB * MiB


@pytest.mark.parametrize("limit", [1, 8, "8", 1024, "0"])
def test_a_limit_under_one_mib_is_an_error(limit):
    with pytest.raises(ConfigError, match="under 1 MiB|integer limit is bytes|fraction"):
        make_plan("data", Topology(), fleet_inventory("1x16GiB"), limit=limit)


def test_declared_fleet_per_host_and_uuid():
    assert parse_fleet("a=2x80GiB;b=1x16GiB", "b") == [16 * GiB]
    assert parse_fleet("a=2x80GiB;*=4x16GiB", "zz") == [16 * GiB] * 4
    with pytest.raises(ConfigError, match="not for this host 'c'"):
        parse_fleet("a=2x80GiB;b=1x16GiB", "c")
    inv = fleet_inventory("4x16GiB", "h", visible=fleet_uuid("h", 3)[:12])
    assert [(g.index, g.nvml_index, g.uuid) for g in inv.gpus] == [(0, 3, fleet_uuid("h", 3))]


def test_placement_among_ranks_that_see_the_same_set():
    """Two ranks see {0,1}, one sees only {1}: the first two take 0 and 1 by position, and GPU 1 is shared."""
    inv = fleet_inventory("2x16GiB", "h")
    both, one = inv.gpus, [g for g in fleet_inventory("2x16GiB", "h", "1").gpus]
    lay = Layout(3, [RankView(0, "h", 0, both), RankView(1, "h", 1, both), RankView(2, "h", 2, one)], "exchange")
    plan = make_plan("data", Topology(rank=0, size=3, local_rank=0, local_size=3, host="h"), inv, layout=lay)
    shares = {a.rank: (a.devices[0].uuid, a.devices[0].shared_by) for a in plan.allocations}
    assert shares[0] == (fleet_uuid("h", 0), 1)
    assert shares[1] == (fleet_uuid("h", 1), 2) and shares[2] == (fleet_uuid("h", 1), 2)


def test_doctor_names_a_rank_on_a_gpu_its_plan_did_not_give_it(tmp_path):
    """A live rank of a job (known from its layout record) that NVML shows on another GPU."""
    from distmem.cli.doctor import stray_contexts
    from distmem.discover import layout
    from distmem.discover.gpus import GpuProcess
    from distmem.discover.identity import job_key

    inv = fleet_inventory("2x16GiB", "h")
    topo = Topology(rank=1, size=2, local_rank=1, local_size=2, host="h", source="openmpi", launcher="mpirun")
    key = job_key({"OMPI_MCA_ess_base_jobid": "j"})
    me = RankView(1, "h", 1, inv.gpus, pid=os.getpid())  # local rank 1: planned on GPU 1
    try:
        layout._publish(str(tmp_path), key, "h", topo, 1, layout._record(topo, me, key, 1))
        inv.gpus[0].processes = [GpuProcess(os.getpid(), 300 * MiB)]  # ... but it holds memory on GPU 0
        (found,) = stray_contexts(inv, "h", str(tmp_path))
        assert (found["rank"], found["pid"], found["gpu"], found["bytes"]) == (1, os.getpid(), fleet_uuid("h", 0),
                                                                              300 * MiB)
        assert found["planned_gpu"] == fleet_uuid("h", 1)
        inv.gpus[0].processes = []
        inv.gpus[1].processes = [GpuProcess(os.getpid(), 300 * MiB)]
        assert stray_contexts(inv, "h", str(tmp_path)) == []
    finally:
        layout._leave()
    assert not any(tmp_path.iterdir())  # the record and every folder removed
