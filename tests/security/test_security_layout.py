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
    proc.said = err
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


def said_refused(err: str, users) -> None:
    """The fixed code's answer to a folder someone else made: refused (named with its owner and
    mode), never used, and the job runs on in the victim's own folder - said once."""
    lines = [ln for ln in err.splitlines() if f"distmem-layout-{users.victim.uid}" in ln]
    assert len(lines) == 1, err[-3000:]
    assert users.attacker.name in lines[0] and "mode 07" in lines[0], lines[0]
    assert os.path.join(users.victim.home, ".cache", "distmem", "layout") in lines[0], lines[0]


def both_ranks(users, job: str, **extra: str):
    """The victim's two ranks of ``job``; each rank's result and all they said on stderr."""
    procs = [users.python(users.victim, RANK, env=rank_env(r, job, DISTMEM_QUIET="0", **extra), wait=False)
             for r in (0, 1)]
    rows, err = [], ""
    for p in procs:
        rows.append(result(p))
        err += p.said
    return rows, err


def test_links_planted_in_a_folder_made_by_another_user_are_never_followed(users, job):
    """Finding 1: the attacker makes the victim's layout folder and plants a link at the name the
    victim's rank writes its record through; the victim's 0600 file must stay as it was. The
    folder is refused, and the job still runs (issue 36: the refusal used to stop it)."""
    secret = os.path.join(users.victim.home, "secret")
    users.shell(users.victim, f"umask 077 && echo SECRET > {shlex.quote(secret)}")
    folder = attacker_tree(users, job)
    go = os.path.join(users.victim.home, "go")
    rank0 = users.python(users.victim, RANK, env=rank_env(0, job, GO_FILE=go, DISTMEM_QUIET="0"), wait=False)
    pid = first_pid(rank0)
    for name in ("0.1.json", "1.1.json"):  # the temporary name of the record as the rank wrote it
        res = users.shell(users.attacker, f"ln -s {shlex.quote(secret)} {shlex.quote(folder)}/{name}.{pid}.tmp")
        assert res.returncode == 0, res.stderr
    rank1 = users.python(users.victim, RANK, env=rank_env(1, job, DISTMEM_QUIET="0"), wait=False)
    users.shell(users.victim, f"touch {shlex.quote(go)}")
    rows = [result(rank0), result(rank1)]
    with open(secret) as f:
        assert f.read() == "SECRET\n", "the victim's file was overwritten through the attacker's link"
    assert [r.get("shared_by") for r in rows] == [2, 2], rows
    said_refused(rank0.said + rank1.said, users)


def test_a_forged_record_in_a_folder_made_by_another_user_is_not_trusted(users, job):
    """Finding 2: the attacker's record claims a rank of the victim's job on its GPU. The folder
    holding it is refused whole; the victim's two ranks meet in its own folder and plan from each
    other's real records."""
    folder = attacker_tree(users, job)
    gpu = {k: v for k, v in fleet_inventory("1x16GiB", socket.gethostname()).gpus[0].to_dict().items()
           if k != "processes"}
    forged = json.dumps({"rank": 1, "host": socket.gethostname(), "local_rank": 1, "pid": 1, "gpus": [gpu],
                         "start": 0.0, "time": time.time() + 3600, "round": 1})
    res = users.shell(users.attacker, f"printf '%s' {shlex.quote(forged)} > {shlex.quote(folder)}/1.1.json")
    assert res.returncode == 0, res.stderr
    rows, err = both_ranks(users, job)
    assert [r.get("shared_by") for r in rows] == [2, 2], rows
    said_refused(err, users)


@pytest.mark.parametrize("content", ["[]", '{"local_rank": 1, "pid": [], "time": 1e300}', "not json"])
def test_a_malformed_record_from_another_user_is_not_a_crash(users, job, content):
    """Finding 2: a record that is not one (a list, wrong types) crashed the rank with a TypeError
    or AttributeError; now the folder is refused, and the job runs."""
    folder = attacker_tree(users, job)
    res = users.shell(users.attacker, f"printf '%s' {shlex.quote(content)} > {shlex.quote(folder)}/1.1.json")
    assert res.returncode == 0, res.stderr
    rows, err = both_ranks(users, job)
    assert all(r.get("error") is None for r in rows) and [r["shared_by"] for r in rows] == [2, 2], rows
    said_refused(err, users)


def test_a_folder_another_user_made_first_never_stops_the_victims_job(users, job):
    """Issue 36: another user who creates /dev/shm/distmem-layout-<uid> first stopped the victim's
    jobs from starting (a ConfigError until the folder was removed). The refusal stands; the job
    runs without any setting - in the victim's own folder, said once - and the ways the error
    offered still work (the victim's XDG_RUNTIME_DIR, DISTMEM_LAYOUT_DIR)."""
    attacker_tree(users, job, mode="755")
    rows, err = both_ranks(users, job)
    assert [r.get("shared_by") for r in rows] == [2, 2], (rows, err[-2000:])
    said_refused(err, users)
    runtime = os.path.join(users.victim.home, "runtime")
    users.shell(users.victim, f"mkdir -m 700 {shlex.quote(runtime)}")
    for extra in ({"XDG_RUNTIME_DIR": runtime}, {"DISTMEM_LAYOUT_DIR": os.path.join(users.victim.home, "layout")}):
        rows, err = both_ranks(users, job, **extra)
        assert all(r.get("shared_by") == 2 for r in rows) and "distmem-layout" not in err, (extra, rows, err)


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
