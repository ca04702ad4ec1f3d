"""Real launchers across the simulated hosts: every rank's host, local rank, GPU UUID and share.

Each case starts the probe (progs/probe.py) under one launcher with declared GPUs per host, and
compares every rank's plan with what that launcher documents (expect.py computes it from the
documented mapping) and checks that rank 0's report lists every host. One failure message lists
every rank that differs, the expected/probed table and the launcher's output.
"""
from __future__ import annotations

import os

import pytest

from expect import (map_node, map_slot, parse_fleet_spec, expected, slurm_block, slurm_cyclic,
                    torchrun_hosts)
from launches import ONE_GPU_PER_TASK, VISIBLE_BY_UUID, job_dir, need_tool, probe_argv, probe_rows, verdict

pytestmark = pytest.mark.cluster

FLEET = "2x16GiB"
#: Hosts that differ: 80 GiB GPUs on hosta, 16 GiB ones elsewhere.
MIXED = "hosta=2x80GiB;hostb=2x16GiB;*=2x16GiB"


def _check(cluster, results, want, job, env):
    problems = verdict(cluster, results, want, job, env)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.mark.parametrize("map_by", ["slot", "node"])
def test_mpirun_two_hosts(cluster, map_by):
    """`mpirun --host hosta:2,hostb:2 --map-by slot|node`: Open MPI's local rank picks the GPU."""
    hosts = "hosta:2,hostb:2"
    env = {"DISTMEM_FLEET": FLEET}
    job = job_dir(cluster, f"mpirun-{map_by}")
    r = cluster.mpirun(hosts, probe_argv(cluster, "mpi", job), map_by=map_by, env=env, timeout=90)
    ranks = (map_slot if map_by == "slot" else map_node)(hosts)
    _check(cluster, r, expected(ranks, parse_fleet_spec(FLEET, cluster.names)), job, env)


def test_mpirun_every_rank_told_gpu0(cluster):
    """CUDA_VISIBLE_DEVICES=0 on every rank: the two ranks of each host split GPU 0 (hard limits)."""
    hosts = "hosta:2,hostb:2"
    env = {"DISTMEM_FLEET": FLEET, "CUDA_VISIBLE_DEVICES": "0"}
    job = job_dir(cluster, "mpirun-gpu0")
    r = cluster.mpirun(hosts, probe_argv(cluster, "mpi", job), env=env, timeout=90)
    want = expected(map_slot(hosts), parse_fleet_spec(FLEET, cluster.names), visible=lambda r, h, l: [0])
    assert all(w.shared_by == 2 and w.enforce for w in want)
    _check(cluster, r, want, job, env)


@pytest.mark.parametrize("chars", [None, 12], ids=["full-uuid", "uuid-prefix"])
def test_mpirun_gpu_by_uuid(cluster, chars):
    """Each rank's CUDA_VISIBLE_DEVICES names its own GPU by UUID (or a unique prefix of it): alone on it."""
    hosts = "hosta:2,hostb:2"
    env = {"DISTMEM_FLEET": FLEET}
    job = job_dir(cluster, f"mpirun-uuid-{chars}")
    wrap = [os.path.join(cluster.bin, "python"), VISIBLE_BY_UUID] + (["--chars", str(chars)] if chars else [])
    r = cluster.mpirun(hosts, wrap + probe_argv(cluster, "mpi", job), env=env, timeout=90)
    want = expected(map_slot(hosts), parse_fleet_spec(FLEET, cluster.names), visible=lambda r, h, l: [l])
    assert all(w.shared_by == 1 and w.index == 0 for w in want)
    _check(cluster, r, want, job, env)


@pytest.mark.horovod
@pytest.mark.parametrize("mode", ["gloo", "mpi"])
def test_horovodrun_two_hosts(cluster, mode):
    """`horovodrun -H hosta:2,hostb:2 --gloo|--mpi`: ranks fill hosts in -H order."""
    need_tool(cluster, "horovodrun")
    hosts = "hosta:2,hostb:2"
    env = {"DISTMEM_FLEET": FLEET}
    job = job_dir(cluster, f"horovodrun-{mode}")
    transport = "horovod" if mode == "gloo" else "mpi"
    r = cluster.horovodrun(hosts, probe_argv(cluster, transport, job), mode=mode, env=env, timeout=150)
    _check(cluster, r, expected(map_slot(hosts), parse_fleet_spec(FLEET, cluster.names)), job, env)


@pytest.mark.horovod
@pytest.mark.parametrize("fleet", [FLEET, MIXED], ids=["same-gpus", "80GiB-and-16GiB"])
def test_horovodrun_uneven_hosts(cluster, fleet):
    """`horovodrun -H hosta:4,hostb:2`: 2 ranks per GPU on hosta, 1 per GPU on hostb; with the mixed
    fleet (80 GiB GPUs on hosta, 16 GiB on hostb) each host is planned with its own GPUs."""
    need_tool(cluster, "horovodrun")
    hosts = "hosta:4,hostb:2"
    env = {"DISTMEM_FLEET": fleet}
    job = job_dir(cluster, f"horovodrun-uneven-{fleet.count('=')}")
    r = cluster.horovodrun(hosts, probe_argv(cluster, "mpi", job), mode="mpi", env=env, timeout=150)
    want = expected(map_slot(hosts), parse_fleet_spec(fleet, cluster.names))
    assert [w.shared_by for w in want] == [2, 2, 2, 2, 1, 1]
    _check(cluster, r, want, job, env)


def test_torchrun_two_hosts(cluster):
    """One torchrun agent on hosta and one on hostb, c10d rendezvous at hosta's dm0 address."""
    need_tool(cluster, "torchrun")
    env = {"DISTMEM_FLEET": FLEET}
    job = job_dir(cluster, "torchrun")
    results = cluster.torchrun(["hosta", "hostb"], 2, probe_argv(cluster, "torch-env", job), env=env,
                               timeout=150)
    # The rendezvous decides which agent is group 0; the ranks say which host got which group.
    groups = {}
    for row in probe_rows(results, job):
        g = row.get("env", {}).get("GROUP_RANK")
        if g is not None:
            groups.setdefault(int(g), row["hostname"])
    if sorted(groups) != [0, 1] or sorted(groups.values()) != ["hosta", "hostb"]:
        pytest.fail(f"torchrun groups {groups}: expected groups 0 and 1 on hosta and hostb\n"
                    + "\n".join(r.describe(6000) for r in results), pytrace=False)
    want = expected(torchrun_hosts(groups, 2), parse_fleet_spec(FLEET, cluster.names))
    _check(cluster, results, want, job, env)


@pytest.mark.slurm
@pytest.mark.parametrize("distribution,per_task", [("block", True), ("cyclic", True)],
                         ids=["block-one-gpu-per-task", "cyclic-one-gpu-per-task"])
def test_srun_two_nodes(slurm, distribution, per_task):
    """`srun -N2 -n4 --ntasks-per-node=2 --distribution=block|cyclic`, every task seeing both GPUs or,
    through a wrapper exporting CUDA_VISIBLE_DEVICES=$SLURM_LOCALID, only its own (then alone on it:
    growth, not half)."""
    env = {"DISTMEM_FLEET": FLEET}
    job = job_dir(slurm, f"srun-{distribution}-{int(per_task)}")
    nodes = ["hosta", "hostb"]
    argv = ([ONE_GPU_PER_TASK] if per_task else []) + probe_argv(slurm, "torch-slurm", job)
    r = slurm.srun(["-N2", "-n4", "--ntasks-per-node=2", f"--distribution={distribution}", "-w", ",".join(nodes)],
                   argv, env=env, timeout=120)
    ranks = (slurm_block if distribution == "block" else slurm_cyclic)(nodes, 2)
    want = expected(ranks, parse_fleet_spec(FLEET, slurm.names), visible=(lambda r, h, l: [l]) if per_task else None)
    if per_task:
        assert all(w.shared_by == 1 and not w.enforce for w in want)
    _check(slurm, r, want, job, env)


@pytest.mark.slurm
def test_srun_distmem_exec(slurm):
    """`srun -N2 -n4 --ntasks-per-node=2 distmem-exec -- python probe.py` (issue 35): distmem-exec is the
    task srun starts and watches until it execs the probe; every task runs under the cap from the same
    plan (init(enforce="native") refuses any other) and lands where srun's block mapping puts it."""
    exe = need_tool(slurm, "distmem-exec")
    lib = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "distmem",
                       "_native", "libdistmem_cap.so")
    if not os.path.exists(lib):
        pytest.fail(f"{lib} is not built: make test builds it (scripts/build_native.sh)", pytrace=False)
    env = {"DISTMEM_FLEET": FLEET, "DISTMEM_CAP_LIB": lib}
    job = job_dir(slurm, "srun-distmem-exec")
    nodes = ["hosta", "hostb"]
    argv = [exe, "-o", "framework=none", "--"] + probe_argv(slurm, "torch-slurm", job) + ["--enforce", "native"]
    r = slurm.srun(["-N2", "-n4", "--ntasks-per-node=2", "--distribution=block", "-w", ",".join(nodes)], argv,
                   env=env, timeout=150)
    want = expected(slurm_block(nodes, 2), parse_fleet_spec(FLEET, slurm.names))
    _check(slurm, r, want, job, env)
    rows = probe_rows(r, job)
    wrong = [row for row in rows if not row.get("cap") or row.get("cap") != row.get("limit")]
    if wrong or len(rows) != 4:
        pytest.fail(f"every task must run under its plan's cap: {rows}\n{r.describe(6000)}", pytrace=False)


@pytest.mark.slurm
def test_torchrun_inside_sbatch(slurm):
    """`torchrun --standalone --nproc-per-node=4` in an sbatch script on hostc: the batch step's SLURM_*
    variables are inherited, torchrun's RANK/LOCAL_RANK must win (4 ranks, 2 per GPU)."""
    need_tool(slurm, "torchrun")
    env = {"DISTMEM_FLEET": FLEET}
    job = job_dir(slurm, "sbatch-torchrun")
    argv = " ".join(probe_argv(slurm, "torch-env", job))
    script = (f"#!/bin/bash\nset -e\necho batch step: SLURM_PROCID=$SLURM_PROCID SLURM_NTASKS=$SLURM_NTASKS "
              f"SLURM_LOCALID=$SLURM_LOCALID on $(hostname)\n"
              f"exec timeout 100 {slurm.bin}/torchrun --standalone --nproc-per-node=4 --max-restarts=0 --no-python "
              f"{argv}\n")
    r = slurm.sbatch(script, ["-N1", "-n1", "--cpus-per-task=4", "-w", "hostc"], env=env, timeout=150)
    want = expected(["hostc"] * 4, parse_fleet_spec(FLEET, slurm.names))
    _check(slurm, r, want, job, env)


@pytest.mark.slurm
def test_torchrun_under_srun(slurm):
    """`srun -N2 --ntasks-per-node=1 torchrun --nnodes=2 --nproc-per-node=2`: every worker inherits the step's
    SLURM_PROCID (0 or 1) and SLURM_NTASKS=2; torchrun, the inner launcher, must win."""
    need_tool(slurm, "torchrun")
    env = {"DISTMEM_FLEET": FLEET}
    job = job_dir(slurm, "srun-torchrun")
    port = slurm.next_port()
    agent = (f"exec {slurm.bin}/torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d "
             f"--rdzv-endpoint={slurm.login.addr}:{port} --rdzv-id=srun$SLURM_JOB_ID --max-restarts=0 "
             f"--local-addr=$(hostname) --no-python " + " ".join(probe_argv(slurm, "torch-env", job)))
    r = slurm.srun(["-N2", "--ntasks-per-node=1", "-w", "hosta,hostb"], ["bash", "-c", agent], env=env, timeout=150)
    groups = {}
    for row in probe_rows(r, job):
        g = row.get("env", {}).get("GROUP_RANK")
        if g is not None:
            groups.setdefault(int(g), row["hostname"])
    if sorted(groups) != [0, 1] or sorted(groups.values()) != ["hosta", "hostb"]:
        pytest.fail(f"torchrun groups {groups}: expected groups 0 and 1 on hosta and hostb\n" + r.describe(8000),
                    pytrace=False)
    want = expected(torchrun_hosts(groups, 2), parse_fleet_spec(FLEET, slurm.names))
    _check(slurm, r, want, job, env)


@pytest.mark.slurm
def test_mpirun_inside_sbatch(slurm):
    """`mpirun --map-by node` in an sbatch job on hosta and hostb: Open MPI starts its daemons through
    SLURM, the ranks also see the allocation's SLURM_* variables; mpirun, the inner launcher, must win."""
    env = {"DISTMEM_FLEET": FLEET}
    job = job_dir(slurm, "sbatch-mpirun")
    argv = " ".join(probe_argv(slurm, "mpi", job))
    script = (f"#!/bin/bash\nset -e\nexec timeout 100 mpirun -np 4 --map-by node --oversubscribe --bind-to none "
              f"--mca btl self,vader,tcp --mca btl_tcp_if_include dm0 --mca oob_tcp_if_include dm0 "
              f"--mca btl_vader_single_copy_mechanism none -x DISTMEM_FLEET -x PATH {argv}\n")
    r = slurm.sbatch(script, ["-N2", "--ntasks-per-node=2", "-w", "hosta,hostb"], env=env, timeout=150)
    want = expected(map_node("hosta:2,hostb:2"), parse_fleet_spec(FLEET, slurm.names))
    _check(slurm, r, want, job, env)


@pytest.mark.slurm
def test_srun_an_exception_on_one_task_stops_the_others_within_5s(slurm):
    """Issue 35: fail fast on an uncaught exception under srun, across two hosts: task 2 (on hostb)
    raises MemoryError; every other task - on both hosts - is out within 5 s with one line naming
    rank 2 and its exception. ``--kill-on-bad-exit=0``: srun must not end the step itself (as a
    task lost with its node would not)."""
    import time

    job = job_dir(slurm, "srun-fail-fast")
    prog = os.path.join(os.path.dirname(os.path.abspath(__file__)), "progs", "fail_fast.py")
    env = {"FF_DIR": job, "FF_VICTIM": "2", "FF_AT": "1.0", "DISTMEM_TIMEOUT": "30"}
    r = slurm.srun(["-N2", "-n4", "--ntasks-per-node=2", "-w", "hosta,hostb", "--kill-on-bad-exit=0"],
                   [os.path.join(slurm.bin, "python"), prog], env=env, timeout=90)
    assert not r.timed_out, r.describe()
    with open(os.path.join(job, "fault")) as f:
        fault = float(f.read())
    problems = []
    for rank in (0, 1, 3):
        ended = os.path.getmtime(os.path.join(job, f"alive-{rank}"))
        with open(os.path.join(job, f"stderr-{rank}.txt")) as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith("distmem: rank 2 ")]
        if ended - fault > 5.0 or not any("failed (MemoryError: out of memory at step" in ln for ln in lines):
            problems.append(f"rank {rank}: out {ended - fault:.1f} s after the fault, lines {lines}")
    assert not problems, "\n".join(problems) + "\n" + r.describe()
