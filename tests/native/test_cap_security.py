"""Nobody else's job (issue 26, findings 5-9): on a node shared with other users, the GPU-wide
budget (DISTMEM_CAP_GPU_BYTES) must not let another user hang, crash, poison or fill it, must not
fail open when its table is damaged, must give a forked child its own share, and must reclaim a
dead process's share without reading other processes' /proc.

The cross-user tests run victim and attacker as two real Unix users created for the test (root
only; removed afterwards, failed test or not); the attacker is tests/native/c/capattack.c. Every
process runs with a timeout, so a hang shows up as a failure naming it, not as a stuck suite.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from unix_users import MiB, fake_uuid_hex, require_root

HERE = os.path.dirname(os.path.abspath(__file__))
BUDGET = 1024 * MiB


def _uuid(tag: str) -> str:
    return f"sec-{tag}-{os.getpid()}"


def _table_paths(shm: str, uuid: str, uid: int) -> dict:
    """Where a table for this GPU and user lives: format 1 (one file for every user, straight in the
    base folder, as distmem had it before per-user tables) and format 2 (in the user's own folder)."""
    hexid = fake_uuid_hex(uuid)
    user_dir = os.path.join(shm, f"distmem-cap-u{uid}")
    return {"v1": os.path.join(shm, f"distmem-cap-{hexid}"), "dir": user_dir,
            "v2": os.path.join(user_dir, f"distmem-cap-v2-{hexid}")}


def _reach(node, attacker) -> dict:
    return node.run(attacker, [node.prog("capattack"), "reach", node.shm]).op("reach")


# ---- finding 5: a lock another user can hold forever --------------------------------------------------

def test_another_user_cannot_hang_allocations(users, node):
    victim, attacker = users.user("v"), users.user("a")
    env = node.env(_uuid("hang"))
    holder = node.start(victim, [node.prog("capdrv"), "alloc", str(100 * MiB), "touch", node.sync("v1"),
                                 "waitfile", node.sync("done")], env)
    node.wait_file("v1", proc=holder)
    node.start(attacker, [node.prog("capattack"), "hold", node.shm, node.sync("held"), "120"])
    node.wait_file("held")
    second = node.run(victim, [node.prog("capdrv"), "alloc", str(100 * MiB), "shared"], env, timeout=15,
                      what=f"a capped cuMemAlloc of user {victim.name} while user {attacker.name} holds every "
                           "lock of the GPU's table it can open (finding 5)")
    assert second.allocs() == [0], second.stderr
    assert second.op("shared")["used"] == 200 * MiB
    node.touch("done")
    assert node.finish(holder).rc == 0
    reach = _reach(node, attacker)
    assert reach["reached"] == 0, f"user {attacker.name} can open another user's table for writing: {reach}"


# ---- finding 6: a damaged table crashes or turns the budget off ------------------------------------------

def _plant(path: str, kind: str) -> str:
    """Shell text that leaves at ``path`` what a killed creator or an attacker leaves: an empty file
    or a full-size one without its header."""
    return f": > '{path}'" if kind == "empty" else f"head -c 12392 /dev/zero > '{path}'"


def _two_victims(node, victim, env):
    first = node.start(victim, [node.prog("capdrv"), "alloc", str(600 * MiB), "touch", node.sync("v1"),
                                "waitfile", node.sync("done")], env)
    try:
        node.wait_file("v1", proc=first, timeout=30)
    except AssertionError:
        pass  # it may have crashed or stopped: judged below from its exit status
    second = node.run(victim, [node.prog("capdrv"), "alloc", str(600 * MiB), "shared"], env, timeout=30)
    node.touch("done")
    return node.finish(first), second


def _fails_closed(first, second, *names):
    first.not_killed("the first capped process")
    second.not_killed("the second capped process")
    granted = (first.allocs() + second.allocs()).count(0)
    assert granted * 600 * MiB <= BUDGET, (f"{granted} x 600 MiB granted under a 1 GiB GPU-wide budget: the "
                                           f"damaged table turned the budget off\n{first.stderr}\n{second.stderr}")
    said = first.stderr + second.stderr
    assert any(n in said for n in names), f"no message names the table ({names}):\n{said}"


@pytest.mark.parametrize("kind", ["empty", "zeros"])
def test_a_table_planted_by_another_user_fails_closed(users, node, kind):
    victim, attacker = users.user("v"), users.user("a")
    uuid = _uuid(f"plant-{kind}")
    paths = _table_paths(node.shm, uuid, victim.uid)
    script = f"umask 0; {_plant(paths['v1'], kind)}; mkdir '{paths['dir']}' && {_plant(paths['v2'], kind)}"
    planted = node.run(attacker, ["/bin/sh", "-c", script])
    assert planted.rc == 0, planted.stderr
    first, second = _two_victims(node, victim, node.env(uuid))
    _fails_closed(first, second, paths["dir"], paths["v1"])


@pytest.mark.parametrize("kind", ["empty", "zeros"])
def test_a_table_left_half_made_fails_closed(node, kind):
    """The user's own leftovers: a creator killed between open and ftruncate (empty) or before its
    header (zeros) left the file under the table's name."""
    uuid = _uuid(f"half-{kind}")
    paths = _table_paths(node.shm, uuid, os.geteuid())
    os.mkdir(paths["dir"], 0o700)
    for p in (paths["v1"], paths["v2"]):
        subprocess.run(["/bin/sh", "-c", "umask 077; " + _plant(p, kind)], check=True, timeout=30)
    first, second = _two_victims(node, None, node.env(uuid))
    _fails_closed(first, second, paths["v2"], paths["v1"])


# ---- finding 7 (and 6 live): another user rewrites or truncates the table ------------------------------

@pytest.mark.parametrize("attack", ["fill", "zero", "poison", "truncate"])
def test_another_user_cannot_rewrite_the_table(users, node, attack):
    victim, attacker = users.user("v"), users.user("a")
    env = node.env(_uuid(attack))
    holder = node.start(victim, [node.prog("capdrv"), "alloc", str(600 * MiB), "touch", node.sync("v1"),
                                 "waitfile", node.sync("go"), "alloc", str(100 * MiB), "shared",
                                 "touch", node.sync("v1b"), "waitfile", node.sync("done")], env)
    node.wait_file("v1", proc=holder)
    hit = node.run(attacker, [node.prog("capattack"), attack, node.shm])
    assert hit.rc == 0, hit.stderr
    second = node.run(victim, [node.prog("capdrv"), "alloc", str(600 * MiB), "alloc", str(300 * MiB), "shared"],
                      env, timeout=30)
    node.touch("go")
    node.touch("done")
    first = node.finish(holder)
    first.not_killed("the process holding 600 MiB")
    second.not_killed("the second capped process")
    # 600 MiB held: another 600 would pass the 1 GiB budget, 300 fits, and so do the holder's 100.
    assert second.allocs() == [2, 0], f"after '{attack}' by {attacker.name}: {second.allocs()}\n{second.stderr}"
    assert first.allocs() == [0, 0], first.stderr
    assert hit.op(attack)["reached"] == 0, f"user {attacker.name} could open the victim's table: {hit.ops}"


# ---- findings 7 (start == 0) and 9 (hidepid=2): a dead process's pid given to another -----------------

def _pid_reuse(node, *, victim=None, squatter=None, hidepid=False, first_without_proc=False):
    require_root()
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        pytest.fail("unshare and setpriv (util-linux) are needed to give a dead process's pid to another")
    probe = subprocess.run(["unshare", "--pid", "--mount", "--fork", "--mount-proc", "true"], capture_output=True,
                           text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"root here may not make PID namespaces (no CAP_SYS_ADMIN?): {probe.stderr.strip()[-200:]}")
    env = node.env(_uuid("pidns"))
    spec = {"env": env, "capdrv": node.prog("capdrv"), "bytes": 600 * MiB, "hidepid": hidepid,
            "first_without_proc": first_without_proc,
            "victim": [victim.uid, victim.gid] if victim else None,
            "squatter": [squatter.uid, squatter.gid] if squatter else None}
    proc = subprocess.run(["unshare", "--pid", "--mount", "--fork", "--mount-proc", sys.executable,
                           os.path.join(HERE, "pidns_driver.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"the pid-namespace driver failed:\n{proc.stdout}\n{proc.stderr}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["first"]["rc"] == -9, got["first"]
    assert got["squatter_pid"] == got["first"]["pid"], f"the pid was not reused: {got}"
    second = got["second"]
    allocs = [json.loads(ln)["rc"] for ln in second["stdout"].splitlines() if ln.startswith('{"op":"alloc"')]
    return second, allocs


def test_a_dead_share_is_reclaimed_under_hidepid(users, node):
    victim, other = users.user("v"), users.user("o")
    second, allocs = _pid_reuse(node, victim=victim, squatter=other, hidepid=True)
    assert second["rc"] == 0, second
    assert allocs == [0], ("the dead process's 600 MiB was never given back once another user's process took "
                           f"its pid under hidepid=2 (finding 9):\n{second['stderr']}")


def test_a_process_without_proc_is_not_alive_forever(node):
    """A process that could not read /proc/self/stat recorded start time 0, which counted as "always
    alive": its share stayed after its death once its pid was reused."""
    second, allocs = _pid_reuse(node, first_without_proc=True)
    assert second["rc"] == 0, second
    assert allocs == [0], f"a dead process's share stayed (finding 7, start == 0):\n{second['stderr']}"


# ---- finding 8: fork without exec --------------------------------------------------------------------

def test_a_forked_child_that_allocates_is_counted(node):
    """Parent capped, not yet on the GPU, forks; the child allocates and holds; another process asks."""
    env = node.env(_uuid("fork-a"))
    # The fork comes a while after the parent's start, as in any real program (the kernel's start
    # times tick at 100 Hz: a fork in the first tick would look like the parent).
    parent = node.start(None, [node.prog("capdrv"), "sleepms", "100", "fork", node.sync("child.out"),
                               "alloc", str(600 * MiB), "touch", node.sync("c"), "waitfile", node.sync("done"),
                               "endchild", "waitfile", node.sync("done"), "reap"], env)
    node.wait_file("c", proc=parent)
    other = node.run(None, [node.prog("capdrv"), "alloc", str(600 * MiB), "shared"], env)
    node.touch("done")
    assert node.finish(parent).op("reap") == {"op": "reap", "children": 1, "failed": 0}
    assert other.allocs() == [2], ("the forked child's 600 MiB was dropped as a reused pid: 1.2 GiB granted "
                                   f"under a 1 GiB budget (finding 8)\n{other.stderr}")
    assert other.op("shared")["used"] == 600 * MiB


@pytest.mark.parametrize("budget", [None, "1GiB"], ids=["own-cap", "with-budget"])
def test_forked_child_accounting(node, budget):
    """Parent holds 600 MiB of its 1 GiB cap and forks. The child holds none of its parent's memory
    (a CUDA context does not survive fork), so it has its own 1 GiB cap; under a GPU budget its
    allocations are its own, and outlive the parent's share."""
    env = node.env(_uuid(f"fork-b-{budget}"), budget=budget)
    parent = node.start(None, [node.prog("capdrv"), "alloc", str(600 * MiB), "fork", node.sync("child.out"),
                               "alloc", str(300 * MiB), "status", "touch", node.sync("c"),
                               "waitfile", node.sync("done"), "endchild",
                               "waitfile", node.sync("c"), "status"], env)
    done = node.finish(parent)
    assert done.rc == 0, done.stderr
    with open(node.sync("child.out")) as f:
        child = [json.loads(ln) for ln in f if ln.startswith("{")]
    child_allocs = [o["rc"] for o in child if o["op"] == "alloc"]
    child_dev0 = [o for o in child if o["op"] == "status"][0]["devices"][0]
    parent_dev0 = done.op("status")["devices"][0]
    assert child_allocs == [0], f"the child was charged its parent's 600 MiB (finding 8): {child}"
    assert child_dev0["used"] == 300 * MiB and parent_dev0["used"] == 600 * MiB, (child_dev0, parent_dev0)
    if budget:
        # The parent has exited; the child still holds 300 MiB: 800 more would pass 1 GiB.
        other = node.run(None, [node.prog("capdrv"), "alloc", str(800 * MiB), "alloc", str(700 * MiB), "shared"], env)
        assert other.allocs() == [2, 0], (f"the child's 300 MiB went with its parent's share (finding 8): "
                                          f"{other.allocs()}\n{other.stderr}")
    node.touch("done")


# ---- the group setting: a budget across users, on purpose ----------------------------------------------

def test_a_group_budget_is_shared_with_its_members_only(users, node):
    import stat
    gid = users.group("g")
    a, b = users.user("a", groups=[gid]), users.user("b", groups=[gid])
    outsider = users.user("x")
    uuid = _uuid("group")
    env = node.env(uuid, DISTMEM_CAP_SHM_GROUP=str(gid))
    holder = node.start(a, [node.prog("capdrv"), "alloc", str(600 * MiB), "touch", node.sync("a"),
                            "waitfile", node.sync("done")], env)
    node.wait_file("a", proc=holder)
    member = node.run(b, [node.prog("capdrv"), "alloc", str(600 * MiB), "alloc", str(300 * MiB), "shared"], env)
    assert member.allocs() == [2, 0], member.stderr
    assert member.op("shared")["processes"] == 2 and member.op("shared")["used"] == 900 * MiB
    folder = os.path.join(node.shm, f"distmem-cap-g{gid}")
    d = os.lstat(folder)
    (name,) = os.listdir(folder)
    t = os.lstat(os.path.join(folder, name))
    assert (d.st_gid, stat.S_IMODE(d.st_mode)) == (gid, 0o2770), oct(d.st_mode)
    assert (t.st_gid, stat.S_IMODE(t.st_mode)) == (gid, 0o660), oct(t.st_mode)
    assert _reach(node, outsider)["reached"] == 0, "a non-member can open the group's table"
    intruder = node.run(outsider, [node.prog("capdrv"), "alloc", str(MiB)], env)
    assert intruder.allocs() == [2] and "not a member" in intruder.stderr, intruder.stderr
    # Without the setting, b's budget is b's own: a's 600 MiB is not in it.
    alone = node.run(b, [node.prog("capdrv"), "alloc", str(600 * MiB)], node.env(uuid))
    assert alone.allocs() == [0], alone.stderr
    node.touch("done")
    assert node.finish(holder).rc == 0
