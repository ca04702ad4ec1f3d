"""One rank of a fail-fast launch (tests/faults/test_fail_fast.py, bench/comm/fail_fast.py): a tiny data
parallel training loop whose gradient all-reduce is the framework's own (torch.distributed Gloo
under torchrun, mpi4py's Allreduce under mpirun, horovod.tensorflow's allreduce under horovodrun
--gloo or --mpi, ``hvd.init()`` after ``distmem.init()`` as users write it); one rank (FF_VICTIM)
ends itself FF_AT seconds into the loop, by FF_HOW: ``kill`` (SIGKILL), ``oom`` (an out-of-memory
error raised outside the guard, unhandled).

FF_MODE=distmem calls ``distmem.init()`` first (fail fast on by default); FF_MODE=bare runs the same
loop without distmem (the baseline: how long the survivors wait). FF_TRANSPORT: torch | mpi | horovod.

Every rank sends its stderr to $FF_DIR/stderr-<rank>.txt and writes $FF_DIR/pid-<rank> (its pid)
when the loop starts; the victim writes $FF_DIR/fault (wall time) just before it ends itself.
A survivor that gets out of the loop (the transport raised) writes $FF_DIR/raised-<rank>.
"""
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

out_dir = os.environ["FF_DIR"]
transport = os.environ.get("FF_TRANSPORT", "torch")
mode = os.environ.get("FF_MODE", "distmem")
victim = int(os.environ.get("FF_VICTIM", "1"))
at = float(os.environ.get("FF_AT", "0.5"))
how = os.environ.get("FF_HOW", "kill")
limit = float(os.environ.get("FF_LIMIT", "60"))


def launcher_rank() -> int:
    for key in ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "RANK", "PMI_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


rank = launcher_rank()
err = os.open(os.path.join(out_dir, f"stderr-{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.dup2(err, 2)
sys.stderr = os.fdopen(2, "w", buffering=1)

if mode == "distmem":
    import distmem

    distmem.init(fleet="4x16GiB", framework="none", verbose=False)
    if os.environ.get("FF_REPLACE_EXCEPTHOOK") == "1":  # a library that installs its own hook after init()
        sys.excepthook = lambda tp, value, tb: sys.__excepthook__(tp, value, tb)

import numpy as np  # noqa: E402

if transport == "torch":
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    w = torch.zeros(64)

    def allreduce(g):
        t = torch.from_numpy(g)
        dist.all_reduce(t)
        return t.numpy()
elif transport == "horovod":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()

    def allreduce(g):
        return hvd.allreduce(tf.constant(g), op=hvd.Sum, name="grad").numpy()
else:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD

    def allreduce(g):
        out = np.empty_like(g)
        comm.Allreduce(g, out, op=MPI.SUM)
        return out

with open(os.path.join(out_dir, f"pid-{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(out_dir, f"pid-{rank}.tmp"), os.path.join(out_dir, f"pid-{rank}"))

rng = np.random.default_rng(rank)
weights = np.zeros(64)
t0 = time.monotonic()
step = 0
try:
    while time.monotonic() - t0 < limit:
        grad = rng.standard_normal(64)
        time.sleep(0.005)  # the step's compute
        if rank == victim and time.monotonic() - t0 >= at:
            with open(os.path.join(out_dir, "fault"), "w") as f:
                f.write(repr(time.time()))
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise MemoryError(f"out of memory at step {step}: tried to allocate 2.00 GiB (simulated on CPU)")
        weights -= 0.01 * allreduce(grad)
        step += 1
except MemoryError:
    raise
except Exception as exc:  # the transport gave up on the dead peer
    with open(os.path.join(out_dir, f"raised-{rank}"), "w") as f:
        f.write(f"{type(exc).__name__}: {str(exc)[:300]}")
    raise
