"""Two launches never meet in one layout folder (issue 26, finding 3).

``torchrun --master-addr/--master-port`` sets ``TORCHELASTIC_RUN_ID=none`` and the same address on
every launch, so the launcher's ids alone gave two runs 20 s apart one job key: on aa55a88 the
second run trusted the first run's records (for 300 s) and planned a GPU as shared that it had
alone. The ranks now draw a nonce through torchrun's own store, and a dead run's records are
neither trusted nor left behind.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
torch_dist = pytest.importorskip("torch.distributed")

PROG = r"""
import json, os, sys, time
sys.path.insert(0, %r)
if os.environ.get("PER_RANK_GPU") == "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["LOCAL_RANK"]  # a wrapper giving each rank its own GPU
time.sleep(float(os.environ.get("DELAY_%%s" %% os.environ["LOCAL_RANK"], "0")))
import distmem
plan = distmem.plan_from_env("data")
d = plan.mine.devices[0]
print("RESULT " + json.dumps({"rank": plan.mine.rank, "uuid": d.uuid, "shared_by": d.shared_by}), flush=True)
time.sleep(float(os.environ.get("HOLD", "0")))
""" % ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM", "HOROVOD_", "TORCHELASTIC",
                                                                     "DISTMEM_", "CUDA_VISIBLE", "XDG_"))}
    env.update(PYTHONPATH=ROOT, DISTMEM_QUIET="1", DISTMEM_LAYOUT_TIMEOUT="30", **extra)
    return env


def rows_of(out: str) -> dict:
    rows = {}
    for m in re.finditer(r"RESULT (\{[^{}]*\})", out):  # two workers' lines may share one line of the pipe
        got = json.loads(m.group(1))
        rows[got["rank"]] = got
    return rows


def torchrun(port: int, folder: str, **extra: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(port), "--no-python", sys.executable, "-c", PROG]
    res = subprocess.run(cmd, env=clean_env(DISTMEM_LAYOUT_DIR=folder, **extra), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return rows_of(res.stdout)


def test_two_torchrun_launches_on_one_master_port_do_not_share_records(tmp_path):
    """The finding's runs: the first launch's two ranks share GPU 0; the second, on the same
    --master-port, gives each rank its own GPU and starts local rank 1 late. Its rank 0 is alone
    on GPU 0 (aa55a88: shared_by 2, from the first launch's record of local rank 1)."""
    port = free_port()
    first = torchrun(port, str(tmp_path), DISTMEM_FLEET="1x16GiB")
    assert [first[r]["shared_by"] for r in (0, 1)] == [2, 2]
    second = torchrun(port, str(tmp_path), DISTMEM_FLEET="2x16GiB", PER_RANK_GPU="1", DELAY_1="3")
    assert [second[r]["shared_by"] for r in (0, 1)] == [1, 1], second
    assert second[0]["uuid"] != second[1]["uuid"]
    assert not any(tmp_path.iterdir())  # both launches removed their records


def agent_env(port: int, local_rank: int, restart: int = 0, **extra: str) -> dict:
    """What torchrun's agent gives a worker (static rendezvous, --master-addr/--master-port)."""
    return clean_env(RANK=str(local_rank), WORLD_SIZE="2", LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE="2",
                     GROUP_RANK="0", TORCHELASTIC_RUN_ID="none", TORCHELASTIC_RESTART_COUNT=str(restart),
                     TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)


def test_a_live_earlier_launch_with_the_same_ids_is_never_met(tmp_path):
    """An earlier launch whose ranks are still alive (an agent killed with SIGKILL leaves its
    workers running) and a new one on the same port and run id: the launcher's variables are
    identical, the agents' stores are not, and the new ranks meet only each other."""
    port = free_port()
    store = torch_dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=30))
    old = [subprocess.Popen([sys.executable, "-c", PROG], env=agent_env(port, lr, DISTMEM_LAYOUT_DIR=str(tmp_path),
                                                                         DISTMEM_FLEET="1x16GiB", HOLD="120"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for lr in (0, 1)]
    try:
        for p in old:  # both planned and still running, their records held
            line = p.stdout.readline()
            assert '"shared_by": 2' in line, line + p.stderr.read()[-3000:] if p.poll() is not None else line
        del store  # the old agent is gone; a new launch's agent serves a new store on the same port
        store = torch_dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=30))
        new = [subprocess.Popen([sys.executable, "-c", PROG],
                                env=agent_env(port, lr, DISTMEM_LAYOUT_DIR=str(tmp_path), DISTMEM_FLEET="2x16GiB",
                                              PER_RANK_GPU="1", DELAY_1="2"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for lr in (0, 1)]
        rows = {}
        for p in new:
            so, se = p.communicate(timeout=120)
            assert p.returncode == 0, se[-3000:]
            rows.update(rows_of(so))
        assert [rows[r]["shared_by"] for r in (0, 1)] == [1, 1], rows
    finally:
        for p in old:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
        del store


def test_the_nonce_is_one_per_launch_and_restart():
    from distmem.discover.identity import job_key, launch_nonce

    port = free_port()
    store = torch_dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=30))
    a0, a1 = launch_nonce(agent_env(port, 0)), launch_nonce(agent_env(port, 1))
    restarted = launch_nonce(agent_env(port, 0, restart=1))
    del store
    time.sleep(0.2)
    store = torch_dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=30))
    b0 = launch_nonce(agent_env(port, 0))
    del store
    assert a0 and a0 == a1 and len(a0) == 32
    assert len({a0, restarted, b0}) == 3
    env = agent_env(port, 0)
    assert job_key(env, a0) == job_key(agent_env(port, 1), a1) != job_key(env, b0)
    assert launch_nonce({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}) == ""  # ids per launch there
