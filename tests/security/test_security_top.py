"""``distmem top`` over a textfile folder two users share (issue 36, finding 8): the victim's job
writes its Prometheus textfile into a folder everyone may write (a node_exporter textfile folder
made 1777 so that every user's job can write there); another user writes one too.

Before the fix (02c3033) rows merged by rank number alone, so the other user's newer rank 0
replaced the victim's, and label values reached the terminal raw (escape sequences that retitle
the window or recolour the screen). Now rows merge by job and rank, another user's file in a folder
others can write is named and never shown as the victim's job, and every text is escaped.
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys

import pytest

from crossuser import ENV_BIN, shared_folder

VICTIM_JOB = r"""
import sys
from distmem.observe.snapshot import Snapshot
from distmem.report.aggregate import aggregate
from distmem.report.sinks import prometheus
snaps = [Snapshot(rank=r, size=2, local_rank=r, host="victim-node", pid=100 + r, framework="torch",
                  strategy="data", devices=[0], allocation={}, limit_bytes=8 << 30, enforced=True,
                  current_bytes=1 << 30, peak_bytes=(2 + r) << 30) for r in range(2)]
rep = aggregate(snaps, world_size=2)
rep.created = 1000.0
prometheus(rep, sys.argv[1])
"""

EVIL = ('distmem_job_ranks 2\n'
        'distmem_report_timestamp_seconds 9999999999\n'
        'distmem_rank_up{rank="0",host="\\033]0;owned\\007\\033[31mEVIL",local_rank="0",gpu="0"} 1\n'
        'distmem_rank_peak_bytes{rank="0",host="\\033]0;owned\\007\\033[31mEVIL",local_rank="0",gpu="0"} 1\n'
        'distmem_rank_limit_bytes{rank="0",host="\\033]0;owned\\007\\033[31mEVIL",local_rank="0",gpu="0"} 1\n')


@pytest.fixture
def textfiles(users):
    folder = shared_folder(users)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_another_users_textfile_never_replaces_the_victims_ranks_or_drives_its_terminal(users, textfiles):
    res = users.python(users.victim, VICTIM_JOB, os.path.join(textfiles, "victim.prom"))
    assert res.returncode == 0, res.stderr[-2000:]
    # The attacker writes real escape bytes (printf interprets \x1b) in its label values.
    res = users.shell(users.attacker, f"printf {shlex.quote(EVIL)} > {shlex.quote(textfiles)}/evil.prom")
    assert res.returncode == 0, res.stderr
    with open(os.path.join(textfiles, "evil.prom"), "rb") as f:
        assert b"\x1b]0;owned\x07" in f.read()
    got = users.run(users.victim, [sys.executable, os.path.join(ENV_BIN, "distmem"), "top", textfiles, "--once"],
                    cwd=users.victim.home)
    out = got.stdout + got.stderr
    assert "\x1b" not in out and "\x07" not in out, f"escape sequences reached the terminal: {out!r}"
    assert got.returncode == 0, out[-3000:]
    rows = [ln.split() for ln in got.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert [(r[0], r[6]) for r in rows] == [("0", "2.0"), ("1", "3.0")], got.stdout  # the victim's own peaks
    assert "EVIL" not in got.stdout.split("warnings")[0], got.stdout
    assert "evil.prom" in got.stdout and users.attacker.name in got.stdout, got.stdout  # named, not shown as ours
