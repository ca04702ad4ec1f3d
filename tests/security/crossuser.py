"""Two real Unix users for the security tests: a victim and an attacker, made with ``useradd`` for
one test module and removed after it with ``userdel -r``, even when a test fails.

Each step runs as its user through ``setpriv --reuid/--regid --clear-groups`` (a real uid, no
supplementary groups, no capabilities). One allowance, where it is needed and only for the
victim's Python: the test environment's interpreter and packages live under root's 0700 home
here, which another user cannot traverse, so the victim's Python processes get the single
capability ``CAP_DAC_READ_SEARCH`` (read and search, never write, never another uid's ownership).
Every check the code under test makes - owners, modes, ``O_NOFOLLOW``, locks - is unaffected by
it, and the attacker never has it: the attacker's steps are plain shell commands without any
capability, so what the attacker can read or write is exactly what the file modes allow.
"""
from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

__all__ = ["User", "Users", "unavailable", "ROOT", "ENV_BIN", "SYSTEM_PYTHON", "shared_folder", "wait_for"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_COMMENT = "distmem security test (pid {pid})"
_NAME = re.compile(r"^dms[0-9a-f]{6}[va]$")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The session folders of a user's MPI singletons (:meth:`Users.env`): ``/tmp/PREFIX<uid>-<random>``.
OMPI_TMP_PREFIX = "dms-ompi-"


def unavailable() -> Optional[str]:
    """Why two users cannot be made here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "the cross-user tests create two Unix users (useradd) and run as them: they need root"
    for tool in ("useradd", "userdel", "setpriv"):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":" + SYSTEM_PATH) is None:
            return f"{tool} is not installed"
    return None


@dataclass
class User:
    name: str
    uid: int
    gid: int
    home: str


def _sweep_left_users() -> None:
    """Remove test users a killed earlier run left (their creating process is gone)."""
    for entry in pwd.getpwall():
        m = re.match(r"^distmem security test \(pid (\d+)\)$", entry.pw_gecos or "")
        if m and _NAME.match(entry.pw_name) and not os.path.exists(f"/proc/{m.group(1)}"):
            subprocess.run(["userdel", "-r", "-f", entry.pw_name], capture_output=True, timeout=60)


class Users:
    """A victim and an attacker; :meth:`remove` deletes both (and their homes)."""

    def __init__(self) -> None:
        _sweep_left_users()
        tag = uuid.uuid4().hex[:6]
        self.made: List[User] = []
        self.victim = self._make(f"dms{tag}v")
        self.attacker = self._make(f"dms{tag}a")
        self._python_needs_read = self._needs_read_capability()

    def _make(self, name: str) -> User:
        home = f"/tmp/{name}-home"
        subprocess.run(["useradd", "-m", "-d", home, "-s", "/bin/sh", "-c", _COMMENT.format(pid=os.getpid()), name],
                       check=True, capture_output=True, timeout=60)
        entry = pwd.getpwnam(name)
        os.chmod(home, 0o700)
        user = User(name, entry.pw_uid, entry.pw_gid, home)
        self.made.append(user)
        return user

    def python_launcher(self) -> str:
        """A world-readable ``python`` that runs this environment's: for launchers (mpirun checks
        ``access(X_OK)``, which ignores the victim's read capability, before it starts a rank)."""
        if getattr(self, "_wrapper", None) is None:
            import tempfile

            folder = tempfile.mkdtemp(prefix="dms-python-", dir="/tmp")
            os.chmod(folder, 0o755)
            path = os.path.join(folder, "python")
            with open(path, "w") as f:
                f.write(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
            os.chmod(path, 0o755)
            self._wrapper = path
        return self._wrapper

    def remove(self) -> None:
        wrapper = getattr(self, "_wrapper", None)
        if wrapper:
            shutil.rmtree(os.path.dirname(wrapper), ignore_errors=True)
        for user in self.made:
            subprocess.run(["userdel", "-r", "-f", user.name], capture_output=True, timeout=60)
            shutil.rmtree(user.home, ignore_errors=True)
            for folder in (f"/dev/shm/distmem-layout-{user.uid}", f"/tmp/distmem-layout-{user.uid}"):
                shutil.rmtree(folder, ignore_errors=True)
            for entry in os.listdir("/tmp"):
                if entry.startswith(f"{OMPI_TMP_PREFIX}{user.uid}-"):
                    shutil.rmtree(os.path.join("/tmp", entry), ignore_errors=True)

    def _needs_read_capability(self) -> bool:
        probe = subprocess.run(self._prefix(self.victim, False) + [sys.executable, "-c", "import numpy"],
                               capture_output=True, timeout=120, env={"PATH": SYSTEM_PATH})
        return probe.returncode != 0

    @staticmethod
    def _prefix(user: User, read_capability: bool) -> List[str]:
        cmd = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups"]
        if read_capability:
            cmd += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
        return cmd

    def env(self, user: User, extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """A clean environment for ``user``: its home, the system PATH, this checkout on PYTHONPATH."""
        env = {"PATH": SYSTEM_PATH, "HOME": user.home, "USER": user.name, "LOGNAME": user.name, "LANG": "C.UTF-8",
               "PYTHONPATH": ROOT, "PYTHONDONTWRITEBYTECODE": "1", "DISTMEM_QUIET": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
        env.update(extra or {})
        if "OMPI_COMM_WORLD_RANK" in env and "OMPI_MCA_orte_tmpdir_base" not in env:
            # A rank given Open MPI's variables without mpirun starts MPI as a singleton, and two
            # singletons of a new user started together race to make /tmp/ompi.HOST.UID (Open MPI
            # 4.1: "mkdir ... File exists", orte_init fails): each gets a session folder of its own,
            # removed with the user (:meth:`remove`).
            env["OMPI_MCA_orte_tmpdir_base"] = f"/tmp/{OMPI_TMP_PREFIX}{user.uid}-{uuid.uuid4().hex[:8]}"
        return env

    def python(self, user: User, code: str, *args: str, env: Optional[Mapping[str, str]] = None,
               cwd: Optional[str] = None, timeout: float = 120, umask: Optional[int] = None,
               wait: bool = True) -> "subprocess.CompletedProcess[str] | subprocess.Popen[str]":
        """Run ``python -c code args`` as ``user`` (the victim's side: distmem's own code); a ``code``
        that is an absolute path to a ``.py`` file runs that script instead (its folder, not the
        working folder, first on its path, as for any script)."""
        run = [code] if os.path.isabs(code) and code.endswith(".py") else ["-c", code]
        argv = self._prefix(user, self._python_needs_read) + [sys.executable, *run, *args]
        return self._start(argv, user, env, cwd, timeout, umask, wait)

    def run(self, user: User, argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None,
            cwd: Optional[str] = None, timeout: float = 120, umask: Optional[int] = None,
            wait: bool = True) -> "subprocess.CompletedProcess[str] | subprocess.Popen[str]":
        """Run ``argv`` as ``user`` with what the victim's Python needs (a launcher, the ``distmem``
        script: programs that start this environment's Python)."""
        return self._start(self._prefix(user, self._python_needs_read) + list(argv), user, env, cwd, timeout, umask,
                           wait)

    def shell(self, user: User, script: str, *, env: Optional[Mapping[str, str]] = None,
              cwd: Optional[str] = None, timeout: float = 60) -> "subprocess.CompletedProcess[str]":
        """Run ``sh -c script`` as ``user`` with no capability at all (the attacker's side)."""
        argv = self._prefix(user, False) + ["/bin/sh", "-c", script]
        return self._start(argv, user, env, cwd, timeout, None, True)  # type: ignore[return-value]

    def _start(self, argv: Sequence[str], user: User, env: Optional[Mapping[str, str]], cwd: Optional[str],
               timeout: float, umask: Optional[int], wait: bool):
        full = self.env(user, env)
        cwd = cwd or user.home
        preexec = (lambda: os.umask(umask)) if umask is not None else None
        if not wait:
            return subprocess.Popen(list(argv), env=full, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, preexec_fn=preexec, start_new_session=True)
        return subprocess.run(list(argv), env=full, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=preexec)


#: The environment's bin folder (its launchers, the ``distmem`` script) and the system's own Python,
#: which the attacker - who cannot read the environment under root's home - runs its steps with.
ENV_BIN = os.environ.get("DISTMEM_ENV_BIN") or os.path.dirname(sys.executable)
SYSTEM_PYTHON = "/usr/bin/python3"


def shared_folder(users: Users, mode: int = 0o1777) -> str:
    """A folder of the attacker's that everyone may write (1777 like /tmp; 0777: a shared project
    folder without the sticky bit, in which anyone may also rename or remove others' files)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="dms-shared-", dir="/tmp")
    os.chown(folder, users.attacker.uid, users.attacker.gid)
    os.chmod(folder, mode)
    return folder


def wait_for(test, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not test():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
