"""The simulated cluster, built once per test session and always torn down.

Skipped, with the reason, only where namespaces cannot be made (not root, no ``ip``/``sshd``);
``DISTMEM_REQUIRE_CLUSTER=1`` turns that skip into a failure. SLURM cases skip (or, with that
variable, fail) the same way when slurm-wlm/munge are missing. Select the cases with ``-m cluster``.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from harness import Cluster, ClusterUnavailable, slurm_missing, unavailable_reason  # noqa: E402
from launches import skip_or_fail as _skip_or_fail  # noqa: E402

_live: list = []


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: launches real launchers across the simulated multi-host cluster "
                                       "(skipped without root; DISTMEM_REQUIRE_CLUSTER=1 fails instead)")
    config.addinivalue_line("markers", "slurm: needs SLURM's daemons in the simulated cluster")


def _teardown_all() -> None:
    while _live:
        _live.pop().down()


def _on_term(signum, frame):  # noqa: ARG001
    # A `timeout` or CI stop sends SIGTERM: take the cluster down before dying, then die as asked.
    _teardown_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@pytest.fixture(scope="session")
def cluster():
    """Three hosts (hosta, hostb, hostc) with sshd and, where installed, SLURM."""
    reason = unavailable_reason()
    if reason:
        _skip_or_fail(reason)
    c = Cluster(hosts=3)
    _live.append(c)
    previous = signal.signal(signal.SIGTERM, _on_term)
    atexit.register(_teardown_all)
    try:
        try:
            c.up(timeout=90)
        except ClusterUnavailable as exc:
            _skip_or_fail(str(exc))
        yield c
    finally:
        _teardown_all()
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def slurm(cluster):
    """The cluster, with SLURM's controller and daemons running."""
    if not cluster.slurm:
        _skip_or_fail(f"SLURM not available (missing: {', '.join(slurm_missing())}; run scripts/cluster_deps.sh)")
    return cluster
