"""One task of the cluster's fail-fast case under srun (tests/cluster/test_cluster_launch.py): the
job's transport first (torch.distributed Gloo from srun's variables, master on the step's first
node), then ``distmem.init()`` - so the heartbeat's key travels over that transport and rank 0's hub
listens on the interface that routes to the other host - then a loop of all-reduces. Task
``FF_VICTIM`` raises MemoryError ``FF_AT`` seconds into the loop, uncaught.

Files in ``FF_DIR`` (the shared filesystem): ``fault`` (the victim's wall time before it raises),
``alive-<rank>`` rewritten every 50 ms while the task runs (its last change is when it ended), and
each task's stderr in ``stderr-<rank>.txt`` (the survivors' one line).
"""
import os
import sys
import threading
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.environ.get("DISTMEM_CLUSTER_SRC") or ROOT)

env = os.environ
out, rank = env["FF_DIR"], int(env["SLURM_PROCID"])
err = os.open(os.path.join(out, f"stderr-{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.dup2(err, 2)
sys.stderr = os.fdopen(2, "w", buffering=1)


def beat() -> None:
    path = os.path.join(out, f"alive-{rank}")
    while True:
        with open(path, "w") as f:
            f.write(repr(time.time()))
        time.sleep(0.05)


threading.Thread(target=beat, daemon=True).start()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

node = env["SLURM_STEP_NODELIST"].split(",")[0]  # the step's first node (hosta,hostb or host[a-b])
if "[" in node:
    base, rest = node.split("[", 1)
    node = base + rest.split("-")[0].split(",")[0].rstrip("]")
dist.init_process_group("gloo", init_method=f"tcp://{node}:{21000 + int(env['SLURM_JOB_ID']) % 20000}", rank=rank,
                        world_size=int(env["SLURM_NTASKS"]), timeout=timedelta(seconds=120))
import distmem  # noqa: E402

distmem.init(fleet="2x16GiB", framework="none", verbose=False)
t0, victim, at = time.monotonic(), int(env.get("FF_VICTIM", "2")), float(env.get("FF_AT", "1.0"))
grad = torch.ones(64)
step = 0
while time.monotonic() - t0 < 60:
    if rank == victim and time.monotonic() - t0 >= at:
        with open(os.path.join(out, "fault"), "w") as f:
            f.write(repr(time.time()))
        raise MemoryError(f"out of memory at step {step}: tried to allocate 2.00 GiB (simulated on CPU)")
    dist.all_reduce(grad)
    time.sleep(0.005)
    step += 1
