"""The simulated cluster itself: separate hosts, only its own addresses, nothing left behind.

These guard the harness, not distmem: if a host's name, address or sshd were wrong, every launch
test would test the wrong thing.
"""
from __future__ import annotations

import ipaddress
import os
import subprocess

import pytest

from harness import IFACE, SUBNET, Cluster

pytestmark = pytest.mark.cluster


def _netns() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_each_host_has_its_name_address_and_sshd(cluster):
    for h in cluster.hosts:
        r = cluster.run_on(h.name, f"hostname; ip -o -4 addr show; getent hosts {' '.join(cluster.names)}",
                           timeout=20)
        assert r.rc == 0, r.describe()
        lines = r.out.splitlines()
        assert lines[0] == h.name, r.describe()
        addrs = {ln.split()[1]: ln.split()[3] for ln in lines if " inet " in ln}
        # Only loopback and the cluster's own link: no route to anything else exists on a host.
        assert addrs == {"lo": "127.0.0.1/8", IFACE: f"{h.addr}/24"}, r.describe()
        assert ipaddress.ip_address(h.addr) in ipaddress.ip_network(f"{SUBNET}.0/24")
        resolved = {ln.split()[1]: ln.split()[0] for ln in lines if ln.startswith(SUBNET)}
        assert resolved == {x.name: x.addr for x in cluster.hosts}, r.describe()
        routes = cluster.run_on(h.name, "ip -4 route show; ip -6 route show | grep -v '^fe80::/64' || true", timeout=20)
        # One route, to the cluster's own /24: no traffic can leave the cluster.
        assert routes.out.split("\n")[0].split()[:3] == [f"{SUBNET}.0/24", "dev", IFACE], routes.describe()
        assert [ln for ln in routes.out.splitlines()[1:] if ln.strip()] == [], routes.describe()
    # Every host reaches every other one by name through its sshd, and lands on that host.
    hop = "; ".join(f"ssh {x.name} hostname" for x in cluster.hosts)
    for h in cluster.hosts:
        r = cluster.run_on(h.name, hop, timeout=30)
        assert r.rc == 0 and r.out.split() == cluster.names, r.describe()


def test_machine_namespace_is_untouched(cluster):
    """The machine's own network namespace gets no interface and no address from the cluster."""
    out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=20).stdout
    assert SUBNET + "." not in out
    assert f" {IFACE}" not in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                                             timeout=20).stdout


def test_timeout_kills_the_job_on_every_host(cluster):
    """A launch past its timeout returns timed_out within seconds and leaves no process of the job on any
    host, also one in a session of its own that holds the output pipe (as torchrun's workers do)."""
    marker = f"distmem-cluster-hang-{os.getpid()}"
    cmd = " ".join(f"ssh {h.name} 'exec -a {marker} sleep 300' &" for h in cluster.hosts)
    cmd += f" setsid bash -c 'exec -a {marker} sleep 300' & wait"
    r = cluster.run_on(cluster.login.name, cmd, timeout=3)
    assert r.timed_out and r.seconds < 60, r.describe()
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True, timeout=20).stdout.split()
    assert left == [], f"processes of the timed-out job still running: {left}"


@pytest.mark.slurm
def test_slurm_nodes_are_the_hosts(slurm):
    """slurmctld knows the three hosts as idle nodes and runs a task on each under its own name."""
    r = slurm.srun(["-N3", "-n3", "--ntasks-per-node=1"], ["bash", "-c", "echo $SLURMD_NODENAME $(hostname)"],
                   timeout=60)
    assert r.rc == 0, r.describe() + slurm.daemon_logs()
    pairs = sorted(tuple(line.split()) for line in r.out.splitlines() if line.strip())
    assert pairs == [(n, n) for n in slurm.names], r.describe()


def test_second_cluster_takes_another_slot_and_down_removes_all(cluster):
    """A second cluster beside the session's gets its own namespaces; down() leaves none and no process."""
    before = _netns()
    other = Cluster(hosts=2, slurm=False, python_bin=cluster.bin)
    other.up(timeout=60)
    try:
        assert other.prefix != cluster.prefix
        made = _netns() - before
        assert made == {f"{other.prefix}-a", f"{other.prefix}-b", f"{other.prefix}-switch"}
        r = other.run_on("hosta", "ssh hostb hostname", timeout=20)
        assert r.rc == 0 and r.out.strip() == "hostb", r.describe()
        holders = [h.pid for h in other.hosts]
        tmp = other.tmp
    finally:
        other.down()
    assert _netns() == before
    assert not os.path.exists(tmp)
    assert [p for p in holders if os.path.exists(f"/proc/{p}")] == []
    # The session's cluster is untouched.
    r = cluster.run_on("hosta", "ssh hostb hostname", timeout=20)
    assert r.rc == 0 and r.out.strip() == "hostb", r.describe()
