"""Runs on every rank under horovodrun. The first failing rank prints its failure and exits at once;
horovodrun then ends the whole job, so no rank is left waiting in a collective."""
import gc
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/
sys.path.insert(0, os.path.dirname(HERE))  # guardlib

from ranked_common import fail_fast, fresh_distmem  # noqa: E402,F401 - the autouse fixture


def pytest_runtest_logreport(report):
    rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    fail_fast(report, rank, lambda: os._exit(1))


def pytest_collection_finish(session):
    gc.freeze()  # frameworks imported by now: each fallback's full collection stays cheap
