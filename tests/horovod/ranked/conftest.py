"""Runs on every rank under horovodrun (Gloo or MPI controller). Horovod is initialised once per
process; the first failing rank prints its failure and exits non-zero, and horovodrun then stops
the other ranks, so none is left waiting in a collective."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from ranked_common import fail_fast, fresh_distmem  # noqa: E402,F401 - the autouse fixture

import horovod.tensorflow as hvd  # noqa: E402

hvd.init()


def pytest_runtest_logreport(report):
    if hvd.size() > 1:
        fail_fast(report, hvd.rank(), lambda: os._exit(1))
