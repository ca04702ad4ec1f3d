"""The node-local layout exchange (distmem.discover.layout): its cost at 8 ranks per host beside
the MPI way of learning the same thing (``MPI_Comm_split_type`` + an all-gather of the same
records on the node communicator), and the never-arrives case (one rank missing: every other
rank must raise within the deadline).

    python bench/comm/layout_exchange.py [--ranks 8] [--repeats 5] [--out bench/results/layout_exchange.json]

Runs ``mpirun -np N`` (oversubscribed) on this machine; each rank times both methods; the figure
is the slowest rank's exchange, the median over the repeats. Prints one JSON line per case.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

ROOT = runner.ROOT

RANK_PROG = r"""
import json, os, sys, time
sys.path.insert(0, %(root)r)
from mpi4py import MPI
from distmem.discover.gpus import fleet_inventory
from distmem.discover.identity import detect
from distmem.discover.layout import exchange, LayoutTimeoutError
w = MPI.COMM_WORLD
topo = detect()
inv = fleet_inventory("4x80GiB", topo.host)
out = {"rank": w.Get_rank()}
for rep in range(%(repeats)d):
    w.Barrier()
    t0 = time.perf_counter(); lay = exchange(topo, inv, directory=%(folder)r); t1 = time.perf_counter()
    assert len(lay.views) == topo.local_size, lay
    w.Barrier()
    t2 = time.perf_counter()
    node = w.Split_type(MPI.COMM_TYPE_SHARED, key=w.Get_rank())
    rows = node.allgather({"rank": w.Get_rank(), "gpus": [g.to_dict() for g in inv.gpus]})
    node.Free()
    t3 = time.perf_counter()
    out.setdefault("exchange", []).append(t1 - t0)
    out.setdefault("mpi", []).append(t3 - t2)
w.Barrier()
if %(missing)d and w.Get_rank() != w.Get_size() - 1:
    # the last rank never calls (a new round of the exchange): everyone else must raise within the deadline
    t0 = time.perf_counter()
    try:
        exchange(topo, inv, directory=%(folder)r, timeout=%(deadline)f)
        out["raised"] = False
    except LayoutTimeoutError as exc:
        out["raised"] = True
        out["missing"] = exc.missing
    out["seconds"] = time.perf_counter() - t0
print("BENCH " + json.dumps(out), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    mpirun = shutil.which("mpirun")
    if not mpirun:
        print("layout_exchange: mpirun not found (make env installs Open MPI)", file=sys.stderr)
        return 2
    folder = tempfile.mkdtemp(prefix="distmem-bench-layout-")
    prog = os.path.join(folder, "rank.py")
    with open(prog, "w") as f:
        f.write(RANK_PROG % dict(root=ROOT, repeats=args.repeats, folder=folder, missing=1, deadline=args.deadline))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", DISTMEM_QUIET="1")
    t0 = time.time()
    res = subprocess.run([mpirun, "--oversubscribe", "-np", str(args.ranks), sys.executable, prog], env=env,
                         capture_output=True, text=True, timeout=300)
    shutil.rmtree(folder, ignore_errors=True)
    # mpirun may join two ranks' lines into one: take every "BENCH {...}" wherever it is.
    rows = [json.loads(m.group(1)) for m in re.finditer(r"BENCH (\{.*?\})(?=BENCH |$)", res.stdout, re.M)]
    if res.returncode != 0 or len(rows) != args.ranks:
        print(res.stdout[-3000:], res.stderr[-3000:], file=sys.stderr)
        return 1
    ex = [max(r["exchange"][i] for r in rows) for i in range(args.repeats)]
    mp = [max(r["mpi"][i] for r in rows) for i in range(args.repeats)]
    fig, peer = statistics.median(ex), statistics.median(mp)
    lines = [{"bench": "layout_exchange", "ranks_per_host": args.ranks, "repeats": args.repeats,
              "figure": "slowest rank's node-local exchange, s (median of repeats)", "value_s": round(fig, 5),
              "peer": "MPI_Comm_split_type + allgather of the same records, slowest rank, s", "peer_s": round(peer, 5),
              "ratio": round(fig / peer, 3) if peer else None, "target_s": 0.2, "meets_target": fig <= 0.2,
              "all_exchange_s": [round(x, 5) for x in ex], "all_mpi_s": [round(x, 5) for x in mp],
              "machine": f"{os.cpu_count()} cores (oversubscribed)", "wall_s": round(time.time() - t0, 1)}]
    waiting = [r for r in rows if "raised" in r]
    lines.append({"bench": "layout_exchange_never_arrives", "ranks_per_host": args.ranks,
                  "deadline_s": args.deadline, "waiting_ranks": len(waiting),
                  "raised": sum(1 for r in waiting if r["raised"]),
                  "named_missing": sorted({m for r in waiting for m in r.get("missing", [])}),
                  "max_seconds": round(max(r["seconds"] for r in waiting), 3),
                  "figure": "slowest waiting rank's time to raise, s", "peer": "the deadline itself, s",
                  "ratio": round(max(r["seconds"] for r in waiting) / args.deadline, 3)})
    for line in lines:
        print(json.dumps(line))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
