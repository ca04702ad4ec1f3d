"""OOM recovery benchmark: distmem's guard beside Accelerate's ``find_executable_batch_size`` under the
same fault, plus the per-step cost of the guard's flag all-reduce. One JSON line per case.

The fault: from global step ``--fault-step`` on, rank ``--fault-rank`` can no longer fit a micro-batch
above half the per-rank batch (say longer sequences arrived). On a GPU (``--device cuda``) that rank
gets a real per-process limit (``torch.cuda.set_per_process_memory_fraction``) calibrated between the
peak memory of the two sizes, so the OOM is the allocator's own; on a CPU the rank raises
``torch.cuda.OutOfMemoryError`` / ``tf.errors.ResourceExhaustedError`` itself when it would exceed that
budget (the only injected part).

Cases (all from one invocation, each launch under a hard timeout):
  distmem.recovery     guarded steps; the fallback halves the micro-batch on every rank. Figures: time
                       from the fault to the end of the first successful step (failing rank, and the
                       worst rank), its parts, step times before / after, final weights' checksums.
  distmem.flag_overhead  the same step with and without the flag all-reduce, interleaved (ABBA), on a
                       healthy job; plus the flag all-reduce alone.
  accelerate.find_executable_batch_size  each rank's training function under Accelerate's decorator,
                       gradients all-reduced every step (with a timeout, so a hang is caught and reported).
                       Figures: every rank's final batch size, restarts, whether a rank timed out.

Run:
    python3 -m venv /tmp/accel && /tmp/accel/bin/pip install torch==2.13.0 accelerate
    $(scripts/env.sh main | tail -1)/python bench/guard/oom_recovery.py --np 4 --peers /tmp/accel \\
        --out bench/results/oom_recovery.json
    # Horovod (Gloo) + TensorFlow, overhead and recovery only:
    ... bench/guard/oom_recovery.py --np 4 --framework tf --launcher horovodrun --out bench/results/oom_recovery_hvd.json
    # GPU machine (real OOM from a per-process limit on one rank; ~1-2 min; the peer line says
    # "skipped" where accelerate is not installed):
    python3 bench/guard/oom_recovery.py --np 2 --framework torch --device cuda --launch-timeout 240 \
        --out bench/results/oom_recovery_cuda.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

ROOT = runner.ROOT


# =============================================================================================== driver

def _launch(args: argparse.Namespace, mode: str, results: str, timeout: float) -> Tuple[int, str, float, bool]:
    bin_dir = os.environ.get("DISTMEM_ENV_BIN") or os.path.dirname(sys.executable)
    py = sys.executable
    worker = [py, os.path.abspath(__file__), "--worker", mode, "--results", results] + _forward(args)
    env = dict(os.environ)
    env.update({"PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1",
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                "OMPI_MCA_btl_vader_single_copy_mechanism": "none", "DISTMEM_QUIET": "1"})
    if args.launcher == "horovodrun":
        exe = os.path.join(bin_dir, "horovodrun")
        cmd = [exe, "-np", str(args.np), "-H", f"localhost:{args.np}", f"--{args.hvd_mode}"] + worker
    else:
        exe = shutil.which("mpirun")
        if exe is None:
            raise SystemExit("mpirun not found: install Open MPI")
        cmd = [exe, "-np", str(args.np), "--oversubscribe", "--bind-to", "none"]
        for k in ("PYTHONPATH", "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL", "DISTMEM_QUIET",
                  "OMPI_MCA_btl_vader_single_copy_mechanism"):
            cmd += ["-x", k]
        cmd += worker
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, time.monotonic() - t0, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, out, time.monotonic() - t0, True


def _forward(args: argparse.Namespace) -> List[str]:
    out = []
    for k in ("framework", "device", "steps", "local_batch", "fault_rank", "fault_step", "pairs", "timeout",
              "peers", "width", "depth", "launcher"):
        v = getattr(args, k)
        if v is not None:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def _rows(results: str, prefix: str) -> List[Dict[str, Any]]:
    rows = []
    for path in sorted(glob.glob(os.path.join(results, f"{prefix}-*.json"))):
        with open(path) as f:
            rows.append(json.load(f))
    return sorted(rows, key=lambda r: r["rank"])


def _median(xs: List[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def _summarise_distmem(rows: List[Dict[str, Any]], args, meta: Dict[str, Any]) -> List[Dict[str, Any]]:
    r0 = rows[0]
    fail = next((r for r in rows if r["rank"] == args.fault_rank), r0)
    fb = [f for f in fail["fallbacks"]]
    rec = {
        "bench": "oom_recovery", "case": "distmem.recovery", **meta,
        "transport": r0["transport"], "flag_transport": r0["flag_transport"],
        "local_batch": args.local_batch, "global_batch": args.local_batch * args.np,
        "micro_batch_before": r0["micro_before"], "micro_batch_after": r0["micro_after"],
        "same_micro_batch_on_all_ranks": len({r["micro_after"] for r in rows}) == 1,
        "same_fallbacks_on_all_ranks": len({json.dumps(r["fallback_view"]) for r in rows}) == 1,
        "final_weights_identical": len({r["checksum"] for r in rows}) == 1,
        "fault": fail.get("fault_kind"), "fault_error": (fb[0]["errors"].get(str(args.fault_rank)) if fb else None),
        "fallback_at_step": fb[0]["step"] if fb else None,
        "recovery_seconds_failing_rank": fb[0]["recovery_seconds"] if fb else None,
        "recovery_seconds_worst_rank": max((r["fallbacks"][0]["recovery_seconds"] or 0) for r in rows) if fb else None,
        "failing_rank_parts_seconds": ({k: round(fb[0][k], 6) for k in ("wasted_seconds", "agree_seconds", "free_seconds")}
                                       if fb else None),
        "step_seconds_before_p50": _median(r0["step_seconds"][1:r0["fault_step_index"]]),
        "failing_step_seconds": r0["step_seconds"][r0["fault_step_index"]] if fb else None,
        "step_seconds_after_p50": _median(r0["step_seconds"][r0["fault_step_index"] + 1:]),
        "steps": len(r0["step_seconds"]),
    }
    ov = {
        "bench": "oom_recovery", "case": "distmem.flag_overhead", **meta, "flag_transport": r0["flag_transport"],
        "pairs": r0["pairs"], "micro_batch": r0["micro_after"], "local_batch": args.local_batch,
        "flag_allreduce_us_p50": round(r0["flag_only_us_p50"], 1), "flag_allreduce_us_p90": round(r0["flag_only_us_p90"], 1),
        "step_ms_without_flag_p50": round(r0["without_p50"] * 1e3, 3), "step_ms_with_flag_p50": round(r0["with_p50"] * 1e3, 3),
        "overhead_us_p50_of_paired_differences": round(r0["paired_diff_p50"] * 1e6, 1),
        "overhead_pct": round(100 * r0["paired_diff_p50"] / r0["without_p50"], 2),
        "overhead_us_mean": round(r0["paired_diff_mean"] * 1e6, 1),
    }
    return [rec, ov]


def _summarise_peer(rows: List[Dict[str, Any]], args, meta: Dict[str, Any], rc: int, timed_out: bool,
                    wall: float, out: str) -> Dict[str, Any]:
    if rows and rows[0].get("skipped"):
        return {"bench": "oom_recovery", "case": "accelerate.find_executable_batch_size", **meta,
                "skipped": rows[0]["skipped"]}
    sizes = {str(r["rank"]): r["final_batch_size"] for r in rows}
    fail = next((r for r in rows if r["rank"] == args.fault_rank), None)
    return {
        "bench": "oom_recovery", "case": "accelerate.find_executable_batch_size", **meta,
        "accelerate_version": rows[0].get("accelerate_version") if rows else None,
        "ranks_reported": len(rows), "final_batch_size_by_rank": sizes,
        "divergent_batch_sizes": len(set(sizes.values())) > 1,
        "restarts_by_rank": {str(r["rank"]): len(r["attempts"]) - 1 for r in rows},
        "attempted_sizes_failing_rank": [a["batch_size"] for a in fail["attempts"]] if fail else None,
        "completed_ranks": [r["rank"] for r in rows if r["completed"]],
        "timed_out_ranks": [r["rank"] for r in rows if r["timed_out"]],
        "hang_caught_by_timeout": any(r["timed_out"] for r in rows), "collective_timeout_s": args.timeout,
        "errors": {str(r["rank"]): r["error"] for r in rows if r.get("error")},
        "global_batch_per_step_after_fault": sum(r["final_batch_size"] for r in rows),
        "global_batch_before_fault": args.local_batch * args.np,
        "recovery_seconds_failing_rank": fail.get("recovery_seconds") if fail else None,
        "steps_per_attempt_failing_rank": [a["steps"] for a in fail["attempts"]] if fail else None,
        "restarts_begin_at_step_0": True,  # the decorator calls the whole training function again
        "launch_rc": rc, "launch_killed_by_hard_timeout": timed_out, "launch_wall_s": round(wall, 1),
    }


def driver(args: argparse.Namespace) -> None:
    meta = {"framework": args.framework, "device": args.device, "ranks": args.np, "launcher": args.launcher
            + (f" --{args.hvd_mode}" if args.launcher == "horovodrun" else ""), "fault_rank": args.fault_rank,
            "fault_step": args.fault_step}
    lines: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="distmem-oom-bench-") as tmp:
        rc, out, wall, killed = _launch(args, "distmem", tmp, args.launch_timeout)
        rows = _rows(tmp, "distmem")
        if rc != 0 or len(rows) != args.np:
            sys.stderr.write(out[-6000:] + "\n")
            raise SystemExit(f"distmem worker launch failed (rc {rc}, killed {killed}, {len(rows)} of {args.np} rows)")
        lines += _summarise_distmem(rows, args, meta)
        if args.framework == "torch" and not args.skip_peer:
            rc, out, wall, killed = _launch(args, "accelerate", tmp, args.launch_timeout)
            prow = _rows(tmp, "accelerate")
            if not prow:
                sys.stderr.write(out[-6000:] + "\n")
            lines.append(_summarise_peer(prow, args, meta, rc, killed, wall, out))
    for line in lines:
        print(json.dumps(line), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


# =============================================================================================== workers

class Budget:
    """The fault: from global step ``start`` on, rank ``rank`` fits at most ``max_samples`` per micro-batch."""

    def __init__(self, args, rank: int, device: str):
        self.rank, self.start, self.device = args.fault_rank, args.fault_step, device
        self.max_samples = args.local_batch // 2
        self.me = rank
        self.armed = False
        self.limit_bytes: Optional[int] = None

    def arm_if_due(self, global_step: int) -> None:
        if self.me != self.rank or self.armed or global_step < self.start:
            return
        self.armed = True
        if self.device.startswith("cuda") and self.limit_bytes is not None:
            import torch

            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(self.limit_bytes / total, self.device)

    def check(self, n: int, framework: str) -> None:
        """On a CPU: raise the framework's OOM when this micro-batch would not fit the budget."""
        if not self.armed or n <= self.max_samples or self.device.startswith("cuda"):
            return
        if framework == "tf":
            import tensorflow as tf

            raise tf.errors.ResourceExhaustedError(None, None, f"OOM when allocating tensor with shape[{n},"
                                                               "4096] (budget of the benchmark's fault)")
        import torch

        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} samples' activations "
                                          "(budget of the benchmark's fault)")


def _torch_setup(args, rank: int):
    import torch

    device = "cpu"
    if args.device == "cuda":
        n = torch.cuda.device_count()
        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("LOCAL_RANK", rank)))
        device = f"cuda:{local % max(1, n)}"
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    layers: List[Any] = [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    for _ in range(args.depth - 1):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10)).to(device)
    return torch, model, device


def _batch(torch, args, rank: int, step: int, n: int, device: str):
    g = torch.Generator(device=device).manual_seed(rank * 100003 + step)  # made where it is used
    x = torch.randn(n, args.width, generator=g, device=device)
    y = torch.randint(0, 10, (n,), generator=g, device=device)
    return x, y


def _calibrate_cuda(torch, model, args, device: str) -> int:
    """A limit between the peaks of one micro-batch of the full and of the half per-rank batch."""
    import torch.nn.functional as F

    def peak(n: int) -> Tuple[int, int]:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        x, y = _batch(torch, args, 0, 0, n, device)
        for _ in range(2):
            model.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)

    full_alloc, _ = peak(args.local_batch)
    _, half_reserved = peak(args.local_batch // 2)
    model.zero_grad(set_to_none=True)
    if full_alloc <= half_reserved * 1.05:
        raise SystemExit(f"calibration: full batch peaks at {full_alloc} B allocated, half at {half_reserved} B "
                         "reserved: no room for a limit between them; raise --local-batch or --width")
    state = sum(p.numel() * p.element_size() for p in model.parameters())  # SGD momentum, allocated later
    return (full_alloc + half_reserved) // 2 + state


def worker_distmem(args) -> None:
    import numpy as np

    import distmem.guard as guard
    from distmem.comm import get_comm
    from distmem.guard.flags import FlagReducer, Status, encode

    if args.framework == "tf" and args.launcher == "horovodrun":
        import horovod.tensorflow as hvd

        hvd.init()
    comm = get_comm()
    rank, size = comm.rank, comm.size
    budget = Budget(args, rank, "cpu")
    if args.framework == "torch":
        torch, model, device = _torch_setup(args, rank)
        budget.device = device
        import torch.nn.functional as F

        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if device.startswith("cuda"):
            budget.limit_bytes = _calibrate_cuda(torch, model, args, device)

        def loss_of(xb, yb):
            budget.check(len(xb), "torch")
            return F.cross_entropy(model(xb), yb)

        def make(micro, flags=None):
            return guard.step(loss_of, params=list(model.parameters()), apply=lambda _: opt.step(),
                              micro_batch_size=micro, global_batch_size=args.local_batch * size, comm=comm,
                              timeout=max(60.0, args.timeout), flags=flags)

        def batch(step):
            return _batch(torch, args, rank, step, args.local_batch, device)

        def weights():
            return [p.detach().double().cpu().numpy() for p in model.parameters()]

        def sync():
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
    else:
        import tensorflow as tf

        tf.keras.utils.set_random_seed(0)
        layers = [tf.keras.layers.Input((args.width,))] + [tf.keras.layers.Dense(args.width, activation="relu")
                                                            for _ in range(args.depth)] + [tf.keras.layers.Dense(10)]
        model = tf.keras.Sequential(layers)
        opt = tf.keras.optimizers.SGD(0.01, momentum=0.9)
        loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function(reduce_retracing=True)
        def grads_of(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            return tape.gradient(loss, model.trainable_variables), loss

        apply_fn = tf.function(lambda g: opt.apply_gradients(zip(g, model.trainable_variables)))

        def fn(xb, yb):
            budget.check(int(xb.shape[0]), "tf")
            return grads_of(xb, yb)

        def make(micro, flags=None):
            return guard.step(fn, apply=lambda g: apply_fn(list(g)), micro_batch_size=micro,
                              global_batch_size=args.local_batch * size, comm=comm, timeout=max(60.0, args.timeout),
                              flags=flags)

        def batch(step):
            rng = np.random.default_rng(rank * 100003 + step)
            return (rng.normal(size=(args.local_batch, args.width)).astype("float32"),
                    rng.integers(0, 10, size=(args.local_batch,)))

        def weights():
            return [np.asarray(w, dtype=np.float64) for w in model.get_weights()]

        def sync():
            pass

    # ---- recovery
    step = make(args.local_batch)
    step_seconds: List[float] = []
    for i in range(args.steps):
        budget.arm_if_due(i)
        b = batch(i)
        t0 = time.perf_counter()
        step(*b)
        sync()
        step_seconds.append(time.perf_counter() - t0)
    fault_index = step.fallbacks[0].step if step.fallbacks else args.fault_step
    import hashlib

    h = hashlib.sha256()
    for w in weights():
        h.update(np.ascontiguousarray(w).tobytes())

    # ---- overhead: the same step with the real flag all-reduce and with a no-op in its place
    class NoFlags(FlagReducer):
        name = "none"

        def reduce(self, vec, timeout):
            return [0.0] * len(vec)

    with_flag = make(step.micro_batch_size)
    without = make(step.micro_batch_size, flags=NoFlags(rank, size))
    real_flags = with_flag.agreement.flags
    times = {"with": [], "without": []}
    for i in range(args.pairs + 5):
        b = batch(10_000 + i)
        order = ("with", "without") if i % 2 == 0 else ("without", "with")
        for name in order:
            s = with_flag if name == "with" else without
            t0 = time.perf_counter()
            s(*b)
            sync()
            if i >= 5:
                times[name].append(time.perf_counter() - t0)
    diffs = [a - b for a, b in zip(times["with"], times["without"])]
    comm.barrier(60)
    flag_us = []
    vec = encode(rank, size, Status.OK)
    for _ in range(300):
        t0 = time.perf_counter()
        real_flags.reduce(vec, 60)
        flag_us.append((time.perf_counter() - t0) * 1e6)
    flag_us.sort()
    row = {
        "rank": rank, "transport": comm.name, "flag_transport": real_flags.name,
        "micro_before": args.local_batch, "micro_after": step.micro_batch_size,
        "fallbacks": [f.to_dict() for f in step.fallbacks],
        "fallback_view": [[f.step, f.ranks, f.old_micro_batch, f.new_micro_batch] for f in step.fallbacks],
        "fault_kind": ("real CUDA OOM from set_per_process_memory_fraction" if budget.device.startswith("cuda")
                       else "framework OOM exception raised on a CPU memory budget"),
        "limit_bytes": budget.limit_bytes, "checksum": h.hexdigest()[:16], "step_seconds": step_seconds,
        "fault_step_index": fault_index, "pairs": len(diffs),
        "with_p50": statistics.median(times["with"]), "without_p50": statistics.median(times["without"]),
        "paired_diff_p50": statistics.median(diffs), "paired_diff_mean": statistics.fmean(diffs),
        "flag_only_us_p50": flag_us[len(flag_us) // 2], "flag_only_us_p90": flag_us[int(len(flag_us) * 0.9)],
    }
    with open(os.path.join(args.results, f"distmem-{rank}.json"), "w") as f:
        json.dump(row, f)
    comm.barrier(60)


def _file_barrier(results: str, prefix: str, size: int, deadline: float) -> None:
    while len(glob.glob(os.path.join(results, f"{prefix}-*.json"))) < size and time.monotonic() < deadline:
        time.sleep(0.2)


def worker_accelerate(args) -> None:
    """Accelerate's decorator on every rank; gradients all-reduced with a timeout. Ends with os._exit:
    after a divergence the ranks' collectives no longer match, and MPI_Finalize could hang on them."""
    from mpi4py import MPI

    import numpy as np

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    out_path = os.path.join(args.results, f"accelerate-{rank}.json")
    if args.peers:
        for sp in glob.glob(os.path.join(args.peers, "lib", "python*", "site-packages")):
            sys.path.append(sp)  # after the main environment: its torch, numpy and mpi4py win
    try:
        import accelerate
        from accelerate.utils import find_executable_batch_size
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"rank": 0, "skipped": f"accelerate is not importable ({type(exc).__name__}: {exc}); "
                           "install it into a venv and pass --peers VENV"}, f)
        os._exit(0)
    torch, model, device = _torch_setup(args, rank)
    import torch.nn.functional as F

    budget = Budget(args, rank, device)
    if device.startswith("cuda"):
        budget.limit_bytes = _calibrate_cuda(torch, model, args, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    comm = MPI.COMM_WORLD
    state: Dict[str, Any] = {"attempts": [], "global_steps": 0, "timed_out": False, "error": None, "completed": False,
                             "first_oom_at": None, "recovery_seconds": None, "steps_before_fault": None}

    def allreduce_with_timeout(buf: np.ndarray) -> np.ndarray:
        out = np.empty_like(buf)
        req = comm.Iallreduce(buf, out, op=MPI.SUM)
        deadline = time.monotonic() + args.timeout
        while not req.Test():
            if time.monotonic() > deadline:
                state["abandoned"] = (req, buf, out)  # keep the buffers alive
                raise TimeoutError(f"gradient all-reduce did not complete within {args.timeout} s")
            time.sleep(0.0005)
        return out

    @find_executable_batch_size(starting_batch_size=args.local_batch)
    def train(batch_size):
        state["attempts"].append({"batch_size": batch_size, "steps": 0})
        for i in range(args.steps):
            budget.arm_if_due(state["global_steps"])
            x, y = _batch(torch, args, rank, i, batch_size, device)
            try:
                budget.check(batch_size, "torch")
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
            except Exception as exc:
                if state["first_oom_at"] is None and "out of memory" in str(exc):
                    state["first_oom_at"] = time.monotonic()
                    state["steps_before_fault"] = state["global_steps"]
                raise
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().cpu().numpy()
            avg = allreduce_with_timeout(flat) / size
            pos = 0
            for p in model.parameters():
                k = p.numel()
                p.grad.copy_(torch.from_numpy(avg[pos:pos + k]).view_as(p).to(p.dtype))
                pos += k
            opt.step()
            state["global_steps"] += 1
            state["attempts"][-1]["steps"] += 1
            if state["first_oom_at"] is not None and state["recovery_seconds"] is None:
                state["recovery_seconds"] = time.monotonic() - state["first_oom_at"]
        return batch_size

    t0 = time.monotonic()
    try:
        train()
        state["completed"] = True
    except TimeoutError as exc:
        state["timed_out"], state["error"] = True, str(exc)
    except Exception as exc:  # noqa: BLE001 - reported
        state["error"] = f"{type(exc).__name__}: {exc}"[:300]
    row = {"rank": rank, "accelerate_version": accelerate.__version__, "completed": state["completed"],
           "timed_out": state["timed_out"], "error": state["error"], "attempts": state["attempts"],
           "final_batch_size": state["attempts"][-1]["batch_size"] if state["attempts"] else None,
           "recovery_seconds": state["recovery_seconds"],
           "wall_s": time.monotonic() - t0}
    with open(out_path, "w") as f:
        json.dump(row, f)
    _file_barrier(args.results, "accelerate", size, time.monotonic() + args.timeout * 3 + 30)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# =============================================================================================== main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=4, help="ranks")
    p.add_argument("--framework", choices=["torch", "tf"], default="torch")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--launcher", choices=["mpirun", "horovodrun"], default="mpirun")
    p.add_argument("--hvd-mode", choices=["gloo", "mpi"], default="gloo")
    p.add_argument("--steps", type=int, default=12, help="training steps of the recovery run")
    p.add_argument("--local-batch", type=int, default=None, help="samples per rank per step (cpu 64, cuda 8192)")
    p.add_argument("--width", type=int, default=None, help="hidden width (cpu 256, cuda 2048)")
    p.add_argument("--depth", type=int, default=3, help="hidden layers")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--pairs", type=int, default=None, help="interleaved with/without-flag step pairs (cpu 200, cuda 100)")
    p.add_argument("--timeout", type=float, default=15.0, help="collective timeout of the peer run (s)")
    p.add_argument("--launch-timeout", type=float, default=540.0, help="hard limit per launch (s)")
    p.add_argument("--peers", default=None, help="a venv with accelerate installed (its site-packages are appended)")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--out", default=None, help="also write the JSON lines here")
    p.add_argument("--worker", choices=["distmem", "accelerate"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--results", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.local_batch = a.local_batch or (8192 if a.device == "cuda" else 64)
    a.width = a.width or (2048 if a.device == "cuda" else 256)
    a.pairs = a.pairs or (100 if a.device == "cuda" else 200)
    if a.np < 2 or not 0 <= a.fault_rank < a.np:
        p.error(f"--np {a.np} and --fault-rank {a.fault_rank}: need 2+ ranks and a fault rank among them")
    if a.device == "cuda" and a.framework != "torch":
        p.error("--device cuda needs --framework torch (the GPU machine has no TensorFlow)")
    if a.fault_step >= a.steps:
        p.error(f"--fault-step {a.fault_step} must be below --steps {a.steps}")
    return a


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker == "distmem":
        worker_distmem(args)
    elif args.worker == "accelerate":
        worker_accelerate(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
