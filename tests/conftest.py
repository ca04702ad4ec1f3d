"""Suite-wide setup.

Layout: unit/ (pure, in-process), mpi/ and horovod/ (each test launches `mpirun -np N` or
`horovodrun -np 4` over the files in its ranked/ folder, with a hard timeout), gpu/ (skipped without
a GPU; with DISTMEM_REQUIRE_GPU=1 a skip is a failure), tfdist/ (tf.distribute workers), security/
(steps run as two real Unix users the tests create and remove: root only, skipped with the reason
otherwise).
ranked/ folders run only under a launcher: they are never collected by the top-level run.
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# distmem.init(framework="tensorflow") turns on TensorFlow's CPU allocator statistics by setting this
# before TensorFlow starts; in one test process TensorFlow starts once, in whichever test imports it
# first, so the suite sets it up front and the order tests run in cannot decide whether the Keras
# callback and snapshot tests see real CPU peaks (the fresh-process test of init strips it again)
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

# Whole folders, not just their files: a ranked/ folder's conftest initialises Horovod or MPI and
# must load only under the launcher.
collect_ignore_glob = ["*/ranked", "*/ranked/*", "*/progs", "*/progs/*", "gpu/native_progs", "gpu/guard_progs"]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped without; DISTMEM_REQUIRE_GPU=1 fails)")
    config.addinivalue_line("markers", "horovod: needs Horovod (main environment only)")
    config.addinivalue_line("markers", "mpi: launches mpirun")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if os.sep + "horovod" + os.sep in path:
            item.add_marker(pytest.mark.horovod)
        if os.sep + "mpi" + os.sep in path:
            item.add_marker(pytest.mark.mpi)


# ---------------------------------------------------------------- the "nobody else's job" contract
# Every Python process the suite starts (the mpirun, horovodrun and torchrun launches, the examples,
# the CLI commands, distmem's own children) runs under tests/contract/hook.py's audit hook, put there
# by a sitecustomize first on PYTHONPATH; after each test, what its processes recorded is held to
# tests/contract/contract.py (no unchecked file work in a folder another user can write, no socket
# on every interface, nothing imported from the working folder, no Python child that is not
# isolated). DISTMEM_CONTRACT=0 turns it off.
sys.path.insert(0, os.path.join(ROOT, "tests", "contract"))
import contract as _contract  # noqa: E402
import hook as _contract_hook  # noqa: E402

_contract_made = []
if os.environ.get("DISTMEM_CONTRACT", "1") != "0" and not os.environ.get("DISTMEM_CONTRACT_RECORDS"):
    import tempfile as _tempfile

    _base = _tempfile.mkdtemp(prefix="distmem-contract-")
    _contract_made.append(_base)
    os.environ["DISTMEM_CONTRACT_RECORDS"] = os.path.join(_base, "records")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [_contract_hook.site_folder(os.path.join(_base, "site"), os.environ["DISTMEM_CONTRACT_RECORDS"])]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


@pytest.fixture(autouse=True)
def nobody_elses_job():
    """Hold what this test's processes did to the contract (tests/contract/contract.py)."""
    folder = os.environ.get("DISTMEM_CONTRACT_RECORDS")
    before = set(os.listdir(folder)) if folder and os.path.isdir(folder) else set()
    yield
    if not folder or not os.path.isdir(folder):
        return
    new = sorted(set(os.listdir(folder)) - before)
    if not new:  # nothing recorded by this test's processes (read() of no names would read them all)
        return
    bad = _contract.violations(_contract.read(folder, new))
    if bad:
        pytest.fail("the 'nobody else's job' contract (docs/security.md, tests/contract) was broken:\n  "
                    + "\n  ".join(bad[:20]), pytrace=False)


def pytest_sessionfinish(session, exitstatus):
    """The session's records go with it (each test's were checked when it ended)."""
    import shutil

    for base in _contract_made:
        shutil.rmtree(base, ignore_errors=True)
