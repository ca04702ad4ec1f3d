"""Under mpirun: the overlapped guard step (fail fast on from init(), the verdict carried in the
gradient Allreduce's buffer) against the blocking one, in the same job: NumPy least squares, rank
OOM_RANK raises MemoryError in step OOM_STEP's first micro-batch. Rank 0 writes both runs' weights
checksums, fallbacks and whether the overlapped protocol ran to $OUT/overlap.json."""
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import numpy as np  # noqa: E402

import distmem  # noqa: E402
from distmem import guard  # noqa: E402
from distmem.comm import get_comm, heartbeat  # noqa: E402

distmem.init(fleet="4x16GiB", framework="none", verbose=False)
comm = get_comm()
OOM_RANK, OOM_STEP = int(os.environ.get("OOM_RANK", "2")), int(os.environ.get("OOM_STEP", "4"))
D, LOCAL, STEPS = 8, 32, 8


def train(overlap):
    w = np.zeros(D)
    calls = [0]
    step_no = [0]

    def grads_of(x, y):
        calls[0] += 1
        if comm.rank == OOM_RANK and step_no[0] == OOM_STEP and len(x) == 16:
            raise MemoryError("out of memory (injected)")
        err = x @ w - y
        return [2 * x.T @ err / len(x)], float((err ** 2).mean())

    def apply(grads):
        w[:] = w - 0.05 * grads[0]

    s = guard.step(grads_of, apply=apply, micro_batch_size=16, global_batch_size=LOCAL * comm.size, comm=comm,
                   timeout=60, overlap=overlap)
    rng = np.random.default_rng(comm.rank)
    x = rng.normal(size=(LOCAL * STEPS, D))
    y = x @ np.linspace(-1, 1, D)
    for i in range(STEPS):
        step_no[0] = i
        s(x[i * LOCAL:(i + 1) * LOCAL], y[i * LOCAL:(i + 1) * LOCAL])
    return {"checksum": hashlib.sha256(w.tobytes()).hexdigest()[:16], "overlapped": s.overlapped,
            "carried": s.verdict_in_gradients,
            "fallbacks": [[f.step, f.ranks, f.old_micro_batch, f.new_micro_batch] for f in s.fallbacks]}


rows = comm.allgather({"rank": comm.rank, "heartbeat": heartbeat.current() is not None,
                       "overlapped": train("auto"), "blocking": train(False)}, 60)
if comm.rank == 0:
    with open(os.path.join(os.environ["OUT"], "overlap.json"), "w") as f:
        json.dump(rows, f)
