"""The contract test can fail: each deliberate breach (tests/contract/progs/violator.py) - an
unchecked read in a folder another user can write, a socket on every interface, a Python child
that is not isolated, an import from the working folder - is found in what the hook recorded, and
distmem's own work in the same places is not (issue 36, item 2).

The session's own check (tests/conftest.py) runs every other test's processes under the hook; these
runs write their records to a folder of their own, so that the breaches they make on purpose are
asserted here and nowhere else.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import contract  # noqa: E402
import hook  # noqa: E402

from helpers import ROOT, have, mpirun, run  # noqa: E402

PROG = os.path.join(ROOT, "tests", "contract", "progs", "violator.py")
GiB = 1024**3


@pytest.fixture
def recorded(tmp_path):
    """A folder another user could write (1777, as /tmp), this user's report in it, and the
    environment that records a process into a records folder of this test's own."""
    shared = tempfile.mkdtemp(prefix="dm-contract-shared-", dir="/tmp")
    os.chmod(shared, 0o1777)
    with open(os.path.join(shared, "report.json"), "w") as f:
        json.dump({"world_size": 2, "strategy": "data",
                   "ranks": [{"rank": r, "peak_bytes": (2 + r) * GiB} for r in range(2)]}, f)
    with open(os.path.join(shared, "planted_module.py"), "w") as f:
        f.write("")
    records = str(tmp_path / "records")
    site = hook.site_folder(str(tmp_path / "site"), records)
    env = {"PYTHONPATH": os.pathsep.join([site, ROOT]), "DISTMEM_QUIET": "1", "DISTMEM_CONTRACT_RECORDS": records}
    yield shared, records, env
    shutil.rmtree(shared, ignore_errors=True)


def _violations(records: str):
    return contract.violations(contract.read(records)) if os.path.isdir(records) else []


def test_distmems_own_work_in_a_shared_folder_holds(recorded):
    shared, records, env = recorded
    run([sys.executable, PROG, "clean", shared], 300, env, cwd=shared).check()
    rows = contract.read(records)
    assert any(r.get("e") == "open" and r.get("path") == os.path.join(shared, "report.json") and r.get("shared")
               and r.get("checked") for r in rows), rows[:20]  # recorded, in the shared folder, by the checked reader
    assert _violations(records) == []


@pytest.mark.parametrize("case,breach", [
    ("read", "unchecked open of {shared}/report.json (its folder: mode 1777; a read)"),
    ("child", "a Python child that is not isolated"),
    ("import", "imported from the working folder: planted_module: {shared}/planted_module.py"),
])
def test_a_deliberate_breach_is_found(recorded, case, breach):
    shared, records, env = recorded
    run([sys.executable, PROG, case, shared], 300, env, cwd=shared)
    found = _violations(records)
    assert any(breach.format(shared=shared) in v for v in found), found


def test_a_socket_on_every_interface_is_found(recorded):
    if not have("mpirun"):
        pytest.skip("mpirun not installed (main environment: scripts/env.sh main)")
    pytest.importorskip("mpi4py")
    shared, records, env = recorded
    mpirun(2, [PROG, "bind", shared], timeout=300, env=env)
    found = _violations(records)
    assert any("socket bound on every interface (['0.0.0.0', 0])" in v and "distmem/comm/heartbeat_meet.py" in v
               for v in found), found
