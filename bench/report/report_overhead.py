"""What observing memory costs: report() latency, the training-throughput cost of the Keras callback,
and rank 0's aggregation cost at 10,000 ranks. One JSON line per figure; baselines and peers are
measured in the same run, interleaved with the figure they are compared to.

Figures:
  report_latency      median seconds of distmem.report() (full gather, no printing) at 2 and 4 ranks,
                      under mpirun, horovodrun --gloo and horovodrun --mpi; peer: the transport's own
                      gather of the same snapshot dict (mpi4py comm.gather, or hvd.allgather_object),
                      calls interleaved with distmem's; ratio = distmem / peer.
  summary_latency     report(detail="summary") beside the full report of the same run; ratio = summary / full.
  callback_throughput examples/train.py's model under horovodrun -np 2 (or, with --only throughput_torch on
                      a GPU node, a torch loop with ReportEvery under mpirun -np 2): training steps per second with
                      MemoryReport(every_n_batches=100) against the same fit without it, segments
                      interleaved (with, without, without, with, ...); ratio = with / without, and the
                      overhead attributed directly (time inside the callback / wall time), which is
                      not swamped by this machine's run-to-run noise. Target: overhead <= 0.5 %.
  aggregation_10k     rank 0's cost to turn 10,000 received snapshot dicts into a Report with every
                      warning (Snapshot.from_dict + aggregate); baseline: unpickling the same payload
                      (what the transport itself costs). Target: < 0.5 s.

Run (main environment; a few minutes; keep the machine otherwise quiet for cleaner numbers):
    $(scripts/env.sh main | tail -1)/python bench/report/report_overhead.py --out bench/results/report_overhead.json
    ... --only aggregation            # one figure group: latency | throughput | aggregation
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

ROOT = runner.ROOT
sys.path.insert(0, os.path.join(ROOT, "tests"))

def _result(data: Dict[str, Any]) -> None:
    """Rank 0 of a worker job hands its figures to the driver through a file (launchers split long
    output lines)."""
    with open(os.environ["BENCH_RESULT_FILE"], "w", encoding="utf-8") as f:
        json.dump(data, f)


def _q(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ------------------------------------------------------------------------------------ workers (per rank)

def worker_latency(calls: int) -> None:
    """Every rank: interleave full report, summary report and the transport's raw gather; rank 0 times."""
    use_hvd = os.environ.get("BENCH_HOROVOD") == "1"
    if use_hvd:
        import horovod.tensorflow as hvd

        hvd.init()
    import distmem
    from distmem import comm as dcomm

    distmem.init(strategy="data", fleet="2x16GiB", framework="none", verbose=False)
    c = dcomm.get_comm()
    payload = distmem.snapshot().to_dict()
    if c.name == "mpi":
        world = c.comm
        barrier = world.Barrier
        peer_name = "mpi4py comm.gather (blocking, pickled dict)"

        def peer():
            world.gather(payload, root=0)
    else:
        import tensorflow as tf

        zero = tf.constant(0.0)
        n = {"i": 0}

        def barrier():
            n["i"] += 1
            hvd.allreduce(zero, name=f"bench.barrier.{n['i']}")

        peer_name = "horovod allgather_object (pickled dict)"

        def peer():
            n["i"] += 1
            hvd.allgather_object(payload, name=f"bench.peer.{n['i']}")

    from distmem.report.summary import local_vectors

    width = len(local_vectors(distmem.snapshot())[0])
    modes = {"full": lambda: distmem.report(timeout=60, print_table=False),
             "summary": lambda: distmem.report(timeout=60, detail="summary", print_table=False),
             "peer": peer,
             # Parts, to attribute the figures: distmem's own work and the transport's timed primitives.
             "part_snapshot": lambda: distmem.snapshot(),
             "part_comm_gather": lambda: c.gather(payload, 0, 60),
             "part_comm_allreduce": lambda: c.allreduce([1.0] * width, "sum", 60)}
    times: Dict[str, List[float]] = {k: [] for k in modes}
    order = list(modes)
    for i in range(calls + 10):
        for k in order[i % len(order):] + order[: i % len(order)]:  # rotate which goes first
            barrier()
            t0 = time.perf_counter()
            modes[k]()
            dt = time.perf_counter() - t0
            if i >= 10:  # warm-up calls are not counted
                times[k].append(dt)
    if c.rank == 0:
        _result({"transport": c.name, "size": c.size, "peer": peer_name,
                 "payload_bytes": len(pickle.dumps(payload)), "times": times})


def worker_throughput(steps: int, pairs: int, every: int) -> None:
    """Every rank: examples/train.py's model; fit segments with and without the callback, interleaved."""
    import distmem

    distmem.init(strategy="data", framework="tensorflow", verbose=False)
    import horovod.tensorflow.keras as hvd
    import numpy as np
    import tensorflow as tf

    hvd.init()
    tf.keras.utils.set_random_seed(1234 + hvd.rank())
    batch = 32
    x = np.random.rand(batch * 64, 32, 32, 3).astype("float32")
    y = np.random.randint(0, 10, size=(batch * 64,))
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
    model = tf.keras.Sequential([
        tf.keras.layers.Input((32, 32, 3)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(64, 3, activation="relu"),
        tf.keras.layers.GlobalAveragePooling2D(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    from distmem.keras import MemoryReport

    cb = MemoryReport(every_n_batches=every)
    model.fit(data, steps_per_epoch=every, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), cb])  # warm-up: traces, first gather
    seconds: Dict[str, List[float]] = {"with": [], "without": []}
    cb_seconds: List[float] = []
    for i in range(pairs):
        for variant in (("with", "without") if i % 2 == 0 else ("without", "with")):
            before = cb.every.seconds
            hvd.allreduce(tf.constant(0.0), name=f"bench.sync.{i}.{variant}")
            t0 = time.perf_counter()
            model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[cb] if variant == "with" else [])
            dt = time.perf_counter() - t0
            seconds[variant].append(dt)
            if variant == "with":
                cb_seconds.append(cb.every.seconds - before)
    # The per-batch hook on steps without a gather: its cost alone, many calls.
    hook = MemoryReport(every_n_batches=10 ** 9)
    hook.set_model(model)
    hook.on_train_begin()
    n = 200_000
    t0 = time.perf_counter()
    for b in range(n):
        hook.on_train_batch_end(b)
    hook_s = (time.perf_counter() - t0) / n
    # Time inside the gathers, from every rank: a rank that arrives early waits there for the others,
    # which it would otherwise have waited in the next gradient all-reduce; the last to arrive waits
    # least, so the minimum over ranks is the cost the callback adds.
    import horovod.tensorflow as hvd_tf

    per_rank = hvd_tf.allgather_object(cb_seconds, name="bench.cb_seconds")
    if hvd.rank() == 0:
        _result({"size": hvd.size(), "steps": steps, "pairs": pairs, "every": every, "seconds": seconds,
                 "gather_seconds": cb_seconds, "hook_seconds": hook_s, "gather_seconds_by_rank": per_rank,
                 "gathers_per_segment": steps // every})


def worker_throughput_torch(steps: int, pairs: int, every: int) -> None:
    """Every rank (mpirun, one GPU each): a torch training loop whose gradients are all-reduced through
    MPI every step (as DDP would keep ranks in step); segments with ReportEvery(every) and without,
    interleaved."""
    from mpi4py import MPI

    import distmem

    distmem.init(framework="torch", verbose=False)
    import torch

    from distmem.report.periodic import ReportEvery

    comm = MPI.COMM_WORLD
    plan = distmem.current_plan()
    dev = torch.device(f"cuda:{plan.mine.devices[0].index}") if plan.mine.devices else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(128, 128, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(128, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9)
    b, hw = (4, 32) if os.environ.get("BENCH_SMALL") == "1" else (128, 128)  # small: a CPU smoke test only
    x = torch.randn(b, 3, hw, hw, device=dev)
    y = torch.randint(0, 10, (b,), device=dev)
    params = list(model.parameters())

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params]).cpu().numpy()  # syncs the device, as DDP waits
        comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        off = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(torch.from_numpy(flat[off:off + n]).view_as(p.grad))
            off += n
        opt.step()

    every_obj = ReportEvery(every)
    for _ in range(every):  # warm-up: kernels, allocator, first gather
        step()
        every_obj.step()
    seconds: Dict[str, List[float]] = {"with": [], "without": []}
    cb_seconds: List[float] = []
    for i in range(pairs):
        for variant in (("with", "without") if i % 2 == 0 else ("without", "with")):
            comm.Barrier()
            before = every_obj.seconds
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
                if variant == "with":
                    every_obj.step()
            seconds[variant].append(time.perf_counter() - t0)
            if variant == "with":
                cb_seconds.append(every_obj.seconds - before)
    n = 200_000
    hook = ReportEvery(10 ** 9)
    t0 = time.perf_counter()
    for _ in range(n):
        hook.step()
    hook_s = (time.perf_counter() - t0) / n
    per_rank = comm.gather(cb_seconds, root=0)
    if comm.Get_rank() == 0:
        _result({"size": comm.Get_size(), "steps": steps, "pairs": pairs, "every": every, "seconds": seconds,
                 "gather_seconds": cb_seconds, "hook_seconds": hook_s, "gather_seconds_by_rank": per_rank,
                 "gathers_per_segment": steps // every, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda"
                 else "cpu"})


# ------------------------------------------------------------------------------------------- in process

def aggregation(n: int = 10_000, repeats: int = 9) -> Dict[str, Any]:
    """Rank 0's work for n received snapshots: dicts -> Snapshots -> Report with warnings."""
    from distmem.report.aggregate import Snapshot, aggregate
    from distmem.units import GiB, MiB

    rows = []
    per_host = 8
    for r in range(n):
        host, local = f"node{r // per_host:05d}", r % per_host
        pid = 10_000 + r
        peak = (40 + (r % 13)) * GiB if r % 97 else 79 * GiB  # a few ranks near their limit
        pids = [pid] + ([4242] if r % 500 == 0 else [])  # a foreign process here and there
        rows.append(Snapshot(rank=r, size=n, local_rank=local, host=host, pid=pid, framework="torch",
                             strategy="data", devices=[local],
                             allocation={"mode": "growth", "devices": [{"index": local, "shared_by": 1}]},
                             limit_bytes=80 * GiB, enforced=False, current_bytes=peak - 3 * GiB, peak_bytes=peak,
                             reserved_bytes=peak + GiB, nvml_bytes={local: peak + GiB + 700 * MiB}, rss_bytes=9 * GiB,
                             gpu_pids={local: pids}, gpu_uuids={local: f"GPU-{host}-{local}"},
                             gpu_process_bytes={local: {p: peak for p in pids}}, step=1000,
                             plan_fingerprint="0123456789abcdef", plan_source="nvml",
                             overhead_bytes=768 * MiB).to_dict())
    payload = pickle.dumps(rows)
    from distmem.report import summary as sm

    vecs = [(s, *sm.local_vectors(s)) for s in (Snapshot.from_dict(d) for d in rows)]
    rs = [sum(col) for col in zip(*[v[1] for v in vecs])]
    rm = [max(col) for col in zip(*[v[2] for v in vecs])]
    holders, stage_holders = sm._holders([max(col) for col in zip(*[sm._holder_vector(s, mv, rm) for s, _, mv in vecs])])
    details = [sum(col) for col in zip(*[sm._detail_vector(s, holders) for s, _, _ in vecs])]
    build_report = sm.build_report
    del vecs
    agg_t, agg_cpu, base_t, summ_t = [], [], [], []
    rep = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        pickle.loads(payload)
        base_t.append(time.perf_counter() - t0)
        t0, c0 = time.perf_counter(), time.process_time()
        snaps = [Snapshot.from_dict(d) for d in rows]
        rep = aggregate(snaps, n, [], strategy="data")
        agg_t.append(time.perf_counter() - t0)
        agg_cpu.append(time.process_time() - c0)
        # Summary mode: rank 0 holds only the reduced vectors; its own work is build_report().
        t0 = time.perf_counter()
        build_report(n, "data", rs, rm, holders, stage_holders, details)
        summ_t.append(time.perf_counter() - t0)
    return {"bench": "report_overhead", "figure": "aggregation_10k", "ranks": n,
            "median_s": statistics.median(agg_t), "min_s": min(agg_t), "max_s": max(agg_t),
            "cpu_median_s": statistics.median(agg_cpu), "target_s": 0.5, "meets_target": statistics.median(agg_t) < 0.5,
            "baseline": "pickle.loads of the gathered payload", "baseline_median_s": statistics.median(base_t),
            "ratio": statistics.median(agg_t) / statistics.median(base_t), "payload_bytes": len(payload),
            "warnings": len(rep.warnings), "warning_kinds": rep.kinds(),
            "summary_rank0_s": statistics.median(summ_t), "repeats": repeats,
            "note": "wall time counts other processes' load on this machine; cpu_median_s is this process's own"}


# ------------------------------------------------------------------------------------------------ driver

def _launch(launcher: str, np: int, args: List[str], timeout: float, env: Dict[str, str]) -> Dict[str, Any]:
    from helpers import horovodrun, mpirun

    import tempfile

    me = [os.path.abspath(__file__)] + args
    fd, path = tempfile.mkstemp(prefix="distmem-bench-", suffix=".json")
    os.close(fd)
    env = dict(env, BENCH_RESULT_FILE=path)
    try:
        if launcher == "mpirun":
            res = mpirun(np, me, timeout=timeout, env=env)
        else:
            res = horovodrun(np, me, mode=launcher.split("-")[1], timeout=timeout, env=env)
        if res.timed_out or res.rc != 0 or not os.path.getsize(path):
            raise RuntimeError(f"{launcher} -np {np} {' '.join(args)}: exit {res.rc}, timed out {res.timed_out}\n"
                               f"{res.out[-4000:]}")
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    finally:
        os.unlink(path)


def latency(calls: int, sizes: Sequence[int], launchers: Sequence[str]) -> List[Dict[str, Any]]:
    out = []
    for launcher in launchers:
        for np in sizes:
            env = {"DISTMEM_QUIET": "1", "BENCH_HOROVOD": "1" if launcher.startswith("horovodrun") else "0"}
            r = _launch(launcher, np, ["--worker", "latency", "--calls", str(calls)], 600, env)
            t = r["times"]
            med = {k: statistics.median(v) for k, v in t.items()}
            common = {"bench": "report_overhead", "launcher": launcher, "np": np, "transport": r["transport"],
                      "calls": len(t["full"]), "payload_bytes": r["payload_bytes"]}
            parts = {k[5:] + "_median_s": v for k, v in med.items() if k.startswith("part_")}
            out.append({**common, "figure": "report_latency", "mode": "full", "median_s": med["full"],
                        "p90_s": _q(t["full"], 0.9), "peer": r["peer"], "peer_median_s": med["peer"],
                        "ratio": med["full"] / med["peer"], "parts": parts})
            out.append({**common, "figure": "summary_latency", "mode": "summary", "median_s": med["summary"],
                        "p90_s": _q(t["summary"], 0.9), "baseline": "full report, same run",
                        "baseline_median_s": med["full"], "ratio": med["summary"] / med["full"],
                        "peer": r["peer"], "peer_median_s": med["peer"]})
    return out


def throughput(steps: int, pairs: int, every: int, np: int = 2, torch_loop: bool = False) -> Dict[str, Any]:
    launcher = "mpirun" if torch_loop else "horovodrun-gloo"
    r = _launch(launcher, np, ["--worker", "throughput_torch" if torch_loop else "throughput", "--steps", str(steps),
                               "--pairs", str(pairs), "--every", str(every)], 600,
                {"DISTMEM_QUIET": "1", "NCCL_NVLS_ENABLE": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                 "BENCH_SMALL": os.environ.get("BENCH_SMALL", "0")})
    w, wo = r["seconds"]["with"], r["seconds"]["without"]
    sps_with = [steps / s for s in w]
    sps_without = [steps / s for s in wo]
    pair_ratios = [a / b for a, b in zip(sps_with, sps_without)]
    # Per segment: the least time any rank spent inside the gathers (see worker_throughput).
    by_rank = r["gather_seconds_by_rank"]
    least = [min(rank_s[i] for rank_s in by_rank) for i in range(len(by_rank[0]))]
    most = [max(rank_s[i] for rank_s in by_rank) for i in range(len(by_rank[0]))]
    gather_per_segment = statistics.median(least)
    attributed = (gather_per_segment + steps * r["hook_seconds"]) / statistics.median(w)
    return {"bench": "report_overhead", "figure": "callback_throughput", "np": np, "launcher": launcher,
            "loop": ("torch loop + ReportEvery, gradients all-reduced through MPI each step, on "
                     f"{r.get('device')}") if torch_loop else "examples/train.py model, Keras fit + MemoryReport",
            "step_seconds_without": statistics.median(wo) / steps, "every_n_batches": every, "steps_per_segment": steps, "pairs": pairs,
            "steps_per_s_with": statistics.median(sps_with), "baseline": "same fit without the callback, interleaved",
            "steps_per_s_without": statistics.median(sps_without), "ratio": statistics.median(pair_ratios),
            "pair_ratios": [round(x, 4) for x in pair_ratios],
            "overhead_attributed": attributed, "gather_seconds_per_segment": gather_per_segment,
            "gather_seconds_per_segment_slowest_rank": statistics.median(most),
            "overhead_upper_bound": (statistics.median(most) + steps * r["hook_seconds"]) / statistics.median(w),
            "gathers_per_segment": r["gathers_per_segment"], "hook_seconds_per_batch": r["hook_seconds"],
            "target_overhead": 0.005, "meets_target_attributed": attributed <= 0.005}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=["latency", "throughput", "throughput_torch"], help=argparse.SUPPRESS)
    p.add_argument("--calls", type=int, default=200, help="timed report() calls per mode and launch")
    p.add_argument("--steps", type=int, default=300, help="training steps per throughput segment")
    p.add_argument("--pairs", type=int, default=4, help="with/without segment pairs")
    p.add_argument("--every", type=int, default=100, help="callback period in batches")
    p.add_argument("--sizes", default="2,4", help="rank counts for the latency figures")
    p.add_argument("--launchers", default="mpirun,horovodrun-gloo,horovodrun-mpi")
    p.add_argument("--only", choices=["latency", "throughput", "throughput_torch", "aggregation"], action="append",
                   help="figure groups to run (repeatable); throughput_torch needs GPUs, torch and mpirun")
    p.add_argument("--out", help="also write the JSON lines here")
    p.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    args = p.parse_args(argv)
    if args.worker == "latency":
        worker_latency(args.calls)
        return 0
    if args.worker == "throughput":
        worker_throughput(args.steps, args.pairs, args.every)
        return 0
    if args.worker == "throughput_torch":
        worker_throughput_torch(args.steps, args.pairs, args.every)
        return 0
    only = set(args.only or ["latency", "throughput", "aggregation"])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        if not args.append:
            open(args.out, "w").close()

    def emit(rows: List[Dict[str, Any]]) -> None:
        for row in rows:
            row["machine"] = {"host": platform.node(), "cpus": os.cpu_count(), "load1": round(os.getloadavg()[0], 2),
                              "python": platform.python_version()}
            print(json.dumps(row), flush=True)
            if args.out:  # line by line: a later failure keeps what was measured
                with open(args.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row, default=str) + "\n")

    if "aggregation" in only:
        emit([aggregation()])
    if "latency" in only:
        for launcher in args.launchers.split(","):
            emit(latency(args.calls, [int(x) for x in args.sizes.split(",")], [launcher]))
    if "throughput" in only:
        emit([throughput(args.steps, args.pairs, args.every)])
    if "throughput_torch" in only:
        emit([throughput(args.steps, args.pairs, args.every, torch_loop=True)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
