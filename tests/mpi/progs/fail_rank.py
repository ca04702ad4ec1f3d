"""One rank fails before a collective that the others enter: the job must fail fast, not hang."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from mpi4py import MPI  # noqa: E402

import distmem  # noqa: E402

distmem.init(fleet="2x16GiB", verbose=False)
if MPI.COMM_WORLD.Get_rank() == int(os.environ.get("FAIL_RANK", "1")):
    raise SystemExit("rank failing on purpose before report()")
distmem.report(timeout=float(os.environ.get("DISTMEM_TIMEOUT", "5")))
