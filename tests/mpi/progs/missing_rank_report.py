"""The last rank never reaches report(): it freezes itself with SIGSTOP (a hung process: no progress
at all, not even MPI's) right before the call. Rank 0 must return within the timeout with a report
that marks the missing rank, then thaws it with SIGCONT; the thawed rank exits normally without
ever calling report(), so the launcher sees every rank finish (an exiting rank would make mpirun
kill the job instead, which proves nothing).

Runs under mpirun (mpi4py transport), horovodrun --mpi and horovodrun --gloo (with USE_HOROVOD=1
Horovod is initialised first). Writes rank 0's findings as JSON to $DISTMEM_TEST_OUT/missing-<detail>.json.

Environment: MISSING_DETAIL=full|summary, DISTMEM_TIMEOUT (seconds, default 3).
"""
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

if os.environ.get("USE_HOROVOD") == "1":  # set by tests/horovod/test_horovod_launch.py
    import horovod.tensorflow as hvd  # noqa: E402

    hvd.init()

import distmem  # noqa: E402
from distmem import comm as dcomm  # noqa: E402

timeout = float(os.environ.get("DISTMEM_TIMEOUT", "3"))
detail = os.environ.get("MISSING_DETAIL", "full")
distmem.init(fleet="2x16GiB", framework="none", verbose=False)
c = dcomm.get_comm()
rank, size = c.rank, c.size
late = size - 1
pids = c.allgather(os.getpid(), 60)  # a real collective every rank enters before the stall

if rank == late:
    print(f"[rank {rank}] stopping itself before report() (SIGSTOP)", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    print(f"[rank {rank}] thawed by rank 0; leaving without ever calling report()", flush=True)
    sys.exit(0)

t0 = time.monotonic()
rep = distmem.report(timeout=timeout, detail=detail, print_table=rank == 0)
elapsed = time.monotonic() - t0
print(f"[rank {rank}] report() returned after {elapsed:.2f} s (timeout {timeout:.1f} s)", flush=True)
folder = os.environ.get("DISTMEM_TEST_OUT", "/tmp")
open(os.path.join(folder, f"returned-{detail}-{rank}"), "w").close()
if rank == 0:
    # Thaw the frozen rank only once every other rank has returned from report() on its own: its exit
    # would otherwise shut Horovod down under ranks still inside their (timed) collective. The
    # handshake goes through files because the collectives are what is being tested.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(folder, f"returned-{detail}-{r}")) for r in range(1, late)):
        time.sleep(0.05)
    out = {"elapsed": elapsed, "timeout": timeout, "transport": c.name, "detail": detail, "size": size,
           "late": late, "missing": rep.missing, "rows": [s.rank for s in rep.ranks], "warnings": rep.warnings,
           "kinds": rep.kinds(), "complete": rep.aggregates.get("complete", True),
           "ranks_reporting": rep.aggregates.get("ranks_reporting")}
    with open(os.path.join(folder, f"missing-{detail}.json"), "w") as f:
        json.dump(out, f)
    os.kill(pids[late], signal.SIGCONT)
print(f"[rank {rank}] done", flush=True)
