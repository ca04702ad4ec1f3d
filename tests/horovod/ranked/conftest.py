"""Runs on every rank under horovodrun (Gloo or MPI controller). Horovod is initialised once per
process; the first failing rank prints its failure and exits non-zero, and horovodrun then stops
the other ranks, so none is left waiting in a collective."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402

hvd.init()


@pytest.fixture(autouse=True)
def _fresh_distmem():
    import distmem

    distmem.reset()
    yield
    distmem.reset()


def pytest_runtest_logreport(report):
    if report.failed and hvd.size() > 1:
        sys.stderr.write(f"\n[rank {hvd.rank()}] FAILED {report.nodeid}\n{report.longreprtext}\n")
        sys.stderr.flush()
        os._exit(1)
