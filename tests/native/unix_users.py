"""Real Unix users and a simulated shared node for the native cap's security tests.

``Users`` creates users (``useradd``) and groups (``groupadd``) with fresh random names and removes
them on ``close()``, which the fixture calls even when the test failed. ``Node`` is what two users
share on a node: a sticky world-writable folder standing in for /dev/shm (the GPU budget's tables
go under it), a folder for the tests' rendezvous files, the programs in a world-readable copy, and
every process the test started (killed at teardown by the Popen objects the test holds, nothing
else). Creating users needs root: without it the fixtures skip, saying so.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

__all__ = ["User", "Users", "Node", "require_root", "fake_uuid_hex"]

MiB = 1024**2


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip(f"needs root to create Unix users with useradd (this test runs as uid {os.geteuid()})")
    for tool in ("useradd", "userdel", "groupadd", "groupdel"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not on PATH; install the passwd package (shadow utils)")


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: Tuple[int, ...] = ()


class Users:
    """Creates users and groups for one test; ``close()`` removes them all."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(3)
        self.users: List[User] = []
        self.groups: List[str] = []

    def group(self, tag: str) -> int:
        name = f"dmt{self.token}{tag}"
        subprocess.run(["groupadd", name], check=True, capture_output=True, timeout=30)
        self.groups.append(name)
        import grp
        return grp.getgrnam(name).gr_gid

    def user(self, tag: str, groups: Sequence[int] = ()) -> User:
        import grp
        import pwd
        name = f"dmt{self.token}{tag}"
        cmd = ["useradd", "--no-create-home", "--user-group", "--shell", "/bin/false"]
        if groups:
            cmd += ["--groups", ",".join(grp.getgrgid(g).gr_name for g in groups)]
        subprocess.run(cmd + [name], check=True, capture_output=True, timeout=30)
        pw = pwd.getpwnam(name)
        user = User(name, pw.pw_uid, pw.pw_gid, tuple(groups))
        self.users.append(user)
        return user

    def close(self) -> None:
        errors = []
        for user in self.users:
            proc = subprocess.run(["userdel", "--force", user.name], capture_output=True, text=True, timeout=30)
            if proc.returncode not in (0, 6):  # 6: no such user
                errors.append(f"userdel {user.name}: {proc.stderr.strip()}")
        for name in self.groups:
            proc = subprocess.run(["groupdel", name], capture_output=True, text=True, timeout=30)
            if proc.returncode not in (0, 6):
                errors.append(f"groupdel {name}: {proc.stderr.strip()}")
        if errors:
            raise AssertionError("could not remove the test users: " + "; ".join(errors))


def fake_uuid_hex(seed: str, dev: int = 0) -> str:
    """The UUID tests/native/c/fake_cuda.c reports for FAKE_CUDA_UUID=seed, as 32 hex digits."""
    u = bytearray(16)
    for i, ch in enumerate(seed.encode()):
        u[i % 15] ^= ch
    u[15] = dev
    return u.hex()


@dataclass
class Node:
    """A shared node: the table base folder, rendezvous files, the programs, the started processes."""

    programs: str                     # world-readable folder with the library, fake driver, capdrv, capattack
    root: str = field(default="")
    shm: str = field(default="")
    procs: List[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="distmem-node-", dir="/tmp")
        os.chmod(self.root, 0o755)
        self.shm = os.path.join(self.root, "shm")
        os.mkdir(self.shm)
        os.chmod(self.shm, 0o1777)  # as /dev/shm
        os.mkdir(os.path.join(self.root, "sync"))
        os.chmod(os.path.join(self.root, "sync"), 0o1777)

    def prog(self, name: str) -> str:
        return os.path.join(self.programs, name)

    def sync(self, name: str) -> str:
        return os.path.join(self.root, "sync", name)

    def env(self, uuid: str, *, cap: str = "1GiB", budget: Optional[str] = "1GiB", **extra: str) -> Dict[str, str]:
        env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": self.programs,
               "LD_PRELOAD": self.prog("libdistmem_cap.so"), "DISTMEM_CAP_BYTES": cap,
               "DISTMEM_CAP_SHM_DIR": self.shm, "FAKE_CUDA_UUID": uuid}
        if budget is not None:
            env["DISTMEM_CAP_GPU_BYTES"] = budget
        env.update(extra)
        return env

    def start(self, user: Optional[User], cmd: List[str], env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        kw = {}
        if user is not None:
            kw = dict(user=user.uid, group=user.gid, extra_groups=list(user.groups))
        proc = subprocess.Popen(cmd, env=env if env is not None else {"PATH": "/usr/bin:/bin"}, cwd="/", umask=0o022,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        self.procs.append(proc)
        return proc

    def run(self, user: Optional[User], cmd: List[str], env: Optional[Dict[str, str]] = None,
            timeout: float = 30, what: str = "") -> "Finished":
        return self.finish(self.start(user, cmd, env), timeout=timeout, what=what or " ".join(cmd))

    @staticmethod
    def finish(proc: subprocess.Popen, timeout: float = 30, what: str = "") -> "Finished":
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"{what or proc.args} did not finish within {timeout:g} s (hung); it was killed.\n"
                                 f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
        ops = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return Finished(proc.returncode, ops, err, out)

    def wait_file(self, name: str, timeout: float = 30, proc: Optional[subprocess.Popen] = None) -> None:
        path = self.sync(name)
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if proc is not None and proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"{proc.args} exited with {proc.returncode} before {name} appeared\n"
                                     f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{path} did not appear within {timeout:g} s")
            time.sleep(0.01)

    def touch(self, name: str) -> None:
        with open(self.sync(name), "w"):
            pass

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            try:
                proc.communicate(timeout=30)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class Finished:
    rc: int
    ops: List[Dict]
    stderr: str
    stdout: str

    def allocs(self) -> List[int]:
        return [o["rc"] for o in self.ops if o.get("op") == "alloc"]

    def op(self, name: str) -> Dict:
        found = [o for o in self.ops if o.get("op") == name]
        assert found, f"no {name!r} in the output:\n{self.stdout}\n{self.stderr}"
        return found[0]

    def not_killed(self, who: str) -> None:
        assert self.rc >= 0, (f"{who} was killed by signal {-self.rc} ({signal.Signals(-self.rc).name})\n"
                              f"stdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-3000:]}")
