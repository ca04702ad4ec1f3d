"""Two clones, one cached environment: each runs its own code (issue 26, finding 15).

``scripts/env.sh`` on aa55a88 ran ``pip install -e <this clone>`` into the shared cached
environment on every call, so the environment followed whichever clone ran last: with two
clones at work, one clone's tests ran the other's distmem. Here two real copies of this tree call
their own ``scripts/env.sh`` against one environment root; the environment itself is prepared
by the test (a fresh venv, standing for the built one, that reaches this test run's packages) so
that nothing is downloaded or compiled, and the script is run exactly as ``make`` runs it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IGNORE = shutil.ignore_patterns(".git", "runs", "build", "__pycache__", "*.so", ".carry", "*.egg-info")

if shutil.which("mpicc") is None or shutil.which("mpirun") is None:
    pytest.skip("scripts/env.sh wants Open MPI (mpicc, mpirun) installed first", allow_module_level=True)


def env_sh(clone: str, root: str, python: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(DISTMEM_ENV_ROOT=root, DISTMEM_PYTHON=python)
    return subprocess.run(["bash", os.path.join(clone, "scripts", "env.sh"), "latest"], env=env, capture_output=True,
                          text=True, timeout=600, cwd=clone)


def where_distmem(bin_dir: str, cwd: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    res = subprocess.run([os.path.join(bin_dir, "python"), "-c",
                          "import os, distmem; print(os.path.realpath(distmem.__file__))"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip()


def test_two_clones_each_run_their_own_code(tmp_path):
    clones = [str(tmp_path / name) for name in ("clone-a", "clone-b")]
    for clone in clones:
        shutil.copytree(ROOT, clone, ignore=IGNORE, symlinks=True)
    root = str(tmp_path / "envs")
    # Where the script keeps the environment: ask it, with an interpreter that stops at "python -m venv".
    stop = tmp_path / "stop-at-venv"
    stop.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = venv ] && exit 3; done\nexec {sys.executable} "$@"\n')
    stop.chmod(0o755)
    first = env_sh(clones[0], root, str(stop))
    m = re.search(r"building (\S+)", first.stderr)
    assert m and first.returncode != 0, first.stderr[-3000:]
    shared = m.group(1)
    # The environment, standing for a built one: a venv (with pip) whose packages are this run's.
    subprocess.run([sys.executable, "-m", "venv", shared], check=True, timeout=300, capture_output=True)
    site = subprocess.run([os.path.join(shared, "bin", "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    with open(os.path.join(site, "zz-this-test-run.pth"), "w") as f:
        # This run's packages, wherever they are (a clone's view adds the shared ones after its own),
        # but no folder holding a distmem: the environment must not bring one of its own.
        f.writelines(p + "\n" for p in sys.path if os.path.basename(p) == "site-packages"
                     and not os.path.exists(os.path.join(p, "distmem")))
    open(os.path.join(shared, ".complete"), "w").close()
    before = sorted(os.listdir(site))

    bins = []
    for clone in clones:
        res = env_sh(clone, root, sys.executable)
        assert res.returncode == 0, res.stderr[-4000:]
        bins.append(res.stdout.strip().splitlines()[-1])
    for clone, bin_dir in zip(clones, bins):  # after both ran: each still runs its own distmem
        assert where_distmem(bin_dir, str(tmp_path)).startswith(os.path.join(clone, "distmem") + os.sep), bin_dir
    assert bins[0] != bins[1]
    assert sorted(os.listdir(site)) == before, "a clone wrote into the shared environment"
    for tool in ("distmem", "distmem-exec"):
        res = subprocess.run([os.path.join(bins[1], tool), "--help"], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and "usage" in res.stdout, res.stderr[-2000:]
    # A second call reuses the view.
    again = env_sh(clones[0], root, sys.executable)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == bins[0]
