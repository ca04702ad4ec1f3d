"""On one GPU, the closed loop: k processes sharing the GPU planned from the estimate vs from a
first run's report.

    PYTHONPATH=. python bench/report/postmortem_gpu.py --out /tmp/pmout --copy-to "$OUT"   # the device run

(The four out-of-memory errors this bench used to cause by hand - an allocation loop past a limit,
segments filled in a pattern, the GPU held from outside, a stage allocating past its plan - each
tested the rule it was written for. ``bench/report/postmortem_scenarios.py`` replaces them: training
jobs that run out of memory the way jobs do, each rerun with the change the post-mortem names.)

Closed loop: an MLP trained with Adam; phase 1 plans each process from distmem's estimate
(footprint: the estimator's margin + 10% headroom) and fits k1 = floor(budget / (limit + overhead))
processes in a stated budget; phase 2 plans from phase 1's report (init(from_report=...): peak +
10%) and fits k2 processes; both phases run and count OOMs. Result: from_report_gpu.json in
OUT_DIR, one JSON line on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

ROOT = runner.ROOT
MiB, GiB = 1024**2, 1024**3
WIDTH, DEPTH, BATCH, STEPS = 8192, 4, 512, 8
BUDGET = 40 * GiB


def env(run_dir: str, **extra: str) -> dict:
    e = dict(os.environ, PYTHONPATH=ROOT, DISTMEM_RUN_DIR=run_dir, DISTMEM_QUIET="1")
    e.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    e.update(extra)
    return e


def child(case: str, args: list) -> None:
    import torch  # before init(): its allocator observer is attached

    import distmem
    from distmem.observe.oom_record import note_step

    if case == "loop":
        limit, src, out = args[0], (args[1] if args[1] != "-" else None), args[2]
        plan = distmem.init(strategy="data", framework="torch", memory="limit", limit=int(limit), from_report=src,
                            verbose=False)
        torch.manual_seed(0)
        model = mlp(torch).cuda()
        opt = torch.optim.Adam(model.parameters())
        ooms = 0
        x = torch.randn(BATCH, WIDTH, device="cuda")
        for step in range(STEPS):
            note_step(step)
            try:
                opt.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
                opt.step()
            except torch.cuda.OutOfMemoryError:
                ooms += 1
        torch.cuda.synchronize()
        distmem.report(path=os.path.join(out, "report.json"), print_table=False)
        print(json.dumps({"ooms": ooms, "limit_bytes": plan.mine.limit_bytes,
                          "peak_bytes": torch.cuda.max_memory_allocated(),
                          "from_report": (plan.extras.get("from_report") or {}).get("changed")}), flush=True)


def mlp(torch):
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def spawn(case: str, run_dir: str, *args: str, **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", case, *args], cwd=ROOT,
                            env=env(run_dir, **extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait(p: subprocess.Popen, timeout: float) -> str:
    """The child's output; a child past ``timeout`` is killed and says so (the bench goes on)."""
    try:
        return p.communicate(timeout=timeout)[0] or ""
    except subprocess.TimeoutExpired:
        p.kill()
        return (p.communicate()[0] or "") + f"\n[killed after {timeout:.0f} s]"


def run_phase(out: str, k: int, limit: int, src: str) -> list:
    ps = []
    for i in range(k):
        d = os.path.join(out, f"rank{i}")
        os.makedirs(d, exist_ok=True)
        ps.append(spawn("loop", d, str(limit), src, d))
    rows = []
    for p in ps:
        text = wait(p, 150)
        last = [ln for ln in text.splitlines() if ln.startswith("{")]
        rows.append(json.loads(last[-1]) if last else {"ooms": None, "error": text[-1500:], "rc": p.returncode})
    return rows


def closed_loop(out: str) -> dict:
    import torch

    from distmem.estimate import estimate

    est = estimate(mlp(torch), batch_size=BATCH, optimizer="adam", input_shape=(WIDTH,), method="model")
    # the documented defaults a plan uses (README: 10% headroom over a demand, 768 MiB per process outside
    # the allocator), as a user reads them
    limit_est = est.footprint_bytes("torch", overhead_bytes=0, headroom=0.10)
    overhead = 768 * 1024 ** 2
    k1 = max(int(BUDGET // (limit_est + overhead)), 1)
    one = os.path.join(out, "loop-estimate")
    rows1 = run_phase(one, k1, limit_est, "-")
    src = os.path.join(one, "rank0", "report.json")
    from distmem import plan_from_env

    planned = plan_from_env(strategy="data", framework="torch", memory="limit", limit=limit_est, from_report=src)
    limit_obs = planned.mine.limit_bytes
    k2 = max(int(BUDGET // (limit_obs + overhead)), 1)
    rows2 = run_phase(os.path.join(out, "loop-from-report"), k2, limit_est, src)
    ooms1 = sum(r.get("ooms") or 0 for r in rows1)
    ooms2 = sum(r.get("ooms") or 0 for r in rows2)
    failed = [r for r in rows1 + rows2 if r.get("ooms") is None]
    return {"figure": "samples per step packed in the budget, planned from the last run's report", "budget_bytes": BUDGET,
            "model": f"MLP {DEPTH}x Linear({WIDTH},{WIDTH}) + Adam, batch {BATCH} per process",
            "per_process_overhead_bytes": overhead, "estimate_peak_bytes": est.train_bytes(),
            "estimate_limit_bytes": limit_est, "from_report_limit_bytes": limit_obs,
            "observed_peak_bytes": [r.get("peak_bytes") for r in rows1],
            "k_estimate": k1, "k_from_report": k2, "samples_estimate": k1 * BATCH, "samples_from_report": k2 * BATCH,
            "ratio": round(k2 / k1, 3), "ooms_estimate": ooms1, "ooms_from_report": ooms2,
            "processes_failed": len(failed), "failures": [f.get("error", "")[-800:] for f in failed][:3],
            "phase2_limits": [r.get("limit_bytes") for r in rows2]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs="+")
    ap.add_argument("--out", default=runner.results_path("postmortem_run"))
    ap.add_argument("--copy-to", help="copy the results file here")
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1:])
        return 0
    os.makedirs(a.out, exist_ok=True)
    from distmem.discover.gpus import inventory  # NVML: the parent starts no CUDA context of its own

    gpus = inventory(quiet=True).gpus
    device = gpus[0].name if gpus else "none"
    try:
        loop = closed_loop(a.out)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        import traceback

        loop = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    loop["device"] = device
    with open(os.path.join(a.out, "from_report_gpu.json"), "w") as f:
        json.dump(loop, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in loop.items() if k not in ("failures", "traceback")}), flush=True)
    if a.copy_to:
        import shutil

        os.makedirs(a.copy_to, exist_ok=True)
        shutil.copy(os.path.join(a.out, "from_report_gpu.json"), a.copy_to)
    return 0


if __name__ == "__main__":
    sys.exit(main())
