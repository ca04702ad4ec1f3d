"""A 64-rank job's report files, written by a real mpirun job of a few ranks (tests/mpi/test_top_launch.py,
docs/top.md): each MPI rank stands for one host of RANKS_PER_HOST ranks and, at every step, writes
that host's files in distmem's own formats - the report JSON (``write_json``) and the Prometheus
textfile (``prometheus``), built by distmem's ``aggregate`` from one Snapshot per simulated rank.

The snapshots are this process's real one (``distmem.snapshot()``) with the rank, host, pipeline
stage (4 stages) and figures of the simulated rank: planned 4 GiB, current and peak that move with
the step; at step WARN_STEP one rank of the second host climbs above its plan, so the warning
appears while the view runs. The steps are in lockstep (an MPI barrier per step), STEP_SECONDS apart.

Environment: TOP_DIR (output folder: TOP_DIR/json/host-K.json, TOP_DIR/prom/host-K.prom), STEPS,
STEP_SECONDS, RANKS_PER_HOST, WARN_STEP.
"""
import dataclasses
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from mpi4py import MPI  # noqa: E402

import distmem  # noqa: E402
from distmem.report.aggregate import aggregate  # noqa: E402
from distmem.report.sinks.files import write_json  # noqa: E402
from distmem.report.sinks.prometheus import prometheus  # noqa: E402
from distmem.units import GiB, MiB  # noqa: E402

out = os.environ["TOP_DIR"]
steps = int(os.environ.get("STEPS", "40"))
pause = float(os.environ.get("STEP_SECONDS", "0.25"))
per_host = int(os.environ.get("RANKS_PER_HOST", "16"))
warn_step = int(os.environ.get("WARN_STEP", "8"))

comm = MPI.COMM_WORLD
me, hosts = comm.Get_rank(), comm.Get_size()
world = hosts * per_host
distmem.init(fleet="4x16GiB", framework="none", verbose=False, fail_fast=False)
for sub in ("json", "prom"):
    os.makedirs(os.path.join(out, sub), exist_ok=True)

peaks = {}
for step in range(1, steps + 1):
    real = distmem.snapshot(step)
    snaps = []
    for j in range(per_host):
        rank = me * per_host + j
        stage = j % 4
        cur = int((1.0 + 0.4 * math.sin(step / 3 + rank) + 0.3 * stage) * GiB)
        if me == 1 and j == 5 and step >= warn_step:
            cur = int(4.5 * GiB)  # above its 4 GiB plan from here on
        peaks[rank] = max(peaks.get(rank, 0), cur)
        snaps.append(dataclasses.replace(real, rank=rank, size=world, local_rank=j, host=f"node{me}", stage=stage,
                                         limit_bytes=4 * GiB, current_bytes=cur, peak_bytes=peaks[rank],
                                         reserved_bytes=cur + 256 * MiB, step=step, time=time.time()))
    rep = aggregate(snaps, world_size=world, strategy="pipeline")
    rep.timeline = [{"step": step, "time": rep.created}]
    write_json(rep, os.path.join(out, "json", f"host-{me}.json"))
    prometheus(rep, os.path.join(out, "prom", f"host-{me}.prom"), step=step)
    comm.Barrier()
    time.sleep(pause)
