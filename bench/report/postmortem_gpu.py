"""On one GPU: four deliberate out-of-memory errors, each in child processes with distmem.init()'s
hooks, and whether `distmem postmortem` names each cause; then the closed loop: k processes sharing
the GPU planned from the estimate vs from a first run's report.

    PYTHONPATH=. python bench/report/postmortem_gpu.py --out /tmp/pmout --copy-to "$OUT"   # the device run

(``--copy-to`` copies the two results files and one picture per case: six files, the device run's
limit is eight; the run folders stay in ``--out``.)

Cases (each its own run folder):
  over_plan      a process allocates past its plan's hard limit (torch's per-process fraction, 4 GiB)
  fragmentation  6 MiB blocks fill 20 MiB segments, two of every three freed; a 1 GiB request fails
                 under an 8 GiB limit while 5 GiB of the pool is free
  foreign        another process (not in the job) holds all but 14 GiB of the GPU; a process planned
                 40 GiB runs out well within its plan
  wrong_stage    a 2-stage pipeline (torchrun's variables, two processes) planned from stage sizes of
                 3 GiB and 1 GiB; stage 1 really needs more
Closed loop: an MLP trained with Adam; phase 1 plans each process from distmem's estimate
(footprint: the estimator's margin + 10% headroom) and fits k1 = floor(budget / (limit + overhead))
processes in a stated budget; phase 2 plans from phase 1's report (init(from_report=...): peak +
10%) and fits k2 processes; both phases run and count OOMs. Results: postmortem_gpu.json and
from_report_gpu.json in OUT_DIR, one JSON line each on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

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

    keep = []
    if case == "over_plan":
        distmem.init(strategy="data", framework="torch", memory="limit", limit="4GiB", verbose=False)
        try:
            torch.cuda.memory._record_memory_history(max_entries=100000)
        except Exception as exc:  # noqa: BLE001 - grouping by frame is optional
            print(f"no allocator history: {exc}", flush=True)
        for step in range(100):
            note_step(step)
            keep.append(torch.empty(600 * MiB // 4, device="cuda"))
    elif case == "fragmentation":
        distmem.init(strategy="data", framework="torch", memory="limit", limit="8GiB", verbose=False)
        note_step(1)
        small = []
        while torch.cuda.memory_reserved() < int(7.3 * GiB):
            small.append(torch.empty(6 * MiB // 4, device="cuda"))
        keep = small[::3]
        del small
        note_step(2)
        keep.append(torch.empty(GiB // 4, device="cuda"))
    elif case == "foreign_hog":
        free, total = torch.cuda.mem_get_info(0)
        hog = torch.empty(max(free - 14 * GiB, GiB) // 4, device="cuda")
        print("ready", flush=True)
        time.sleep(float(args[0]))
        del hog
    elif case == "foreign":
        distmem.init(strategy="data", framework="torch", memory="limit", limit="40GiB", verbose=False)
        for step in range(100):
            note_step(step)
            keep.append(torch.empty(2 * GiB // 4, device="cuda"))
    elif case == "wrong_stage":
        plan = distmem.init(strategy="pipeline", framework="torch", memory="limit", stages=["3GiB", "1GiB"],
                            verbose=False)
        if plan.mine.stage == 0:
            keep.append(torch.empty(GiB // 4, device="cuda"))
            time.sleep(2)
        else:
            for step in range(100):
                note_step(step)
                keep.append(torch.empty(256 * MiB // 4, device="cuda"))
    elif case == "loop":
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


def postmortem(run_dir: str) -> dict:
    try:
        return _postmortem(run_dir)
    except (subprocess.TimeoutExpired, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:1000]}


def _postmortem(run_dir: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "distmem.cli", "postmortem", run_dir, "--json"], cwd=ROOT,
                         env=env(run_dir), capture_output=True, text=True, timeout=60)
    text = subprocess.run([sys.executable, "-m", "distmem.cli", "postmortem", run_dir, "--plot",
                           os.path.join(run_dir, "postmortem.png")], cwd=ROOT, env=env(run_dir),
                          capture_output=True, text=True, timeout=60).stdout
    page = json.loads(out.stdout) if out.stdout.strip() else {"error": out.stderr[-2000:]}
    page["text"] = text
    return page


def oom_cases(out: str) -> dict:
    results = {}
    expected = {"over_plan": "over_plan", "fragmentation": "fragmentation", "foreign": "foreign_process",
                "wrong_stage": "wrong_stage"}
    for case, cause in expected.items():
        run_dir = os.path.join(out, "oom-" + case)
        os.makedirs(run_dir, exist_ok=True)
        t0 = time.monotonic()
        logs = []
        if case == "foreign":
            hog = spawn("foreign_hog", os.path.join(out, "hog"), "40")
            assert hog.stdout is not None
            line = hog.stdout.readline()
            logs.append("hog: " + line.strip())
            p = spawn(case, run_dir)
            logs.append(wait(p, 90)[-1500:])
            hog.kill()
            wait(hog, 30)
        elif case == "wrong_stage":
            ps = [spawn(case, run_dir, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                        TORCHELASTIC_RUN_ID=f"pm-{os.getpid()}") for r in range(2)]
            logs += [wait(p, 120)[-1500:] for p in ps]
        else:
            p = spawn(case, run_dir, DISTMEM_TORCH_EXPANDABLE_SEGMENTS="0")
            logs.append(wait(p, 90)[-1500:])
        page = postmortem(run_dir)
        named = [c["kind"] for e in page.get("entries", []) for c in e["causes"]]
        results[case] = {"expected": cause, "named": named, "correct": bool(named) and named[0] == cause,
                         "ranks_out": page.get("ranks_out"), "seconds": round(time.monotonic() - t0, 1),
                         "text": page.get("text", ""), "entries": page.get("entries"),
                         "child_log_tail": [lg[-600:] for lg in logs]}
        print(f"{case}: named {named} (expected {cause})", file=sys.stderr, flush=True)
    return results


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

    from distmem import defaults
    from distmem.estimate import estimate

    est = estimate(mlp(torch), batch_size=BATCH, optimizer="adam", input_shape=(WIDTH,), method="model")
    limit_est = est.footprint_bytes("torch", overhead_bytes=0, headroom=defaults.LIMIT_HEADROOM)
    overhead = defaults.OVERHEAD_BYTES
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
    ap.add_argument("--skip-loop", action="store_true")
    ap.add_argument("--copy-to", help="copy the results files and one picture per case here")
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1:])
        return 0
    os.makedirs(a.out, exist_ok=True)
    from distmem.discover.gpus import inventory  # NVML: the parent starts no CUDA context of its own

    gpus = inventory(quiet=True).gpus
    device = gpus[0].name if gpus else "none"
    cases = oom_cases(a.out)
    pm = {"figure": "deliberate OOMs whose cause distmem postmortem names correctly", "device": device,
          "correct": sum(c["correct"] for c in cases.values()), "of": len(cases), "cases": cases}
    with open(os.path.join(a.out, "postmortem_gpu.json"), "w") as f:
        json.dump(pm, f, indent=1, default=str)
    print(json.dumps({k: pm[k] for k in ("figure", "device", "correct", "of")}
                     | {"named": {k: v["named"] for k, v in cases.items()}}), flush=True)
    if not a.skip_loop:
        try:
            loop = closed_loop(a.out)
        except Exception as exc:  # noqa: BLE001 - the OOM cases' results are kept either way
            import traceback

            loop = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        loop["device"] = device
        with open(os.path.join(a.out, "from_report_gpu.json"), "w") as f:
            json.dump(loop, f, indent=1, default=str)
        print(json.dumps({k: v for k, v in loop.items() if k not in ("failures", "traceback")}), flush=True)
    if a.copy_to:
        import shutil

        os.makedirs(a.copy_to, exist_ok=True)
        for name in ("postmortem_gpu.json", "from_report_gpu.json"):
            if os.path.exists(os.path.join(a.out, name)):
                shutil.copy(os.path.join(a.out, name), a.copy_to)
        for case in cases:
            png = os.path.join(a.out, "oom-" + case, "postmortem.png")
            if os.path.exists(png):
                shutil.copy(png, os.path.join(a.copy_to, f"postmortem_{case}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
