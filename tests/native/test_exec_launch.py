"""distmem-exec under the launchers (issue 35): ``mpirun -np 2``, ``horovodrun -np 4`` (Gloo and MPI)
and ``torchrun --nproc-per-node 2 --no-python`` start ``distmem-exec -- python exec_rank.py``; every rank
must come up under its own cap from the plan (``init(enforce="native")`` checks it), be denied past
it, and gather over the launcher's transport. (srun: tests/cluster, ``exec-srun``.)

distmem-exec is the rank's own process until it execs the command: the launcher watches its pid. It
used to start MPI there (the plan's job agreement), so mpirun and horovodrun --mpi saw a process that
called MPI_Init exit without MPI_Finalize, and its layout record stayed live under the command's pid
while the commands exchanged theirs ("two live processes claiming local rank(s)").

On this CPU machine a declared fleet stands in for the GPU and the fake driver (libcuda.so.1 on
LD_LIBRARY_PATH) for CUDA; the launchers, MPI, Horovod, torch.distributed and the library are real.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import env_bin, run
from native_helpers import GiB, ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
RANK = os.path.join(HERE, "exec_rank.py")


def _exec_cmd():
    exe = os.path.join(env_bin(), "distmem-exec")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "distmem.cli.exec"]


def _env(built, tmp_path):
    return {"LD_LIBRARY_PATH": built.fake_dir, "DISTMEM_CAP_LIB": built.lib, "DISTMEM_FLEET": "1x16GiB",
            "FAKE_CUDA_TOTAL": str(32 * GiB), "DISTMEM_LAYOUT_DIR": str(tmp_path), "DISTMEM_QUIET": "1"}


def _launcher(name):
    tool = os.path.join(env_bin(), name)
    if not os.path.exists(tool):
        pytest.skip(f"{name} is not in this environment ({env_bin()}; the main environment has it)")
    return tool


def _check(res, np, tmp_path):
    assert not res.timed_out, f"the launch hung ({res.seconds:.0f} s)\n{res.out[-6000:]}"
    assert res.rc == 0, f"exit {res.rc}\n{res.out[-8000:]}"
    line = next((ln for ln in res.out.splitlines() if "EXEC_RANKS " in ln), None)
    assert line, f"rank 0 printed no rows\n{res.out[-6000:]}"
    rows = json.JSONDecoder().raw_decode(line.split("EXEC_RANKS ", 1)[1])[0]  # another rank's output may follow
    assert sorted(r["rank"] for r in rows) == list(range(np)), rows
    for r in rows:
        assert r["cap"] and r["cap"] == r["limit"], f"rank {r['rank']}: cap {r['cap']}, plan {r['limit']}"
        assert r["plan"] and f"rank {r['rank']}, GPU 0" in r["origin"], r
        assert r["allocs"] == [0, 2], f"rank {r['rank']}: its cap granted, 1 MiB more denied: {r['allocs']}"
    # Every wrapper left the layout exchange before its exec, and every command at its exit.
    left = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert not left, f"layout records left behind: {left}"
    return rows


def test_mpirun(built, tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun (Open MPI) is not installed; make env installs it")
    env = _env(built, tmp_path)
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", "-x", "PYTHONPATH"]
    for k in env:
        cmd += ["-x", k]
    _check(run(cmd + _exec_cmd() + ["-o", "framework=none", "--", sys.executable, RANK, "mpi"], 120, env), 2,
           tmp_path)


@pytest.mark.horovod
@pytest.mark.parametrize("mode", ["gloo", "mpi"])
def test_horovodrun(built, tmp_path, mode):
    cmd = [_launcher("horovodrun"), "-np", "4", "-H", "localhost:4", f"--{mode}"]
    _check(run(cmd + _exec_cmd() + ["-o", "framework=none", "--", sys.executable, RANK, "horovod"], 300,
               _env(built, tmp_path)), 4, tmp_path)


def test_torchrun(built, tmp_path):
    cmd = [_launcher("torchrun"), "--nproc-per-node", "2", "--no-python"]
    _check(run(cmd + _exec_cmd() + ["-o", "framework=none", "--", sys.executable, RANK, "torch"], 180,
               _env(built, tmp_path)), 2, tmp_path)


# ---- why: the wrapper's exchange and the command's ---------------------------------------------------

_WRAPPER = ("import sys; from distmem.cli.exec import plan_for_exec; "
            "p = plan_for_exec({'strategy': 'data', 'framework': 'none'}); print('READY', flush=True); "
            "sys.stdin.readline()")
_COMMAND = ("import json, os, distmem; p = distmem.plan_from_env('data', framework='none'); "
            "print('VIEWS ' + json.dumps([[v.local_rank, v.pid] for v in distmem.session.state.layout.views]))")


def test_commands_never_meet_a_wrapper_still_alive(tmp_path):
    """The window every launch has: one rank's wrapper has exchanged and not yet exec'd (it checks the
    command and confirms the library loads) while another rank's command exchanges already. Here the
    wrappers are held there; the commands must meet each other, never a wrapper's record."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DISTMEM_", "OMPI_", "HOROVOD_"))}
    base.update(PYTHONPATH=ROOT, DISTMEM_FLEET="1x16GiB", DISTMEM_LAYOUT_DIR=str(tmp_path), DISTMEM_QUIET="1",
                DISTMEM_LAYOUT_TIMEOUT="20", HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1",
                HOROVOD_GLOO_RENDEZVOUS_PORT=str(40000 + os.getpid() % 20000), HOROVOD_SIZE="2",
                HOROVOD_LOCAL_SIZE="2", HOROVOD_HOSTNAME="localhost")

    def start(code, rank):
        env = dict(base, HOROVOD_RANK=str(rank), HOROVOD_LOCAL_RANK=str(rank))
        return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    wrappers = [start(_WRAPPER, r) for r in range(2)]
    try:
        for w in wrappers:
            assert w.stdout.readline().strip() == "READY", w.communicate(timeout=30)
        commands = [start(_COMMAND, r) for r in range(2)]
        outs = [c.communicate(timeout=60) for c in commands]
    finally:
        for w in wrappers:
            if w.poll() is None:
                w.communicate("go\n", timeout=60)
    for c, (out, err) in zip(commands, outs):
        assert c.returncode == 0, f"a command's plan failed:\n{err[-3000:]}"
        views = json.loads(next(ln for ln in out.splitlines() if ln.startswith("VIEWS "))[6:])
        assert sorted(pid for _, pid in views) == sorted(x.pid for x in commands), (
            f"a command met {views}; the commands are {[x.pid for x in commands]}, the wrappers "
            f"{[w.pid for w in wrappers]}")
