"""The layout exchange's private folder and records, within one user (issue 26, findings 1-4; the
cross-user cases are in tests/security). Ranks are real processes where the case needs two."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import uuid

import pytest

from distmem.discover import layout, private
from distmem.discover.gpus import fleet_inventory
from distmem.discover.identity import Topology, job_key
from distmem.discover.layout import LayoutTimeoutError, RankView, exchange
from distmem.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

RANK = r"""
import json, os, sys, time
sys.path.insert(0, %r)
time.sleep(float(os.environ.get("RANK_DELAY", "0")))
import distmem
plan = distmem.plan_from_env("data")
print("RESULT " + json.dumps({"rank": plan.mine.rank, "shared_by": plan.mine.devices[0].shared_by}), flush=True)
""" % ROOT


def ranks(folder: str, job: str, delays=(0, 0), timeout: str = "20", stderr: list = None, **extra: str) -> list:
    procs = []
    for r, delay in enumerate(delays):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM", "HOROVOD_",
                                                                         "TORCHELASTIC", "DISTMEM_", "XDG_"))}
        env.update(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE=str(len(delays)),
                   OMPI_COMM_WORLD_LOCAL_RANK=str(r), OMPI_COMM_WORLD_LOCAL_SIZE=str(len(delays)),
                   OMPI_MCA_ess_base_jobid=job, DISTMEM_LAYOUT_DIR=folder, DISTMEM_LAYOUT_TIMEOUT=timeout,
                   DISTMEM_FLEET="1x16GiB", DISTMEM_QUIET="1", RANK_DELAY=str(delay))
        env.update(extra)
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        so, se = p.communicate(timeout=120)
        assert p.returncode == 0, se[-3000:]
        out.append(json.loads(next(ln for ln in so.splitlines() if ln.startswith("RESULT "))[7:]))
        if stderr is not None:
            stderr.append(se)
    return out


TOPO = Topology(rank=0, size=2, local_rank=0, local_size=2, host="h", source="openmpi", launcher="mpirun")


def host_folder(base, env) -> str:
    return os.path.join(str(base), private.user_folder_name(), job_key(env), "h")


def test_folders_are_0700_records_0600_and_all_gone_after_the_job(tmp_path):
    """Findings 2 and 4: every level private, and nothing left once the ranks have ended - even when
    one rank leaves right after its exchange while the other has not read its record yet."""
    seen = {}

    def watch():
        for d, dirs, files in os.walk(tmp_path):
            for name in dirs + files:
                seen[os.path.join(d, name)] = stat.S_IMODE(os.lstat(os.path.join(d, name)).st_mode)

    rows = ranks(str(tmp_path), uuid.uuid4().hex, delays=(0, 1.5))
    assert [r["shared_by"] for r in rows] == [2, 2]
    watch()
    assert seen == {}, f"left behind: {seen}"


def test_modes_while_the_job_runs(tmp_path):
    env = {"OMPI_MCA_ess_base_jobid": uuid.uuid4().hex}
    with pytest.raises(LayoutTimeoutError):
        exchange(TOPO, fleet_inventory("1x16GiB", "h"), timeout=0.2, directory=str(tmp_path), env=env)
    user = tmp_path / private.user_folder_name()
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.lstat().st_mode) for p in user.rglob("*")}
    modes[user.name] = stat.S_IMODE(user.lstat().st_mode)
    dirs = {k: v for k, v in modes.items() if not k.endswith((".json", ".done"))}
    files = {k: v for k, v in modes.items() if k.endswith((".json", ".done"))}
    assert set(dirs.values()) == {0o700} and len(dirs) == 3, modes
    assert set(files.values()) == {0o600} and len(files) == 1, modes
    layout._leave()
    assert not user.exists()


def test_a_link_at_the_users_folder_is_refused_and_the_job_meets_in_its_own_folder(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / private.user_folder_name()).symlink_to(target)
    said: list = []
    rows = ranks(str(tmp_path), uuid.uuid4().hex, stderr=said, XDG_CACHE_HOME=str(tmp_path / "cache"),
                 DISTMEM_QUIET="0")
    assert [r["shared_by"] for r in rows] == [2, 2]
    assert list(target.iterdir()) == []  # never followed
    lines = [ln for se in said for ln in se.splitlines() if "symbolic link" in ln]
    assert len(lines) == 1 and str(tmp_path / "cache" / "distmem" / "layout") in lines[0], said


def test_our_own_loose_folder_of_an_older_version_is_tightened(tmp_path):
    old = tmp_path / private.user_folder_name()
    old.mkdir(mode=0o755)
    os.chmod(old, 0o755)
    rows = ranks(str(tmp_path), uuid.uuid4().hex)
    assert [r["shared_by"] for r in rows] == [2, 2]
    assert not old.exists() or stat.S_IMODE(old.stat().st_mode) == 0o700


def test_a_link_at_a_record_name_is_replaced_not_followed(tmp_path):
    """Finding 1 within one user: whatever sits at a record's name is replaced by the rename; the
    record's own file is created O_EXCL|O_NOFOLLOW under a name nobody can guess."""
    victim = tmp_path / "precious"
    victim.write_text("keep me")
    env = {"OMPI_MCA_ess_base_jobid": uuid.uuid4().hex}
    user = private.open_user_folder(str(tmp_path))
    folder = private.open_folder(private.open_folder(user, job_key(env), "k"), "h", "h")
    name = private.record_name(0, 1)
    os.symlink(victim, name, dir_fd=folder)
    fd = private.write_record(folder, name, {"x": 1})
    try:
        assert victim.read_text() == "keep me"
        assert stat.S_ISREG(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
        assert json.loads(open(f"/proc/self/fd/{folder}/{name}").read()) == {"x": 1}
    finally:
        os.close(fd)


MALFORMED = {
    "a list": "[]",
    "not json": "{{{",
    "wrong types": json.dumps({"format": layout.RECORD_FORMAT, "uid": os.geteuid(), "local_rank": 1, "rank": "1",
                               "pid": [], "start": None, "gpus": "x", "round": 1, "size": 2, "host": "h"}),
}


@pytest.mark.parametrize("kind", ["a list", "not json", "wrong types", "a gpu of wrong types", "a gpu without its name",
                                  "huge", "fifo",
                                  "link", "hard link", "dead writer", "another process's pid"])
def test_a_malformed_or_untrusted_record_is_ignored_never_a_crash(tmp_path, kind):
    """Finding 2: a record of local rank 1 that is not one, or not trustworthy, is ignored: the rank
    waits for a real one and names local rank 1 when it does not come."""
    env = {"OMPI_MCA_ess_base_jobid": uuid.uuid4().hex}
    key = job_key(env)
    user = private.open_user_folder(str(tmp_path))
    folder = private.open_folder(private.open_folder(user, key, "k"), "h", "h")
    name = f"1.1.{uuid.uuid4().hex[:16]}.json"
    me = RankView(1, "h", 1, fleet_inventory("1x16GiB", "h").gpus, os.getpid())
    good = layout._record(TOPO, me, key, 1)
    path = f"/proc/self/fd/{folder}/{name}"
    keep = []
    if kind in ("a list", "not json", "wrong types"):
        open(path, "w").write(MALFORMED[kind])
    elif kind == "a gpu of wrong types":
        good["gpus"][0]["total_bytes"] = "16GiB"
        keep.append(private.write_record(folder, name, good))
    elif kind == "a gpu without its name":
        del good["gpus"][0]["name"]  # Gpu(**fields) would raise TypeError
        keep.append(private.write_record(folder, name, good))
    elif kind == "huge":
        open(path, "w").write(json.dumps(good) + " " * private.MAX_RECORD_BYTES)
    elif kind == "fifo":
        os.mkfifo(name, dir_fd=folder)
    elif kind == "link":
        real = private.record_name(1, 7)
        keep.append(private.write_record(folder, real, good))
        os.symlink(real, name, dir_fd=folder)
    elif kind == "hard link":
        other = tmp_path / "other.json"
        other.write_text(json.dumps(good))
        os.link(other, path)
    elif kind == "dead writer":
        code = ("import os, sys; sys.path.insert(0, %r); from distmem.discover import private; "
                "private.write_record(int(sys.argv[1]), sys.argv[2], %r); os._exit(0)") % (ROOT, good)
        subprocess.run([sys.executable, "-c", code, str(folder), name], pass_fds=(folder,), check=True, timeout=60)
    else:  # a live process that did not write it (started at boot, not when the record says)
        good["pid"] = 1
        keep.append(private.write_record(folder, name, good))
    try:
        with pytest.raises(LayoutTimeoutError, match=r"local rank\(s\) 1 did not arrive") as err:
            exchange(TOPO, fleet_inventory("1x16GiB", "h"), timeout=0.3, directory=str(tmp_path), env=env)
        assert err.value.missing == [1]
        # Either still there and counted as ignored (its lock is held), or swept as stale (it is not).
        held = kind in ("a gpu of wrong types", "a gpu without its name", "another process's pid")
        assert ("1 record(s) there were ignored" in str(err.value)) == held, str(err.value)
        assert os.path.lexists(path) == held
    finally:
        for fd in keep:
            os.close(fd)
        layout._leave()


def test_a_forked_child_leaves_its_parents_records(tmp_path):
    env = {"OMPI_MCA_ess_base_jobid": uuid.uuid4().hex}
    with pytest.raises(LayoutTimeoutError):
        exchange(TOPO, fleet_inventory("1x16GiB", "h"), timeout=0.2, directory=str(tmp_path), env=env)
    pid = os.fork()
    if pid == 0:
        layout._leave()
        os._exit(0)
    os.waitpid(pid, 0)
    assert len(list((tmp_path / private.user_folder_name()).rglob("0.1.*.json"))) == 1
    layout._leave()
    assert not (tmp_path / private.user_folder_name()).exists()


def test_a_second_round_meets_in_new_records_and_the_first_is_removed(tmp_path):
    code = RANK.replace('plan = distmem.plan_from_env("data")',
                        'distmem.plan_from_env("data"); distmem.reset() if hasattr(distmem, "reset") else None\n'
                        'plan = distmem.plan_from_env("data")\n'
                        'names = sorted(n for d, _, f in os.walk(os.environ["DISTMEM_LAYOUT_DIR"]) for n in f)\n'
                        'print("NAMES " + json.dumps(names), flush=True)')
    job = uuid.uuid4().hex
    procs = []
    for r in range(2):
        env = dict(os.environ, OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK=str(r),
                   OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_MCA_ess_base_jobid=job, DISTMEM_LAYOUT_DIR=str(tmp_path),
                   DISTMEM_FLEET="1x16GiB", DISTMEM_QUIET="1")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        so, se = p.communicate(timeout=120)
        assert p.returncode == 0, se[-3000:]
        names = json.loads(next(ln for ln in so.splitlines() if ln.startswith("NAMES "))[6:])
        assert not any(n.split(".")[1] == "1" and n.startswith(f"{procs.index(p)}.") for n in names
                       if n.endswith(".json")), names  # this rank's round-1 record is gone once round 2 is read
    assert not any(tmp_path.iterdir())


def test_the_host_name_is_one_folder_name():
    assert layout._folder_name("node-1.cluster") == "node-1.cluster"
    for hostile in ("..", "../../etc", "a/b", ".hidden", ""):
        name = layout._folder_name(hostile)
        assert "/" not in name and name not in (".", "..") and not name.startswith("."), name
    assert layout._folder_name("a/b") != layout._folder_name("a_b")
