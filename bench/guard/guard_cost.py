"""The guard's cost per step, paired in one run: the same 20 ms step with no guard, with the guard's
blocking protocol (the flag all-reduce waited before the gradient all-reduce: the baseline) and with
the overlapped one (the verdict carried in the gradient all-reduce's own buffer).

    python bench/guard/guard_cost.py --np 4 --rounds 300 --out bench/results/guard_cost.json

Launches itself under ``mpirun -np N`` (mpi4py: the gradients' ``Allreduce`` and the flags'
``Iallreduce`` on distmem's communicator). Each rank's step: 20 ms of compute (a sleep: the CPU waits
as it does on a GPU's kernels), then NumPy gradients of ``--floats`` float32 (two tensors) averaged
over the ranks, then the update. ``distmem.init()`` starts fail fast, so ``overlap="auto"`` is on.
Variants: ``overlapped`` (the default: distmem's own reducer, the verdict one element of its
buffer), ``separate_flags`` (the same step with a reducer of the user's, which cannot carry the
verdict: the flags' ``Iallreduce`` posted before it and waited after it, the protocol before),
``machinery`` (that one with a no-op flag exchange: the guard's own Python per step) and
``control`` (the unguarded step again: what the pairing reads where nothing differs). Each round
runs the variants once, in an order that rotates every round, so drift hits them all alike; the
figure is the median over the rounds of the per-round difference (guarded minus unguarded) on rank
0, over the median unguarded step. One JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

ROOT = runner.ROOT

__all__ = ["main"]


def worker(args: argparse.Namespace) -> None:
    import numpy as np

    import distmem
    from distmem import guard
    from distmem.comm import get_comm
    from distmem.guard.grads import gradient_reducer

    distmem.init(fleet="4x16GiB", framework="none", verbose=False)
    comm = get_comm()
    rank, size = comm.rank, comm.size
    rng = np.random.default_rng(rank)
    g = [rng.standard_normal(args.floats).astype("float32"), rng.standard_normal(args.floats // 4).astype("float32")]
    w = [np.zeros_like(x) for x in g]
    step_s = args.step_ms / 1000.0

    def grads_of(x):
        time.sleep(step_s)  # the step's compute
        return [g[0] * float(x[0]), g[1]], 0.0

    def apply(grads):
        for wi, gi in zip(w, grads):
            wi -= 1e-3 * gi

    reducer = gradient_reducer(comm, g)

    def plain(x):
        grads, _ = grads_of(x)
        apply(reducer(grads))

    blocking = guard.step(grads_of, apply=apply, micro_batch_size=1, comm=comm, overlap=False,
                          reduce_gradients=reducer)
    overlapped = guard.step(grads_of, apply=apply, micro_batch_size=1, comm=comm, overlap="auto",
                            reduce_gradients=reducer)
    from distmem.comm import FlagReducer, PostedFlags

    class NoFlags(FlagReducer):
        """The guard's machinery without a flag exchange (the verdict is always clean): what is left
        of the overlapped cost that is not the flags."""

        name = "none"
        overlaps = True

        def reduce(self, vec, timeout):
            return [0.0] * len(vec)

        def post(self, vec):
            return PostedFlags(self, vec)

    def own_reducer(grads):  # a reducer of the user's: it cannot carry the verdict
        return reducer(grads)

    separate = guard.step(grads_of, apply=apply, micro_batch_size=1, comm=comm, overlap="auto",
                          reduce_gradients=own_reducer)
    machinery = guard.step(grads_of, apply=apply, micro_batch_size=1, comm=comm, overlap=True,
                           reduce_gradients=own_reducer, flags=NoFlags(rank, size))
    def control(x):  # the unguarded step again: what the pairing reads where nothing differs
        grads, _ = grads_of(x)
        apply(reducer(grads))

    variants = {"plain": plain, "blocking": blocking, "overlapped": overlapped, "separate_flags": separate,
                "machinery": machinery, "control": control}
    x = np.ones(1, dtype="float32")
    for _ in range(5):  # warm-up (the overlapped guard switches after its first clean step)
        for fn in variants.values():
            fn(x)
    times: Dict[str, List[float]] = {k: [] for k in variants}
    names = list(variants)
    for i in range(args.rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            t0 = time.perf_counter()
            variants[name](x)
            times[name].append(time.perf_counter() - t0)
    comm.barrier(60)
    rows = comm.allgather({"rank": rank, "times": times, "overlapped": overlapped.overlapped,
                           "verdict_in_gradients": overlapped.verdict_in_gradients,
                           "separate_overlapped": separate.overlapped,
                           "flag_transport": overlapped.agreement.flags.name}, 120)
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(rows, f)


def summarise(rows: List[Dict[str, Any]], args: argparse.Namespace) -> Dict[str, Any]:
    r0 = rows[0]["times"]
    plain = statistics.median(r0["plain"])

    def paired(name: str, times: Dict[str, List[float]]) -> float:
        return statistics.median([a - b for a, b in zip(times[name], times["plain"])])

    out: Dict[str, Any] = {"bench": "guard_cost", "launcher": "mpirun", "ranks": len(rows), "step_ms": args.step_ms,
                           "gradient_floats": args.floats + args.floats // 4, "rounds": args.rounds,
                           "flag_transport": rows[0]["flag_transport"], "overlapped_active": rows[0]["overlapped"],
                           "verdict_in_gradients": rows[0]["verdict_in_gradients"],
                           "separate_flags_overlapped": rows[0]["separate_overlapped"],
                           "plain_step_ms_p50": round(plain * 1e3, 3)}
    for name in ("blocking", "overlapped", "separate_flags", "machinery", "control"):
        d = paired(name, r0)
        out[f"{name}_overhead_us"] = round(d * 1e6, 1)
        out[f"{name}_overhead_pct"] = round(100 * d / plain, 3)
        per_rank = [paired(name, r["times"]) for r in rows]
        out[f"{name}_overhead_pct_per_rank"] = [round(100 * d / plain, 3) for d in per_rank]
    out["figure"] = "overlapped_overhead_pct"
    out["baseline"] = "blocking_overhead_pct (the protocol before: flags waited before the gradient all-reduce)"
    out["ratio_blocking_over_overlapped"] = (round(out["blocking_overhead_us"] / out["overlapped_overhead_us"], 2)
                                             if out["overlapped_overhead_us"] > 0 else None)
    # the pairing's own reading where nothing differs (the unguarded step against itself): a guard's
    # figure within it of zero is not distinguishable from the step's own jitter
    out["overlapped_minus_control_pct"] = round(out["overlapped_overhead_pct"] - out["control_overhead_pct"], 3)
    out["target_pct"] = 0.2
    out["loadavg_1m_before_after"] = getattr(args, "_load", None)
    return out


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--floats", type=int, default=65536, help="floats of the first gradient (the second: a quarter)")
    ap.add_argument("--out")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import tempfile

    bin_dir = os.environ.get("DISTMEM_ENV_BIN") or os.path.dirname(sys.executable)
    mpirun = os.path.join(bin_dir, "mpirun") if os.path.exists(os.path.join(bin_dir, "mpirun")) else shutil.which("mpirun")
    if not mpirun:
        raise SystemExit("bench/guard/guard_cost.py: mpirun not found")
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out_rows = os.path.join(tmp, "rows.json")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), DISTMEM_QUIET="1",
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = [mpirun, "-np", str(args.np), "--oversubscribe", "--bind-to", "none", "-x", "PYTHONPATH", "-x",
               "DISTMEM_QUIET", sys.executable, os.path.abspath(__file__), "--worker", "--worker-out", out_rows,
               "--rounds", str(args.rounds), "--step-ms", str(args.step_ms), "--floats", str(args.floats)]
        res = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
        if res.returncode != 0 or not os.path.exists(out_rows):
            raise SystemExit(f"bench/guard/guard_cost.py: the launch failed (rc {res.returncode}):\n{res.stdout[-3000:]}\n"
                             f"{res.stderr[-3000:]}")
        with open(out_rows) as f:
            rows = json.load(f)
    args._load = [round(load0, 1), round(os.getloadavg()[0], 1)]
    line = summarise(rows, args)
    runner.emit(line, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
