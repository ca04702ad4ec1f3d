"""``distmem top`` in a pseudo-terminal against a 64-rank job whose report files a real mpirun job
writes while the view runs: 4 MPI ranks, each writing one host's files for 16 ranks in distmem's
formats (tests/mpi/progs/top_job.py says how). The view must show every rank and every host, refresh
as the steps advance, show the warning when it appears, answer its keys (h collapses the hosts, q
quits and gives the terminal back); ``--once`` without a terminal prints a plain table with no
escape codes; ``--json`` holds all 64 ranks."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import termios
import time

import pytest

from helpers import ROOT, python

pytest.importorskip("mpi4py")

PROG = os.path.join(os.path.dirname(__file__), "progs", "top_job.py")
ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")
ROW = re.compile(r"^\s+(\d+)\s+(\d|-)\s+\d", re.M)
STEP = re.compile(r"- step (\d+) -")


def _start_job(folder: str, steps: int, warn_step: int, pause: float = 0.25) -> subprocess.Popen:
    exe = shutil.which("mpirun")
    assert exe, "mpirun not found"
    env = dict(os.environ, TOP_DIR=folder, STEPS=str(steps), STEP_SECONDS=str(pause), RANKS_PER_HOST="16",
               WARN_STEP=str(warn_step), PYTHONPATH=ROOT, DISTMEM_QUIET="1")
    cmd = [exe, "-np", "4", "--oversubscribe", "--bind-to", "none"]
    for k in ("PYTHONPATH", "TOP_DIR", "STEPS", "STEP_SECONDS", "RANKS_PER_HOST", "WARN_STEP", "DISTMEM_QUIET"):
        cmd += ["-x", k]
    return subprocess.Popen(cmd + [python(), PROG], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_files(folder: str, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len([f for f in os.listdir(folder) if f.endswith((".json", ".prom"))]) >= n:
            return
        assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"the job wrote no files within {timeout} s")


class Pty:
    """``distmem top`` on a pseudo-terminal of ``rows`` x ``cols``."""

    def __init__(self, args, rows: int = 100, cols: int = 200):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = dict(os.environ, PYTHONPATH=ROOT, TERM="xterm", COLUMNS=str(cols), LINES=str(rows))
        env.pop("NO_COLOR", None)
        self.proc = subprocess.Popen([python(), "-m", "distmem.cli", "top", *args], stdin=slave, stdout=slave,
                                     stderr=slave, env=env, close_fds=True, start_new_session=True)
        os.close(slave)
        self.master = master
        self.raw = b""

    def read(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.master], [], [], 0.1)
            if r:
                try:
                    self.raw += os.read(self.master, 1 << 16)
                except OSError:
                    return

    def frames(self):
        text = self.raw.decode(errors="replace")
        return [ANSI.sub("", f) for f in text.split("\x1b[H")[1:]]

    def send(self, key: str) -> None:
        os.write(self.master, key.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.master)


def _complete(frames):
    """Frames drawn in full (the last one may be cut by the read)."""
    return [f for f in frames if "frame " in f]


def test_top_shows_every_rank_of_a_64_rank_job_live_in_a_terminal(tmp_path):
    folder = str(tmp_path)
    job = _start_job(folder, steps=80, warn_step=30)
    view = None
    try:
        _wait_files_after(folder, job)
        view = Pty([os.path.join(folder, "json"), "--interval", "0.2"])
        view.read(12.0)
        frames = _complete(view.frames())
        assert len(frames) >= 10, f"{len(frames)} frames in 12 s: the view does not refresh\n{view.raw[-3000:]!r}"
        last = frames[-1]
        ranks = sorted(int(m.group(1)) for m in ROW.finditer(last))
        assert ranks == list(range(64)), f"ranks shown: {ranks}\n{last}"
        assert re.findall(r"^node(\d): 16 rank\(s\)", last, re.M) == ["0", "1", "2", "3"], last
        steps = [int(m.group(1)) for f in frames for m in [STEP.search(f)] if m]
        assert len(set(steps)) >= 3 and steps == sorted(steps), f"steps seen: {steps}"
        warned = ["[above_plan]" in f for f in frames]
        assert not warned[0] and warned[-1], ("the warning must appear while the view runs (step 30 of 80): "
                                              f"first frame step {steps[0]}, last {steps[-1]}")
        assert "\x1b[31m" in view.raw.decode(errors="replace"), "the rank above its plan is drawn in red"
        n = len(view.frames())
        view.send("sh")  # two keys in one read: sort by peak, collapse the hosts
        view.read(1.5)
        collapsed = _complete(view.frames()[n:])
        assert collapsed and not ROW.search(collapsed[-1]) and collapsed[-1].count(": 16 rank(s)") == 4, collapsed[-1:]
        assert "sort peak" in collapsed[-1]
        view.send("q")
        view.proc.wait(timeout=10)
        assert view.proc.returncode == 0
        view.read(0.5)
        assert view.raw.rstrip().endswith(b"\x1b[?1049l"), "the terminal's screen is given back"
        once = subprocess.run([python(), "-m", "distmem.cli", "top", os.path.join(folder, "prom"), "--once"],
                              capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
        assert once.returncode == 0, once.stderr
        assert "\x1b" not in once.stdout
        assert sorted(int(m.group(1)) for m in ROW.finditer(once.stdout)) == list(range(64)), once.stdout
        js = subprocess.run([python(), "-m", "distmem.cli", "top", os.path.join(folder, "json"), "--json"],
                            capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
        data = json.loads(js.stdout)
        assert [r["rank"] for r in data["ranks"]] == list(range(64)) and len(data["hosts"]) == 4
    finally:
        if view is not None:
            view.close()
        try:
            os.killpg(job.pid, 9)
        except ProcessLookupError:
            pass
        job.wait()


def _wait_files_after(folder: str, job: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not os.path.isdir(os.path.join(folder, "json")) and time.monotonic() < deadline:
        assert job.poll() is None, job.stdout.read().decode(errors="replace")[-3000:]
        time.sleep(0.1)
    _wait_files(os.path.join(folder, "json"), 4, job)
