"""What a job writes and reads in a folder another user can write (issue 36, findings 4, 6, 7 and 9):
reports and Prometheus textfiles, the out-of-memory records, the report and records the next plan
and the post-mortem read. The victim works in a folder the attacker owns and everyone may write
(``/tmp``-like, or a project folder without the sticky bit); the attacker plants files there.

Each test failed on the code before the checked reads and descriptor writes (02c3033): a report
write overwrote and exposed the victim's private file through a swapped temporary file (4); a FIFO
named like a record hung postmortem and plan --from for ever (6); planted records became the next
plan and the post-mortem's story, and the victim's own record was lost in a folder the attacker made
(7); a report's figures of 0, -1, 1e300 or NaN gave 0 B or negative limits or a bare ValueError (9).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

from crossuser import ENV_BIN, SYSTEM_PYTHON, shared_folder

GiB = 1024**3

#: A report of two ranks (rank 0 peaked at 2 GiB, rank 1 at 3 GiB), as the victim's job wrote it.
REPORT = r"""
import sys
from distmem.observe.snapshot import Snapshot
from distmem.report.aggregate import aggregate
from distmem.report.sinks import prometheus, write_json
snaps = [Snapshot(rank=r, size=2, local_rank=r, host="h", pid=100 + r, framework="torch", strategy="data",
                  devices=[0], allocation={}, limit_bytes=8 << 30, enforced=True, current_bytes=1 << 30,
                  peak_bytes=(2 + r) << 30) for r in range(2)]
rep = aggregate(snaps, world_size=2)
path, times = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
errors = []
for _ in range(times):
    try:
        (prometheus if path.endswith(".prom") else write_json)(rep, path)
    except Exception as exc:
        errors.append(type(exc).__name__)
print("RESULT", len(errors), sorted(set(errors)))
"""

#: The attacker's side of finding 4: every temporary file that appears becomes a link to the victim's file.
SWAPPER = r"""
import os, sys, time
folder, target, stop = sys.argv[1], sys.argv[2], sys.argv[3]
n = 0
while not os.path.exists(stop):
    for name in os.listdir(folder):
        if name.startswith(".") and name.endswith(".tmp"):
            link = os.path.join(folder, ".swap%d" % n)
            n += 1
            try:
                os.symlink(target, link)
                os.rename(link, os.path.join(folder, name))
            except OSError:
                pass
print("SWAPS", n)
"""


@pytest.fixture
def shared(users):
    made = []

    def make(mode: int = 0o1777) -> str:
        folder = shared_folder(users, mode)
        made.append(folder)
        return folder

    yield make
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


def attacker_file(users, path: str, content: str) -> None:
    res = users.shell(users.attacker, f"mkdir -p {shlex.quote(os.path.dirname(path))} && chmod 777 "
                                      f"{shlex.quote(os.path.dirname(path))} && printf '%s' {shlex.quote(content)} > "
                                      f"{shlex.quote(path)}")
    assert res.returncode == 0, res.stderr


def distmem_cli(users, *args: str, cwd: str, timeout: float = 120, env=None):
    """``distmem ARGS`` as the victim: the environment's own script, as a user runs it."""
    argv = [sys.executable, os.path.join(ENV_BIN, "distmem"), *args]
    try:
        return users.run(users.victim, argv, cwd=cwd, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`distmem {' '.join(args)}` was still running after {timeout:.0f} s: it hung")


def test_a_report_write_never_goes_through_a_swapped_file(users, shared):
    """Finding 4: in a folder anyone may write and rename in (no sticky bit), the attacker turns each
    temporary file into a link to the victim's private file while the victim's periodic Prometheus
    write runs. Before, the write went through the link (overwritten with metrics) and its chmod
    made the file 0644; now the file is written and given its mode through its own descriptor."""
    folder = shared(0o777)
    secret = os.path.join(users.victim.home, "secret")
    users.shell(users.victim, f"umask 077 && echo SECRET > {shlex.quote(secret)}")
    tools = tempfile.mkdtemp(prefix="dms-swap-", dir="/tmp")
    os.chmod(tools, 0o755)
    with open(os.path.join(tools, "swap.py"), "w") as f:
        f.write(SWAPPER)
    stop = os.path.join(tools, "stop")
    swapper = subprocess.Popen(users._prefix(users.attacker, False) + [
        SYSTEM_PYTHON, os.path.join(tools, "swap.py"), folder, secret, stop], env=users.env(users.attacker),
        cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        res = users.python(users.victim, REPORT, os.path.join(folder, "job.prom"), "3000", timeout=600)
    finally:
        open(stop, "w").close()
        out, _ = swapper.communicate(timeout=60)
        shutil.rmtree(tools, ignore_errors=True)
    assert "RESULT" in res.stdout, res.stderr[-3000:]
    with open(secret) as f:
        assert f.read() == "SECRET\n", f"the victim's private file was overwritten through a link ({out.strip()})"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600, f"the victim's private file was made " \
        f"{stat.S_IMODE(os.stat(secret).st_mode):04o} ({out.strip()})"


@pytest.mark.parametrize("command", ["postmortem", "plan"])
def test_a_planted_fifo_never_hangs_the_job_or_its_commands(users, shared, command):
    """Finding 6: a FIFO named like a record (``oom/rank-1.json``) in the run folder. Before,
    postmortem and plan --from opened it blocking and hung for ever; now it is refused, never read."""
    folder = shared()
    run = os.path.join(folder, "runs", "last")
    res = users.shell(users.attacker, f"mkdir -p {run}/oom && chmod -R 777 {folder}/runs && mkfifo -m 666 "
                                      f"{run}/oom/rank-1.json")
    assert res.returncode == 0, res.stderr
    users.python(users.victim, REPORT, os.path.join(run, "report.json"))
    args = (["postmortem", run] if command == "postmortem" else
            ["plan", "--from", os.path.join(run, "report.json"), "--gpus", "1x80GiB", "--ranks", "2", "--json"])
    got = distmem_cli(users, *args, cwd=folder, timeout=60)
    assert got.returncode in (0, 1), got.stderr[-2000:]
    if command == "plan":
        limits = [a["devices"][0]["planned_bytes"] for a in json.loads(got.stdout)["allocations"]]
        assert limits == [-(-int(b * 1.1) // 2**20) * 2**20 for b in (2 * GiB, 3 * GiB)], limits


def test_planted_records_never_become_the_next_plan_or_the_story(users, shared):
    """Finding 7: with DISTMEM_REPORT=/tmp/x.json the run folder is /tmp, and the records beside the
    report are anyone's. The attacker's records said rank 0 needed 60 GiB and rank 1 -4.8 GiB:
    before, plan --from took rank 0's (a 66 GiB limit) and postmortem told the attacker's story;
    now they are left out (named), and the plan comes from the victim's report alone."""
    folder = shared()
    report = os.path.join(folder, "x.json")
    users.python(users.victim, REPORT, report)
    for rank, (alloc, req) in enumerate([(50 * GiB, 10 * GiB), (-5 * GiB, 200 * 2**20)]):
        rec = {"distmem_oom": 1, "rank": rank, "world_size": 2, "pid": 4242, "time": 2e9, "source": "exception",
               "allocated_bytes": alloc, "request_bytes": req, "limit_bytes": GiB, "error": "CUDA out of memory"}
        attacker_file(users, os.path.join(folder, "oom", f"rank-{rank}.json"), json.dumps(rec))
    got = distmem_cli(users, "plan", "--from", report, "--gpus", "1x80GiB", "--ranks", "2", "--json", cwd=folder)
    assert got.returncode == 0, got.stderr[-2000:]
    plan = json.loads(got.stdout)
    limits = [a["devices"][0]["planned_bytes"] for a in plan["allocations"]]
    assert limits == [-(-int(b * 1.1) // 2**20) * 2**20 for b in (2 * GiB, 3 * GiB)], limits
    assert any("left out" in w and users.attacker.name in w for w in plan["warnings"]), plan["warnings"]
    page = distmem_cli(users, "postmortem", folder, "--json", cwd=folder)
    assert page.returncode == 1 and "rank-0.json" not in page.stdout.split('"entries"')[-1][:200], page.stdout[-2000:]
    assert json.loads(page.stdout)["entries"] == [], page.stdout[-2000:]


def test_the_victims_own_record_is_kept_when_another_user_made_the_folder(users, shared):
    """Finding 7: the attacker made the run folder's ``oom/`` first. Before, the victim's rank refused
    it and its record was lost; now the record goes to the victim's own folder, said once, and
    postmortem finds it there."""
    folder = shared()
    res = users.shell(users.attacker, f"mkdir -m 777 {folder}/oom")
    assert res.returncode == 0, res.stderr
    code = ("import distmem\n"
            "distmem.init(fleet='1x16GiB', framework='none', verbose=False)\n"
            "raise MemoryError('out of memory: tried to allocate 2.00 GiB')\n")
    ran = users.python(users.victim, code, env={"DISTMEM_REPORT": os.path.join(folder, "x.json"), "DISTMEM_QUIET": "0"},
                       cwd=folder)
    assert "MemoryError" in ran.stderr, ran.stderr[-2000:]
    page = distmem_cli(users, "postmortem", folder, "--json", cwd=folder)
    entries = json.loads(page.stdout)["entries"] if page.stdout.strip().startswith("{") else []
    assert [e["rank"] for e in entries] == [0], f"the victim's record was lost:\n{ran.stderr[-2000:]}\n{page.stdout}"
    assert os.listdir(os.path.join(folder, "oom")) == []  # nothing of the victim's in the attacker's folder


@pytest.mark.parametrize("figure", ["0", "-1073741824", "1e300", "NaN", '"4GiB"'])
def test_a_colleagues_report_with_impossible_figures_is_a_config_error(users, figure):
    """Finding 9: a report another user wrote, copied by the victim into its own folder to plan its
    next run from (its owner checks pass; its figures are the other user's): a peak of 0 gave a 0 B
    limit, a negative one a negative limit, 1e300 was taken, NaN raised a bare ValueError. Each is now
    a ConfigError naming the figure, and no plan."""
    folder = tempfile.mkdtemp(prefix="dms-colleague-", dir="/tmp")
    os.chown(folder, users.attacker.uid, users.attacker.gid)
    os.chmod(folder, 0o755)
    try:
        text = '{"world_size": 2, "strategy": "data", "ranks": [{"rank": 0, "peak_bytes": %s}, ' \
               '{"rank": 1, "peak_bytes": 3221225472}]}' % figure
        res = users.shell(users.attacker, f"printf '%s' {shlex.quote(text)} > {folder}/report.json && "
                                          f"chmod 644 {folder}/report.json")
        assert res.returncode == 0, res.stderr
        mine = os.path.join(users.victim.home, f"colleague-{abs(hash(figure))}.json")
        users.shell(users.victim, f"cp {folder}/report.json {mine}")
        got = distmem_cli(users, "plan", "--from", mine, "--gpus", "1x80GiB", "--ranks", "2", "--json",
                          cwd=users.victim.home)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert got.returncode != 0 and "Traceback" not in got.stderr, (got.stdout[-1000:], got.stderr[-2000:])
    assert "peak_bytes" in got.stderr and "error" in got.stderr.lower(), got.stderr[-2000:]
