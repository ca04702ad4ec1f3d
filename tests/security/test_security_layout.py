"""The layout exchange between two real users (issue 26, findings 1, 2 and 4): the victim's ranks
plan through the default node-local folder (``/dev/shm``), the attacker is another local user.

Each test failed on the code before the private folder (aa55a88): the victim's 0600 file was
overwritten through a planted link (1), a forged record halved its plan and a malformed one crashed
the rank (2), and its records were readable by the attacker and left behind after the job (4).
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import time
import uuid

import pytest

from crossuser import ROOT, wait_for

from distmem.discover.gpus import fleet_inventory
from distmem.discover.identity import job_key

SHM = "/dev/shm"

RANK = r"""
import json, os, sys, time
print("PID %d" % os.getpid(), flush=True)
go = os.environ.get("GO_FILE")
while go and not os.path.exists(go):
    time.sleep(0.02)
time.sleep(float(os.environ.get("RANK_DELAY", "0")))
import distmem
try:
    plan = distmem.plan_from_env("data")
    d = plan.mine.devices[0]
    out = {"shared_by": d.shared_by, "planned": d.planned_bytes}
except Exception as exc:
    out = {"error": type(exc).__name__, "message": str(exc)}
print("RESULT " + json.dumps(out), flush=True)
"""


def rank_env(rank: int, job: str, **extra: str) -> dict:
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": job, "DISTMEM_FLEET": "1x16GiB",
           "DISTMEM_LAYOUT_TIMEOUT": "10"}
    env.update(extra)
    return env


def result(proc) -> dict:
    out, err = proc.communicate(timeout=120) if hasattr(proc, "communicate") else (proc.stdout, proc.stderr)
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"no result (exit {proc.returncode}):\n{out}\n{err[-3000:]}"
    return json.loads(line[len("RESULT "):])


def first_pid(proc) -> int:
    line = proc.stdout.readline()
    assert line.startswith("PID "), line
    return int(line.split()[1])


@pytest.fixture
def job(users):
    """A fresh job id, and nothing of the victim's left in /dev/shm before or after."""
    import shutil

    folder = os.path.join(SHM, f"distmem-layout-{users.victim.uid}")
    shutil.rmtree(folder, ignore_errors=True)
    yield uuid.uuid4().hex[:12]
    shutil.rmtree(folder, ignore_errors=True)


def attacker_tree(users, job: str, mode: str = "777") -> str:
    """As the attacker: the folder the victim's ranks of ``job`` would use, made before them."""
    host = socket.gethostname().replace(os.sep, "_")
    folder = os.path.join(SHM, f"distmem-layout-{users.victim.uid}", job_key({"OMPI_MCA_ess_base_jobid": job}), host)
    top = os.path.join(SHM, f"distmem-layout-{users.victim.uid}")
    res = users.shell(users.attacker, f"umask 000 && mkdir -p {shlex.quote(folder)} && chmod -R {mode} {shlex.quote(top)}")
    assert res.returncode == 0, res.stderr
    return folder


def refused(got: dict, users) -> None:
    """The fixed code's answer to a folder someone else made: a ConfigError naming it, its owner,
    its mode, and the way out."""
    assert got.get("error") == "ConfigError", got
    msg = got["message"]
    assert f"distmem-layout-{users.victim.uid}" in msg and users.attacker.name in msg, msg
    assert "mode 07" in msg and "DISTMEM_LAYOUT_DIR" in msg, msg


def test_links_planted_in_a_folder_made_by_another_user_are_never_followed(users, job):
    """Finding 1: the attacker makes the victim's layout folder and plants a link at the name the
    victim's rank writes its record through; the victim's 0600 file must stay as it was."""
    secret = os.path.join(users.victim.home, "secret")
    users.shell(users.victim, f"umask 077 && echo SECRET > {shlex.quote(secret)}")
    folder = attacker_tree(users, job)
    go = os.path.join(users.victim.home, "go")
    rank0 = users.python(users.victim, RANK, env=rank_env(0, job, GO_FILE=go, DISTMEM_LAYOUT_TIMEOUT="2"),
                         wait=False)
    pid = first_pid(rank0)
    for name in ("0.1.json", "1.1.json"):  # the temporary name of the record as the rank wrote it
        res = users.shell(users.attacker, f"ln -s {shlex.quote(secret)} {shlex.quote(folder)}/{name}.{pid}.tmp")
        assert res.returncode == 0, res.stderr
    users.shell(users.victim, f"touch {shlex.quote(go)}")
    got = result(rank0)
    with open(secret) as f:
        assert f.read() == "SECRET\n", "the victim's file was overwritten through the attacker's link"
    refused(got, users)


def test_a_forged_record_in_a_folder_made_by_another_user_is_not_trusted(users, job):
    """Finding 2: the attacker's record claims a second rank on the victim's GPU; the victim, alone
    on it, must not plan half the GPU (before: shared_by 2)."""
    folder = attacker_tree(users, job)
    gpu = {k: v for k, v in fleet_inventory("1x16GiB", socket.gethostname()).gpus[0].to_dict().items()
           if k != "processes"}
    forged = json.dumps({"rank": 1, "host": socket.gethostname(), "local_rank": 1, "pid": 1, "gpus": [gpu],
                         "start": 0.0, "time": time.time() + 3600, "round": 1})
    res = users.shell(users.attacker, f"printf '%s' {shlex.quote(forged)} > {shlex.quote(folder)}/1.1.json")
    assert res.returncode == 0, res.stderr
    got = result(users.python(users.victim, RANK, env=rank_env(0, job, DISTMEM_LAYOUT_TIMEOUT="2")))
    assert got.get("shared_by") != 2, f"the forged record was trusted: {got}"
    refused(got, users)


@pytest.mark.parametrize("content", ["[]", '{"local_rank": 1, "pid": [], "time": 1e300}', "not json"])
def test_a_malformed_record_from_another_user_is_not_a_crash(users, job, content):
    """Finding 2: a record that is not one (a list, wrong types) crashed the rank with a TypeError
    or AttributeError; now the folder is refused with a ConfigError that says why."""
    folder = attacker_tree(users, job)
    res = users.shell(users.attacker, f"printf '%s' {shlex.quote(content)} > {shlex.quote(folder)}/1.1.json")
    assert res.returncode == 0, res.stderr
    got = result(users.python(users.victim, RANK, env=rank_env(0, job, DISTMEM_LAYOUT_TIMEOUT="2")))
    assert got.get("error") not in ("TypeError", "AttributeError", "ValueError"), got
    refused(got, users)


def test_a_folder_another_user_made_has_a_way_out(users, job):
    """Finding 2: a foreign folder blocked the victim until reboot. The error says what to do, and
    doing it works: the victim's own XDG_RUNTIME_DIR (preferred by default), or DISTMEM_LAYOUT_DIR."""
    attacker_tree(users, job, mode="755")
    got = result(users.python(users.victim, RANK, env=rank_env(0, job, DISTMEM_LAYOUT_TIMEOUT="2")))
    refused(got, users)
    runtime = os.path.join(users.victim.home, "runtime")
    users.shell(users.victim, f"mkdir -m 700 {shlex.quote(runtime)}")
    for extra in ({"XDG_RUNTIME_DIR": runtime}, {"DISTMEM_LAYOUT_DIR": os.path.join(users.victim.home, "layout")}):
        procs = [users.python(users.victim, RANK, env=rank_env(r, job, **extra), wait=False) for r in (0, 1)]
        rows = [result(p) for p in procs]
        assert all(r.get("shared_by") == 2 for r in rows), (extra, rows)


def test_records_are_private_while_the_job_runs_and_gone_after_it(users, job):
    """Finding 4: the attacker could read the victim's records (0644 in 0755 folders) and they
    stayed in tmpfs after the job. Now the attacker can neither read a record whose exact path it
    knows nor create anything beside it, and nothing is left once the ranks have ended."""
    top = os.path.join(SHM, f"distmem-layout-{users.victim.uid}")
    rank0 = users.python(users.victim, RANK, env=rank_env(0, job), wait=False)
    first_pid(rank0)
    records = []

    def published() -> bool:
        records[:] = [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs if f.startswith("0.1.")]
        return bool(records)

    wait_for(published, 60, "rank 0's record")
    peek = users.shell(users.attacker, f"cat {shlex.quote(records[0])}")
    plant = users.shell(users.attacker, f"touch {shlex.quote(os.path.dirname(records[0]))}/1.1.x.json")
    rank1 = users.python(users.victim, RANK, env=rank_env(1, job), wait=False)
    rows = [result(rank0), result(rank1)]
    assert peek.returncode != 0 and '"gpus"' not in peek.stdout, f"the attacker read the record: {peek.stdout}"
    assert plant.returncode != 0, "the attacker created a file in the victim's layout folder"
    assert all(r.get("shared_by") == 2 for r in rows), rows
    assert not os.path.exists(top), f"left behind: {[os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs]}"
