"""A simulated multi-host cluster on one Linux machine, for launch tests with real launchers.

Each host is a set of namespaces held open by one idle process: its own network namespace (one
veth link named ``dm0``, address ``10.203.77.<i+1>/24``), its own UTS namespace (its hostname)
and its own mount namespace (the cluster's hosts file bound over ``/etc/hosts``). The veths'
other ends sit on a bridge inside a separate "switch" namespace, so nothing is added to the
machine's own network and the only addresses used are those on these links. Every host runs its
own ``sshd`` (root login with a key made for this cluster) and, when SLURM is installed, its own
``slurmd``; ``slurmctld`` runs on the first host and one ``munged`` serves all of them through a
socket on the shared filesystem. The filesystem is shared as on a real cluster, so the job's code
and the Python environment are the same paths on every host.

``Cluster(hosts=3).up()`` builds it (about 3 s, SLURM included), ``down()`` removes everything
(daemons, namespaces, temporary files); launch helpers run a real launcher on the first host (the
"login node") with a hard timeout and return a :class:`Result` with the output. Nothing here
knows about distmem: the probe program and the expected values live beside this file.
"""
from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["Cluster", "ClusterUnavailable", "Host", "Result", "unavailable_reason", "slurm_missing", "clean_stale",
           "PREFIX", "IFACE", "SUBNET"]

#: Name prefix of every namespace this harness makes: ``dmcl<slot>-<host letter>``. A cluster holds
#: an flock on ``LOCKS/<prefix><slot>.lock`` while it is up, so two test sessions on one machine take
#: different slots, and a slot whose lock is free but whose namespaces exist was left by a killed run.
PREFIX = "dmcl"
LOCKS = "/run/distmem-cluster"
SLOTS = 8
#: One interface name on every host: horovodrun's --network-interface takes a single name.
IFACE = "dm0"
SUBNET = "10.203.77"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ClusterUnavailable(RuntimeError):
    """The machine cannot host the simulated cluster (not root, a tool missing); the message says which."""


@dataclass
class Result:
    """One launch: exit code, combined output, wall seconds, and whether the hard timeout fired."""

    cmd: str
    rc: int
    out: str
    seconds: float
    timed_out: bool

    def describe(self, tail: int = 12000) -> str:
        state = f"TIMED OUT after {self.seconds:.0f} s" if self.timed_out else f"exit {self.rc} in {self.seconds:.1f} s"
        return f"$ {self.cmd}\n[{state}]\n{self.out[-tail:]}"


@dataclass
class Host:
    """One simulated host: ``name`` is its hostname, ``addr`` its address on ``dm0``."""

    name: str
    netns: str
    addr: str
    holder: Optional[subprocess.Popen] = None
    daemons: Dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        assert self.holder is not None, f"host {self.name} is not up"
        return self.holder.pid


def _which(tool: str) -> Optional[str]:
    return shutil.which(tool, path=os.environ.get("PATH", "") + ":" + SYSTEM_PATH)


def unavailable_reason(slurm: bool = True) -> Optional[str]:
    """Why the cluster cannot be built here, or None when it can (root, ip, unshare, nsenter, sshd)."""
    if os.geteuid() != 0:
        return "the simulated cluster needs root (network, UTS and mount namespaces)"
    tools = ["ip", "unshare", "nsenter", "sshd", "ssh", "ssh-keygen"]
    missing = [t for t in tools if _which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (run scripts/cluster_deps.sh as root)"
    probe = f"{PREFIX}-probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.stdout.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return None


def slurm_missing() -> List[str]:
    """SLURM and munge tools absent on this machine (empty when the SLURM cases can run)."""
    return [t for t in ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "munged") if _which(t) is None]


def _sh(cmd: Sequence[str], timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()} {done.stdout.strip()}")
    return done


def _netns_pids(netns: str) -> List[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=20)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _kill_pids(pids: Sequence[int], grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL whatever is left after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if os.path.exists(f"/proc/{p}") and not _zombie(p)]
            time.sleep(0.05)
        pids = alive
        if not pids:
            return


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _stale_netns(prefix: str) -> List[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    return [line.split()[0] for line in done.stdout.splitlines() if line.startswith(prefix + "-")]


TMP_PREFIX = "distmem-cluster-"


def _clean_tmp(tmp: str) -> List[str]:
    """Kill processes whose command line names a dead run's folder (its munged), then remove the folder."""
    if not os.path.basename(tmp).startswith(TMP_PREFIX) or not os.path.isdir(tmp):
        return []
    pids = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if tmp.encode() + b"/" in f.read():
                    pids.append(pid)
        except OSError:
            continue
    _kill_pids(pids, grace=1.0)
    shutil.rmtree(tmp, ignore_errors=True)
    return [tmp] + [f"pid {p}" for p in pids]


def clean_stale(prefix: str) -> List[str]:
    """Remove ``prefix``'s namespaces (and every process in them), left by an earlier run that was killed.

    Call it only while holding that prefix's lock: a live cluster holds it.
    """
    stale = _stale_netns(prefix)
    for ns in stale:
        _kill_pids(_netns_pids(ns), grace=1.0)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
    return stale


class Cluster:
    """``hosts`` simulated hosts named ``host<a,b,c...>``; ``slurm=None`` starts SLURM where it is installed."""

    def __init__(self, hosts: int = 3, slurm: Optional[bool] = None, python_bin: Optional[str] = None):
        if not 1 <= hosts <= 26:
            raise ValueError(f"hosts={hosts}: between 1 and 26")
        self.count = hosts
        self.prefix = ""
        self.hosts: List[Host] = []
        self.switch = ""
        self._lockfd: Optional[int] = None
        self.want_slurm = slurm
        self.slurm = False
        self.bin = python_bin or os.environ.get("DISTMEM_ENV_BIN") or os.path.dirname(sys.executable)
        self.tmp = ""
        self.munged: Optional[subprocess.Popen] = None
        self.log: List[str] = []
        self._launches = 0

    # ---------------------------------------------------------------- lifecycle
    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r}; hosts are {[h.name for h in self.hosts]}")

    @property
    def names(self) -> List[str]:
        return [h.name for h in self.hosts]

    @property
    def login(self) -> Host:
        """Where the launchers run (and slurmctld): the first host."""
        return self.hosts[0]

    def up(self, timeout: float = 60) -> "Cluster":
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        t0 = time.monotonic()
        self._claim()
        try:
            self.tmp = tempfile.mkdtemp(prefix=TMP_PREFIX)
            # The slot's lock file names this run's folder, so a run killed with SIGKILL is cleaned next time.
            os.ftruncate(self._lockfd, 0)  # type: ignore[arg-type]
            os.pwrite(self._lockfd, f"{os.getpid()} {self.tmp}\n".encode(), 0)  # type: ignore[arg-type]
            self._files()
            self._network()
            for h in self.hosts:
                self._hold(h)
            self._sshd()
            missing = slurm_missing()
            if self.want_slurm is True and missing:
                raise ClusterUnavailable(f"SLURM asked for but missing: {', '.join(missing)} (scripts/cluster_deps.sh)")
            if self.want_slurm is not False and not missing:
                self._slurm(deadline=t0 + timeout)
            self._wait_ssh(deadline=t0 + timeout)
        except BaseException:
            self.down()
            raise
        self.log.append(f"cluster up in {time.monotonic() - t0:.1f} s: {', '.join(self.names)}"
                        + (" with SLURM" if self.slurm else ""))
        return self

    def _claim(self) -> None:
        """Take the first free slot (its lock), clean what a killed run left there, name the hosts."""
        os.makedirs(LOCKS, exist_ok=True)
        for slot in range(SLOTS):
            fd = os.open(os.path.join(LOCKS, f"{PREFIX}{slot}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self._lockfd, self.prefix = fd, f"{PREFIX}{slot}"
            previous = os.pread(fd, 4096, 0).decode(errors="replace").split()
            stale = clean_stale(self.prefix)
            if len(previous) >= 2:
                stale += _clean_tmp(previous[1])
            if stale:
                self.log.append(f"removed what a killed run left: {', '.join(stale)}")
            break
        else:
            raise ClusterUnavailable(f"all {SLOTS} cluster slots are in use ({LOCKS}/*.lock held by live runs)")
        letters = [chr(ord("a") + i) for i in range(self.count)]
        self.hosts = [Host(f"host{c}", f"{self.prefix}-{c}", f"{SUBNET}.{i + 1}") for i, c in enumerate(letters)]
        self.switch = f"{self.prefix}-switch"

    def down(self) -> None:
        """Stop every daemon and job process on the hosts, delete the namespaces and the temporary files."""
        for h in self.hosts:
            if h.holder is not None or _netns_pids(h.netns):
                _kill_pids(_netns_pids(h.netns), grace=2.0)
            for p in list(h.daemons.values()) + ([h.holder] if h.holder else []):
                if p.poll() is None:
                    p.kill()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            h.daemons.clear()
            h.holder = None
        if self.munged is not None:
            if self.munged.poll() is None:
                self.munged.terminate()
                try:
                    self.munged.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.munged.kill()
                    self.munged.wait(timeout=5)
            self.munged = None
        for ns in [h.netns for h in self.hosts] + ([self.switch] if self.switch else []):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        if self.tmp and os.path.isdir(self.tmp):
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp = ""
        self.slurm = False
        if self._lockfd is not None:
            os.close(self._lockfd)  # releases the slot
            self._lockfd = None

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---------------------------------------------------------------- building
    def path(self, *parts: str) -> str:
        return os.path.join(self.tmp, *parts)

    def _files(self) -> None:
        for d in ("bin", "ssh", "slurm", "munge", "jobs"):
            os.makedirs(self.path(d), mode=0o700, exist_ok=True)
        with open(self.path("hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n::1 localhost ip6-localhost\n")
            for h in self.hosts:
                f.write(f"{h.addr} {h.name}\n")
        _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.path("ssh", "id"), "-C", "distmem-cluster"])
        _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.path("ssh", "hostkey"), "-C", "distmem-host"])
        shutil.copy(self.path("ssh", "id.pub"), self.path("ssh", "authorized_keys"))
        with open(self.path("ssh", "config"), "w") as f:
            f.write("Host *\n  User root\n  IdentityFile {}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
                    "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n  ConnectTimeout 10\n"
                    "  ServerAliveInterval 5\n".format(self.path("ssh", "id")))
        # Launchers call plain `ssh`; this one, first in PATH, brings the cluster's key and options.
        wrapper = self.path("bin", "ssh")
        with open(wrapper, "w") as f:
            f.write(f"#!/bin/sh\nexec {_which('ssh')} -F {self.path('ssh', 'config')} \"$@\"\n")
        os.chmod(wrapper, 0o755)

    def _network(self) -> None:
        _sh(["ip", "netns", "add", self.switch])
        _sh(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _sh(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for i, h in enumerate(self.hosts):
            _sh(["ip", "netns", "add", h.netns])
            # Both ends are made inside their namespaces: the machine's own namespace never sees them.
            _sh(["ip", "-n", self.switch, "link", "add", f"port{i}", "type", "veth", "peer", "name", IFACE,
                 "netns", h.netns])
            _sh(["ip", "-n", self.switch, "link", "set", f"port{i}", "master", "br0"])
            _sh(["ip", "-n", self.switch, "link", "set", f"port{i}", "up"])
            _sh(["ip", "-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", IFACE])
            _sh(["ip", "-n", h.netns, "link", "set", IFACE, "up"])
            _sh(["ip", "-n", h.netns, "link", "set", "lo", "up"])

    def _hold(self, h: Host) -> None:
        """One idle process owns the host's UTS and mount namespaces; everything else enters them."""
        inner = (f"mount --bind {shlex.quote(self.path('hosts'))} /etc/hosts && hostname {h.name} "
                 "&& exec sleep 2147483647")
        h.holder = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--uts", "--mount", "--propagation", "private",
             "sh", "-c", inner], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if h.holder.poll() is not None:
                raise RuntimeError(f"host {h.name}: namespace holder exited with {h.holder.returncode}")
            try:
                with open(f"/proc/{h.pid}/comm") as f:
                    if f.read().strip() == "sleep":
                        # nsenter/unshare exec'd in place, so the pid is the sleeping holder itself.
                        if os.readlink(f"/proc/{h.pid}/ns/uts") != os.readlink("/proc/self/ns/uts"):
                            return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"host {h.name}: namespace holder did not start within 10 s")

    def enter(self, host: str) -> List[str]:
        """argv prefix that runs a command on ``host`` (its network, hostname and hosts file)."""
        return ["nsenter", "-t", str(self.host(host).pid), "-n", "-u", "-m", "--"]

    def _daemon(self, h: Host, name: str, argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> None:
        log = open(self.path(f"{name}-{h.name}.out"), "w")
        h.daemons[name] = subprocess.Popen(self.enter(h.name) + list(argv), stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, env=dict(env or self.env()),
                                           start_new_session=True)
        log.close()

    def _sshd(self) -> None:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        for h in self.hosts:
            cfg = self.path("ssh", f"sshd_{h.name}")
            with open(cfg, "w") as f:
                f.write(f"ListenAddress {h.addr}\nPort 22\nHostKey {self.path('ssh', 'hostkey')}\n"
                        f"AuthorizedKeysFile {self.path('ssh', 'authorized_keys')}\nPermitRootLogin prohibit-password\n"
                        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                        f"PidFile {self.path('ssh', 'sshd_' + h.name + '.pid')}\nPrintMotd no\nPrintLastLog no\n"
                        "MaxStartups 200\nMaxSessions 200\nLogLevel ERROR\nAcceptEnv *\n")
            self._daemon(h, "sshd", [_which("sshd") or "sshd", "-D", "-e", "-f", cfg])

    def _wait_ssh(self, deadline: float) -> None:
        last = ""
        for h in self.hosts:
            while True:
                r = self.run_on(self.login.name, f"ssh {h.name} hostname", timeout=15)
                if r.rc == 0 and r.out.strip() == h.name:
                    break
                last = r.describe(2000)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {h.name} not reachable from {self.login.name}:\n{last}\n"
                                       + self.daemon_logs())
                time.sleep(0.2)

    # ---------------------------------------------------------------- SLURM
    def _slurm(self, deadline: float) -> None:
        key = self.path("munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        sock = self.path("munge", "munge.socket")
        # One munged for the whole cluster, reached through its socket on the shared filesystem.
        self.munged = subprocess.Popen(
            [_which("munged") or "munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}",
             f"--pid-file={self.path('munge', 'munged.pid')}", f"--log-file={self.path('munge', 'munged.log')}",
             f"--seed-file={self.path('munge', 'munged.seed')}", "--num-threads=4"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(self.path("munge", "munged.err"), "w"),
            start_new_session=True)
        while not os.path.exists(sock):
            if self.munged.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self._read(self.path('munge', 'munged.err'))}"
                                   f"{self._read(self.path('munge', 'munged.log'))}")
            time.sleep(0.05)
        sl = self.path("slurm")
        os.makedirs(os.path.join(sl, "state"), exist_ok=True)
        nodes = ",".join(self.names)
        conf = [
            "ClusterName=distmem", f"SlurmctldHost={self.login.name}({self.login.addr})",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={sock}",
            f"StateSaveLocation={sl}/state", f"SlurmdSpoolDir={sl}/spool-%n",
            f"SlurmctldPidFile={sl}/slurmctld.pid", f"SlurmdPidFile={sl}/slurmd-%n.pid",
            f"SlurmctldLogFile={sl}/slurmctld.log", f"SlurmdLogFile={sl}/slurmd-%n.log",
            "SlurmctldPort=6817", "SlurmdPort=6818",
            # No cgroups in a namespace: plain process tracking, no task binding.
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            # Every host declares more CPUs than the machine has.
            "SlurmdParameters=config_overrides",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none", "ReturnToService=2", "SchedulerType=sched/builtin",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=3", "MinJobAge=2",
            "MessageTimeout=20", "SlurmctldDebug=info", "SlurmdDebug=info", "LaunchParameters=use_interactive_step",
        ]
        for h in self.hosts:
            conf.append(f"NodeName={h.name} NodeAddr={h.addr} CPUs=8 RealMemory=4000 State=UNKNOWN")
        conf.append(f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8")
        with open(os.path.join(sl, "slurm.conf"), "w") as f:
            f.write("\n".join(conf) + "\n")
        env = self.env()
        self._daemon(self.login, "slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-i"], env)
        for h in self.hosts:
            self._daemon(h, "slurmd", [_which("slurmd") or "slurmd", "-D", "-N", h.name], env)
        self.slurm = True
        self._wait_nodes(deadline)

    def _wait_nodes(self, deadline: float) -> None:
        resumed = False
        state = ""
        while True:
            r = self.run_on(self.login.name, "sinfo -h -N -o '%N %T'", timeout=15)
            state = r.out
            states = dict(line.split()[:2] for line in r.out.splitlines() if len(line.split()) >= 2)
            if r.rc == 0 and all(states.get(n, "").rstrip("*") in ("idle", "mixed", "allocated") for n in self.names):
                return
            if r.rc == 0 and states and not resumed and all(n in states for n in self.names):
                # A node that registered once before the controller knew it reads as down: resume it.
                bad = [n for n in self.names if states[n].rstrip("*") in ("down", "drained", "draining")]
                if bad:
                    self.run_on(self.login.name, f"scontrol update nodename={','.join(bad)} state=resume", timeout=15)
                    resumed = True
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM nodes not idle in time; sinfo:\n{state}\n{self.daemon_logs()}")
            time.sleep(0.3)

    # ---------------------------------------------------------------- running
    def env(self, extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """A clean environment for launches: the cluster's ssh first in PATH, then the Python environment."""
        env = {
            "PATH": f"{self.path('bin')}:{self.bin}:{SYSTEM_PATH}",
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "GLOO_SOCKET_IFNAME": IFACE,
            "TP_SOCKET_IFNAME": IFACE,
            "SLURM_CONF": self.path("slurm", "slurm.conf"),
            "OMP_NUM_THREADS": "1",
        }
        if os.environ.get("DISTMEM_CLUSTER_SRC"):
            env["DISTMEM_CLUSTER_SRC"] = os.environ["DISTMEM_CLUSTER_SRC"]
        env.update(extra or {})
        return env

    def run_on(self, host: str, cmd: str, timeout: float = 60, env: Optional[Mapping[str, str]] = None,
               cwd: str = ROOT) -> Result:
        """Run a shell command on ``host`` with a hard timeout; on timeout the whole job on every host is killed."""
        full = self.enter(host) + ["bash", "-c", cmd]
        t0 = time.monotonic()
        proc = subprocess.Popen(full, cwd=cwd, env=self.env(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            return Result(cmd, proc.returncode, out, time.monotonic() - t0, False)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            # Ranks in a session of their own (torchrun's workers) may still hold the output pipe: kill
            # everything of the job on every host before reading what it printed.
            self.reap()
            try:
                out, _ = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                out = "(output not readable: a process outside the hosts still holds it)"
            return Result(cmd, -9, out or "", time.monotonic() - t0, True)

    def reap(self) -> List[int]:
        """Kill every process on the hosts that is not a daemon (what a timed-out job left behind)."""
        keep = set()
        for h in self.hosts:
            keep.update(p.pid for p in h.daemons.values())
            if h.holder is not None:
                keep.add(h.holder.pid)
        if self.slurm:
            subprocess.run(self.enter(self.login.name) + ["scancel", "--full", "--user=root"], env=self.env(),
                           capture_output=True, timeout=20)
        victims = []
        for h in self.hosts:
            for pid in _netns_pids(h.netns):
                if pid not in keep and not self._is_daemon_child(pid, keep):
                    victims.append(pid)
        _kill_pids(victims, grace=1.0)
        return victims

    @staticmethod
    def _is_daemon_child(pid: int, keep: set) -> bool:
        """True for a daemon's own worker (nsenter keeps the daemon as its child), not a job's process."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError, IndexError):
            return False
        return ppid in keep and comm in ("sshd", "slurmd", "slurmctld", "slurmstepd", "sleep")

    def run_many(self, cmds: Sequence[Tuple[str, str]], timeout: float, env: Optional[Mapping[str, str]] = None
                 ) -> List[Result]:
        """Start ``(host, cmd)`` pairs at once and wait for all (torchrun agents, one per host)."""
        results: List[Optional[Result]] = [None] * len(cmds)

        def one(i: int, host: str, cmd: str) -> None:
            results[i] = self.run_on(host, cmd, timeout=timeout, env=env)

        threads = [threading.Thread(target=one, args=(i, h, c), daemon=True) for i, (h, c) in enumerate(cmds)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 30)
        return [r if r is not None else Result(c, -9, "", timeout, True) for r, (_, c) in zip(results, cmds)]

    @staticmethod
    def _forward(env: Optional[Mapping[str, str]]) -> Dict[str, str]:
        """Variables an MPI launcher must export to every rank (``-x``): the caller's, plus the probe's source."""
        fwd = dict(env or {})
        if os.environ.get("DISTMEM_CLUSTER_SRC"):
            fwd.setdefault("DISTMEM_CLUSTER_SRC", os.environ["DISTMEM_CLUSTER_SRC"])
        return fwd

    def mpirun(self, hosts: str, argv: Sequence[str], np: Optional[int] = None, map_by: str = "slot",
               env: Optional[Mapping[str, str]] = None, timeout: float = 90, extra: Sequence[str] = ()) -> Result:
        """``mpirun --host <hosts> --map-by <map_by>`` from the login host over TCP on ``dm0``.

        ``hosts`` is Open MPI's own form (``hosta:2,hostb:2``); ``env`` is exported to every rank (``-x``).
        """
        np = np if np is not None else sum(int(p.split(":")[1]) if ":" in p else 1 for p in hosts.split(","))
        fwd = self._forward(env)
        cmd = ["mpirun", "--host", hosts, "-np", str(np), "--map-by", map_by, "--oversubscribe", "--bind-to", "none",
               "--mca", "btl", "self,vader,tcp", "--mca", "btl_tcp_if_include", IFACE,
               "--mca", "oob_tcp_if_include", IFACE, "--mca", "plm_rsh_agent", self.path("bin", "ssh"),
               "--mca", "btl_vader_single_copy_mechanism", "none", "--tag-output"]
        for k in sorted(set(fwd) | {"PATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL"}):
            cmd += ["-x", k]
        cmd += list(extra) + list(argv)
        return self.run_on(self.login.name, shlex.join(cmd), timeout=timeout, env=fwd)

    def horovodrun(self, hosts: str, argv: Sequence[str], np: Optional[int] = None, mode: str = "gloo",
                   env: Optional[Mapping[str, str]] = None, timeout: float = 120, extra: Sequence[str] = ()) -> Result:
        """``horovodrun -H <hosts> --gloo|--mpi --network-interface dm0`` from the login host."""
        if mode not in ("gloo", "mpi"):
            raise ValueError(f"mode={mode!r}: 'gloo' or 'mpi'")
        np = np if np is not None else sum(int(p.split(":")[1]) if ":" in p else 1 for p in hosts.split(","))
        fwd = self._forward(env)
        cmd = [os.path.join(self.bin, "horovodrun"), "-np", str(np), "-H", hosts, f"--{mode}",
               "--network-interface", IFACE, "--start-timeout", str(int(max(30, timeout - 20)))]
        if mode == "mpi":
            # horovodrun adds btl_tcp_if_include (from --network-interface) and -x for every variable itself.
            cmd += ["--mpi-args", f"--oversubscribe --mca oob_tcp_if_include {IFACE} "
                                  f"--mca plm_rsh_agent {self.path('bin', 'ssh')} "
                                  "--mca btl_vader_single_copy_mechanism none"]
        cmd += list(extra) + list(argv)
        return self.run_on(self.login.name, shlex.join(cmd), timeout=timeout, env=fwd)

    def torchrun(self, hosts: Sequence[str], nproc: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
                 timeout: float = 120, port: Optional[int] = None, run_id: Optional[str] = None) -> List[Result]:
        """One ``torchrun`` agent per host, c10d rendezvous at the first host's address on ``dm0``.

        ``argv`` is run as given (``--no-python``), so it starts with the interpreter.
        """
        head = self.host(hosts[0])
        port = port or self.next_port()
        run_id = run_id or f"dmcl{os.getpid()}x{self._launches}"
        cmds = []
        for h in hosts:
            cmd = [os.path.join(self.bin, "torchrun"), f"--nnodes={len(hosts)}", f"--nproc-per-node={nproc}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint={head.addr}:{port}", f"--rdzv-id={run_id}",
                   "--max-restarts=0", f"--local-addr={self.host(h).addr}", "--no-python"] + list(argv)
            cmds.append((h, shlex.join(cmd)))
        return self.run_many(cmds, timeout=timeout, env=env)

    def next_port(self, base: int = 29400) -> int:
        """A TCP port not used by an earlier launch of this cluster (a rendezvous socket may be in TIME_WAIT)."""
        self._launches += 1
        return base + self._launches % 500

    def srun(self, args: Sequence[str], argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
             timeout: float = 90) -> Result:
        """``srun <args> <argv>`` from the login host (the caller's environment is exported to the tasks)."""
        self._need_slurm()
        cmd = ["srun", "--kill-on-bad-exit=1", "--wait=30"] + list(args) + list(argv)
        return self.run_on(self.login.name, shlex.join(cmd), timeout=timeout, env=env)

    def sbatch(self, script: str, args: Sequence[str] = (), env: Optional[Mapping[str, str]] = None,
               timeout: float = 120) -> Result:
        """Submit ``script`` (a bash script's text) with ``sbatch --wait`` and return its output file's text."""
        self._need_slurm()
        name = f"job{len(os.listdir(self.path('jobs')))}"
        path, out = self.path("jobs", name + ".sh"), self.path("jobs", name + ".out")
        with open(path, "w") as f:
            f.write(script if script.startswith("#!") else "#!/bin/bash\n" + script)
        cmd = ["sbatch", "--wait", "--parsable", f"--output={out}", f"--time=5"] + list(args) + [path]
        r = self.run_on(self.login.name, shlex.join(cmd), timeout=timeout, env=env)
        r.out += "\n--- job output ---\n" + self._read(out)
        return r

    def _need_slurm(self) -> None:
        if not self.slurm:
            raise ClusterUnavailable(f"SLURM is not running in this cluster (missing: {', '.join(slurm_missing()) or 'none'})")

    # ---------------------------------------------------------------- debugging
    @staticmethod
    def _read(path: str, tail: int = 4000) -> str:
        try:
            with open(path, errors="replace") as f:
                return f.read()[-tail:]
        except OSError:
            return ""

    def daemon_logs(self, tail: int = 3000) -> str:
        """The last lines of every daemon's output, for a failure message."""
        parts = []
        for name in sorted(os.listdir(self.tmp)) if self.tmp else []:
            if name.endswith(".out"):
                parts.append(f"--- {name}\n{self._read(self.path(name), tail)}")
        for name in ("slurmctld.log",) + tuple(f"slurmd-{h}.log" for h in self.names):
            text = self._read(self.path("slurm", name), tail)
            if text:
                parts.append(f"--- {name}\n{text}")
        return "\n".join(parts)
