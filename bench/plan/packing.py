"""Packing benchmark: how much of a GPU k tenants can really use, and whether one takes a neighbour's.

k = 1, 2, 4 ranks per GPU on two GPUs (``mpirun -np 2k``), three policies measured in the same run:

  distmem  distmem.init(framework="torch"): equal split, a hard limit per rank when k > 1
  naive    the TensorFlow guides' fixed fraction: set_per_process_memory_fraction(0.9 / k) per rank
  none     no limit at all: every rank grows until the GPU is full

Every tenant starts CUDA on its GPU, waits for the others (MPI barrier), then all tenants of all GPUs
allocate at once: 256 MiB chunks until OOM, then 128, 64, 32, 16 MiB and 1 MiB (small-pool blocks,
so at most ~2 MiB is left unclaimed). Figures, per policy and k, from NVML (pynvml directly) and torch:

  efficiency  bytes all tenants hold (torch's allocated bytes) / sum over GPUs of
              (NVML total - sum of the tenants' measured context sizes); a context = the process's NVML
              usage minus torch's reserved bytes, measured in the same run
  promised    what a tenant was told it could have: distmem its planned share, naive its fraction of
              CUDA's total, none an equal part of what CUDA left after the contexts
  cross-tenant OOMs  tenants that ran out more than 32 MiB below their promise (k > 1)
  init_s      seconds from the policy's first call to a first tensor on the GPU (fresh process)

One JSON line per policy x k: ``figure`` (efficiency), ``baseline`` (naive at the same k), ``ratio``;
then a summary line. ``--out`` also writes them to one JSON file. Each launch runs in fresh processes
with a hard timeout; the whole run stays within ``--budget`` seconds (default 170).

    PYTHONPATH=. python3 bench/plan/packing.py --out $OUT/packing.json          # on the GPU machine
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

ROOT = runner.ROOT
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu", "progs"))

import gpuprobe  # noqa: E402

MiB = gpuprobe.MiB
TOL = 32 * MiB
POLICIES = ("distmem", "naive", "none")
NAIVE_FRACTION = 0.9


# ------------------------------------------------------------------------------------------- tenant

def tenant(args: argparse.Namespace) -> None:
    """One rank of one launch: set the policy up, fill together with the others, report figures."""
    gpuprobe.setup()

    def body(comm: Any) -> None:
        import torch  # noqa: F401 - imported before the clock starts, as in a real job

        import distmem

        rank, size = comm.Get_rank(), comm.Get_size()
        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
        n = args.gpus
        k = size // n
        index = local % n
        nv = gpuprobe.Nvml()
        comm.Barrier()
        t0 = time.monotonic()
        promised: Optional[int] = None
        limit: Optional[int] = None
        if args.policy == "distmem":
            plan = distmem.init(framework="torch", verbose=rank == 0)
            slot = plan.mine.devices[0]
            index, promised = slot.index, slot.planned_bytes
            gpu = gpuprobe.Gpu(index)
            setup_s = time.monotonic() - t0
        else:
            gpu = gpuprobe.Gpu(index)
            gpu.pin()
            if args.policy == "naive":
                gpu.set_fraction(NAIVE_FRACTION / k)
            setup_s = time.monotonic() - t0
        gpu.touch()
        init_s = time.monotonic() - t0
        free0, cuda_total = gpu.mem_get_info()
        if args.policy == "naive":
            limit = promised = int(NAIVE_FRACTION / k * cuda_total)
        elif args.policy == "distmem" and k > 1:
            limit = promised
        comm.Barrier()
        held: List[Any] = []
        fill = gpu.fill(held)
        comm.Barrier()  # everyone is full: now look
        physical = nv.index_of(gpu.uuid())
        physical = index if physical is None else physical
        row = {"rank": rank, "local_rank": local, "index": index, "physical": physical, "pid": os.getpid(),
               "setup_s": round(setup_s, 4), "init_s": round(init_s, 4), "promised": promised, "limit": limit,
               "cuda_total": cuda_total, "cuda_free_before": free0, "fill": fill,
               "nvml_process": nv.where().get(physical), "gpu": {k2: v for k2, v in nv.gpu(physical).items()
                                                                if k2 != "procs"}}
        comm.Barrier()
        gpu.release(held)
        rows = comm.gather(row, root=0)
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump({"policy": args.policy, "k": k, "gpus": n, "rows": rows}, f)
        comm.Barrier()

    gpuprobe.mpi_main(body)


# ------------------------------------------------------------------------------------- orchestrator

def _mpirun(np: int, argv: List[str], timeout: float) -> Dict[str, Any]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1",
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "NCCL_NVLS_ENABLE": "0",
                "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "DISTMEM_QUIET": env.get("DISTMEM_QUIET", "0")})
    env.setdefault("OMPI_MCA_pml", "ob1")  # keeps UCX (and its CUDA transports) out of the measurement
    env.setdefault("OMPI_MCA_btl", "self,vader,tcp")
    cmd = ["mpirun", "-np", str(np), "--oversubscribe", "--bind-to", "none", sys.executable] + argv
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return {"rc": proc.returncode, "out": out, "seconds": time.monotonic() - t0, "timed_out": False}
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return {"rc": -9, "out": out, "seconds": time.monotonic() - t0, "timed_out": True}


def _wait_idle(nv: gpuprobe.Nvml, gpus: List[int], pids_before: Dict[int, set], timeout: float = 30.0) -> float:
    """Wait until no process of an earlier launch is left on the GPUs (their memory is back)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(set(nv.procs(g)) <= pids_before[g] for g in gpus):
            break
        time.sleep(0.25)
    return time.monotonic() - t0


def evaluate(data: Dict[str, Any], totals: Dict[int, int]) -> Dict[str, Any]:
    """Figures of one launch (pure: tenant rows and NVML totals in, one result row out)."""
    rows = data["rows"]
    k, policy = data["k"], data["policy"]
    by_gpu: Dict[int, List[Dict[str, Any]]] = {}
    for r in rows:
        r["context"] = (r["nvml_process"] - r["fill"]["reserved"]) if r["nvml_process"] is not None else None
        by_gpu.setdefault(r["physical"], []).append(r)
    held = denom = 0
    cross: List[Dict[str, Any]] = []
    per_gpu = []
    for g, ts in sorted(by_gpu.items(), key=lambda kv: str(kv[0])):
        ctx = [t["context"] for t in ts]
        if None in ctx:
            raise RuntimeError(f"NVML attributes no memory to the tenants of GPU {g} (pid namespace?): "
                               f"{[t['nvml_process'] for t in ts]}")
        got = sum(t["fill"]["allocated"] for t in ts)
        room = totals[g] - sum(ctx)
        fair = (ts[0]["cuda_total"] - sum(ctx)) // len(ts)  # what an even split of CUDA's memory gives
        for t in ts:
            t["promised_eff"] = t["promised"] if t["promised"] is not None else fair
            short = t["promised_eff"] - t["fill"]["allocated"]
            if short > TOL:
                t["short_bytes"] = short
                if len(ts) > 1:
                    cross.append({"rank": t["rank"], "gpu": g, "short_mib": round(short / MiB, 1),
                                  "got_mib": round(t["fill"]["allocated"] / MiB, 1)})
        held += got
        denom += room
        per_gpu.append({"gpu": g, "tenants": len(ts), "held_mib": round(got / MiB, 1), "room_mib": round(room / MiB, 1),
                        "efficiency": round(got / room, 5), "nvml_total_mib": round(totals[g] / MiB, 1),
                        "cuda_total_mib": round(ts[0]["cuda_total"] / MiB, 1),
                        "context_mib": [round(c / MiB, 1) for c in ctx],
                        "per_tenant_mib": [round(t["fill"]["allocated"] / MiB, 1) for t in ts],
                        "promised_mib": [round(t["promised_eff"] / MiB, 1) for t in ts]})
    shorts = [r for r in rows if "short_bytes" in r]
    return {"policy": policy, "k": k, "tenants": len(rows), "efficiency": held / denom if denom else None,
            "held_bytes": held, "room_bytes": denom, "cross_tenant_ooms": len(cross), "cross_tenant": cross,
            "below_promise": len(shorts), "init_s_max": max(r["init_s"] for r in rows),
            "init_s_mean": sum(r["init_s"] for r in rows) / len(rows),
            "setup_s_mean": sum(r["setup_s"] for r in rows) / len(rows),
            "fill_s_max": max(r["fill"]["seconds"] for r in rows), "gpus": per_gpu}


def orchestrate(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    deadline = t_start + args.budget
    nv = gpuprobe.Nvml()
    if nv.count < args.gpus:
        print(json.dumps({"bench": "packing", "error": f"needs {args.gpus} GPUs, NVML sees {nv.count}"}), flush=True)
        return 2
    gpus = list(range(args.gpus))
    info = [nv.gpu(g) for g in gpus]
    totals = {g["index"]: g["total"] for g in info}
    pids_before = {g: set(nv.procs(g)) for g in gpus}
    machine = {"host": platform.node(), "driver": nv.driver(), "gpus": [{k: g[k] for k in ("index", "name", "total",
                                                                                            "reserved", "used")}
                                                                         for g in info],
               "python": platform.python_version()}
    try:
        import torch

        machine["torch"], machine["cuda"] = torch.__version__, torch.version.cuda
    except ImportError:
        pass
    results: List[Dict[str, Any]] = []
    skipped: List[Dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="distmem-packing-")
    order = [(p, k) for p in args.policies for k in args.ks]
    for n_done, (policy, k) in enumerate(order):
        left = deadline - time.monotonic()
        if left < args.min_launch:
            skipped.append({"policy": policy, "k": k, "why": f"time budget: {left:.0f} s left"})
            continue
        _wait_idle(nv, gpus, pids_before)
        out = os.path.join(tmp, f"{policy}-k{k}.json")
        res = _mpirun(k * args.gpus, [os.path.abspath(__file__), "--tenant", "--policy", policy, "--gpus",
                                      str(args.gpus), "--out", out], timeout=min(args.launch_timeout, left))
        tail = res["out"][-2500:]
        if res["timed_out"] or res["rc"] != 0 or not os.path.exists(out):
            why = "timed out" if res["timed_out"] else f"exit code {res['rc']}"
            row = {"bench": "packing", "policy": policy, "k": k, "error": why, "seconds": round(res["seconds"], 1),
                   "log_tail": tail}
            print(json.dumps(row), flush=True)
            skipped.append(row)
            continue
        with open(out) as f:
            data = json.load(f)
        try:
            ev = evaluate(data, totals)
        except RuntimeError as exc:
            skipped.append({"policy": policy, "k": k, "error": str(exc)})
            print(json.dumps({"bench": "packing", "policy": policy, "k": k, "error": str(exc)}), flush=True)
            continue
        ev["launch_s"] = round(res["seconds"], 1)
        ev["rows"] = data["rows"]
        results.append(ev)
        print(json.dumps({"bench": "packing", "policy": policy, "k": k,
                          "efficiency": round(ev["efficiency"], 5), "cross_tenant_ooms": ev["cross_tenant_ooms"],
                          "init_s_max": round(ev["init_s_max"], 3), "launch_s": ev["launch_s"]}), flush=True)
    lines = []
    naive = {r["k"]: r for r in results if r["policy"] == "naive"}
    for r in results:
        base = naive.get(r["k"])
        line = {"bench": "packing", "metric": "packing_efficiency", "policy": r["policy"], "k": r["k"],
                "figure": round(r["efficiency"], 5), "unit": "fraction of (NVML total - k x measured context)",
                "baseline_policy": f"naive {NAIVE_FRACTION}/k", "baseline": round(base["efficiency"], 5) if base else None,
                "ratio": round(r["efficiency"] / base["efficiency"], 4) if base else None,
                "cross_tenant_ooms": r["cross_tenant_ooms"], "below_promise": r["below_promise"],
                "init_s_max": round(r["init_s_max"], 3), "init_s_mean": round(r["init_s_mean"], 3),
                "baseline_init_s_mean": round(base["init_s_mean"], 3) if base else None,
                "per_gpu": r["gpus"], "cross_tenant": r["cross_tenant"]}
        lines.append(line)
        print(json.dumps(line), flush=True)
    ours = [r for r in results if r["policy"] == "distmem"]
    summary = {"bench": "packing", "summary": True, "target": "distmem >= 0.98 with 0 cross-tenant OOMs at every k",
               "distmem_min_efficiency": round(min(r["efficiency"] for r in ours), 5) if ours else None,
               "distmem_cross_tenant_ooms": sum(r["cross_tenant_ooms"] for r in ours) if ours else None,
               "target_met": bool(ours) and len(ours) == len(args.ks) and all(
                   r["efficiency"] >= 0.98 and r["cross_tenant_ooms"] == 0 for r in ours),
               "skipped": skipped, "seconds": round(time.monotonic() - t_start, 1)}
    print(json.dumps(summary), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"bench": "packing", "machine": machine, "created": time.time(), "tolerance_bytes": TOL,
                       "chunks_mib": list(gpuprobe.CHUNKS_MIB), "lines": lines, "summary": summary,
                       "launches": results}, f, indent=1, default=str)
    return 0 if results else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write every line and the raw tenant rows here (JSON)")
    p.add_argument("--ks", default="1,2,4", help="ranks per GPU to try")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--gpus", type=int, default=2, help="GPUs to pack (ordinals 0..n-1)")
    p.add_argument("--budget", type=float, default=170.0, help="seconds for the whole run")
    p.add_argument("--launch-timeout", type=float, default=75.0, help="hard timeout of one mpirun launch")
    p.add_argument("--min-launch", type=float, default=20.0, help="do not start a launch with less time left")
    p.add_argument("--tenant", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.tenant:
        tenant(args)
        return 0
    args.ks = [int(x) for x in args.ks.split(",") if x]
    args.policies = [x for x in args.policies.split(",") if x]
    bad = [x for x in args.policies if x not in POLICIES]
    if bad:
        p.error(f"unknown policies {bad}; choose from {', '.join(POLICIES)}")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
