"""Runs on every rank under horovodrun. The first failing rank prints its failure and exits at once;
horovodrun then ends the whole job, so no rank is left waiting in a collective."""
import gc
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))  # the repository
sys.path.insert(0, os.path.dirname(HERE))  # guardlib


@pytest.fixture(autouse=True)
def _fresh_distmem():
    import distmem

    distmem.reset()
    yield
    distmem.reset()


def pytest_runtest_logreport(report):
    if report.failed:
        rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
        sys.stderr.write(f"\n[rank {rank}] FAILED {report.nodeid}\n{report.longreprtext}\n")
        sys.stderr.flush()
        os._exit(1)


def pytest_collection_finish(session):
    gc.freeze()  # frameworks imported by now: each fallback's full collection stays cheap
