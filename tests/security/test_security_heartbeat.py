"""The fail-fast heartbeat between two real users (issue 36, findings 2, 3 and 5): the victim runs a
real job (mpirun, horovodrun --gloo) with fail fast on, as by default; the attacker is another local
user with no rights beyond that, running the system's own Python.

Each test failed on the code before the authenticated heartbeat (02c3033): one line of 60,000 ``[``
or a non-ASCII token killed rank 0's hub thread, so a rank killed afterwards went unnoticed (2); the
hub's token, read from horovodrun's rendezvous server, let the attacker stop every rank with a death
line of its own text (3); 1,200 idle connections took rank 0's descriptors (5).
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

import pytest

from crossuser import ENV_BIN, ROOT, SYSTEM_PYTHON, wait_for

PROG = os.path.join(ROOT, "tests", "security", "progs", "hb_job.py")

#: The attacker's side, in the system's Python (no access to the test environment).
ATTACK = r'''
import json, socket, sys, time, urllib.request
what, port = sys.argv[1], int(sys.argv[2])


def hub():
    s = socket.create_connection(("127.0.0.1", port), timeout=3)
    s.settimeout(3)
    return s


if what == "garbage":
    for line in ['{"t": "hello", "token": "\u00e9\u00e9", "rank": 1, "host": "x"}\n', "[" * 60000 + "\n"]:
        s = hub()
        try:
            s.sendall(line.encode())
            s.recv(100)
        except OSError:
            pass
        s.close()
    print("SENT", flush=True)
elif what == "flood":
    held = []
    for _ in range(int(sys.argv[3])):
        try:
            held.append(hub())
        except OSError as exc:
            print("REFUSED", exc, flush=True)
            break
    print("HELD", len(held), flush=True)
    time.sleep(float(sys.argv[4]))
elif what == "steal":
    # horovodrun's rendezvous server: anyone who finds its port may read it.
    try:
        got = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/distmem-heartbeat/hub-1", timeout=5).read())
    except Exception as exc:
        got = {"error": str(exc)}
    print("STORE", json.dumps(got), flush=True)
    token = got.get("token")
    if token:
        s = socket.create_connection((got["addrs"][0] if got.get("addrs") else "127.0.0.1", got["port"]), timeout=3)
        s.sendall((json.dumps({"t": "hello", "token": token, "rank": 1, "host": "\x1b]0;owned\x07"}) + "\n").encode())
        s.sendall((json.dumps({"t": "fail", "cause": "failed (\x1b[31mowned by the attacker\x1b[0m)"}) + "\n").encode())
        time.sleep(0.5)
        s.close()
        print("USED THE TOKEN", flush=True)
'''


@pytest.fixture
def attack(users):
    folder = tempfile.mkdtemp(prefix="dms-attack-", dir="/tmp")
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "attack.py")
    with open(path, "w") as f:
        f.write(ATTACK)
    os.chmod(path, 0o644)

    def run(*args: str, wait: bool = True, timeout: float = 60):
        cmd = " ".join([SYSTEM_PYTHON, path, *args])
        if wait:
            return users.shell(users.attacker, cmd, timeout=timeout)
        import subprocess

        return subprocess.Popen(users._prefix(users.attacker, False) + ["/bin/sh", "-c", cmd],
                                env=users.env(users.attacker), cwd="/", stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    yield run
    shutil.rmtree(folder, ignore_errors=True)


class Job:
    """The victim's job, its files in a folder of the victim's own."""

    def __init__(self, users, launcher: str, np_: int = 3, **env: str):
        self.users, self.np = users, np_
        self.out = os.path.join(users.victim.home, f"hb-{launcher}-{time.monotonic_ns()}")
        users.shell(users.victim, f"mkdir -m 700 {self.out}")
        base = {"HB_OUT": self.out, "DISTMEM_TIMEOUT": "30", "OMPI_MCA_btl": "self,vader,tcp",
                "OMPI_MCA_btl_vader_single_copy_mechanism": "none", "PATH": ENV_BIN + ":/usr/bin:/bin"}
        base.update(env)
        py = users.python_launcher()
        if launcher == "mpirun":
            argv = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none",
                    "--mca", "orte_abort_on_non_zero_status", "0"]
            for key in ("HB_OUT", "HB_NOFILE", "DISTMEM_TIMEOUT", "PYTHONPATH", "OMPI_MCA_btl",
                        "OMPI_MCA_btl_vader_single_copy_mechanism"):
                if key in base or key == "PYTHONPATH":
                    argv += ["-x", key]
            argv += [py, PROG]
        else:  # horovodrun --gloo, as the victim runs it
            argv = ["/bin/sh", os.path.join(ENV_BIN, "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
                    py, PROG]
        self.proc = users.run(users.victim, argv, env=base, cwd=users.victim.home, wait=False)

    def file(self, name: str):
        try:
            with open(os.path.join(self.out, name)) as f:
                return f.read()
        except OSError:
            return None

    def started(self) -> str:
        wait_for(lambda: all(self.file(f"pid-{r}") for r in range(self.np)) or self.proc.poll() is not None, 120,
                 "every rank of the victim's job")
        assert self.proc.poll() is None, self.tail()
        return self.file("port")

    def pid(self, rank: int) -> int:
        return int(self.file(f"pid-{rank}"))

    def alive(self, rank: int) -> bool:
        try:
            with open(f"/proc/{self.pid(rank)}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def lines(self, rank: int):
        return [ln for ln in (self.file(f"stderr-{rank}.txt") or "").splitlines() if ln.startswith("distmem: rank")]

    def stop(self, timeout: float = 60):
        open(os.path.join(self.out, "stop"), "w").close()
        try:
            self.proc.wait(timeout)
        except Exception:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def tail(self) -> str:
        out = (self.proc.stdout.read() + self.proc.stderr.read()) if self.proc.poll() is not None else ""
        return out[-2000:] + "\n" + "\n".join(f"[{r}] {(self.file(f'stderr-{r}.txt') or '')[-1500:]}"
                                             for r in range(self.np))


def test_a_strangers_bytes_never_stop_the_hub(users, attack):
    """Finding 2: after another user's non-ASCII token and a line of 60,000 '[', the hub must still
    watch the job: a rank SIGKILLed afterwards is named on every other rank within seconds."""
    job = Job(users, "mpirun")
    try:
        port = job.started()
        res = attack("garbage", port)
        assert "SENT" in res.stdout, res.stderr
        time.sleep(1.5)
        os.kill(job.pid(2), signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: not job.alive(0) and not job.alive(1) or time.monotonic() - t0 > 10, 15, "the survivors")
        for r in (0, 1):
            assert not job.alive(r), f"rank {r} still runs 10 s after rank 2 was killed: the hub was dead\n{job.tail()}"
            assert any(ln.startswith("distmem: rank 2 (host ") for ln in job.lines(r)), job.tail()
    finally:
        job.kill()


def test_the_heartbeats_secret_is_not_in_horovodruns_store(users, attack):
    """Finding 3: the attacker reads horovodrun's rendezvous server. Before, it held the hub's token
    and the attacker stopped every rank with a death line of its own text (terminal escapes in
    it); now it holds an address, a nonce and a MAC, nothing to say hello with: the job runs on."""
    job = Job(users, "horovodrun", np_=2)
    try:
        job.started()
        res = attack("steal", job.file("store"))
        assert "STORE" in res.stdout, res.stderr
        time.sleep(2.0)
        assert "USED THE TOKEN" not in res.stdout, f"the store held the token: {res.stdout}"
        assert job.alive(0) and job.alive(1), f"the job was stopped by the attacker\n{job.tail()}"
        rc = job.stop()
        assert rc == 0 and job.lines(0) == job.lines(1) == [], job.tail()
        for r in (0, 1):
            assert "\x1b" not in (job.file(f"stderr-{r}.txt") or "")
    finally:
        job.kill()


def test_idle_connections_never_take_rank_0s_descriptors(users, attack):
    """Finding 5: 1,200 connections that never say hello used rank 0's descriptors (soft limit 1024,
    the usual default): its next open() failed with EMFILE. Now the hub holds a bounded number."""
    job = Job(users, "mpirun", HB_NOFILE="1024")
    try:
        port = job.started()
        flood = attack("flood", port, "1200", "8", wait=False)
        time.sleep(5.0)  # the attacker holds its connections
        held = len(os.listdir(f"/proc/{job.pid(0)}/fd"))
        rc = job.stop()
        flood.kill()
        assert job.file("opened-0") == "ok", f"rank 0 ran out of descriptors ({held} open): {job.file('opened-0')}"
        assert rc == 0, job.tail()
    finally:
        job.kill()
