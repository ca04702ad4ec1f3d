"""The measured path (``estimate(..., method="measure")``) on every case of the zoo, each in a fresh
process as a user's job would run it: the model built and compiled as the zoo trains it, then
measured at the two small batches and carried to the target batch. One JSON line per case: the
measured small-batch peaks, the model's peaks at those batches and at the target, the measured
path's estimate, its cost in seconds (the whole call: steps, traces, the model's replays).

The references (the target batch's measured peak) are the zoo's own result files; scoring, per
extrapolation rule and on held-out halves, is ``bench/estimate/estimate_heldout.py``.

    python bench/estimate/estimate_measured_path.py --framework keras --out bench/results/estimate_measured_keras_tf215.jsonl
    PYTHONPATH=. python3 bench/estimate/estimate_measured_path.py --framework torch --out $OUT/measured_torch.jsonl  # GPU
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line
from bench.estimate import estimate_zoo as Z, estimate_zoo_keras as Zk, estimate_zoo_torch as Zt  # noqa: E402

ROOT = runner.ROOT


def _keras_case(c: Dict[str, Any]) -> Dict[str, Any]:
    import warnings
    from distmem.estimate import estimate
    _, K = Zk.keras_ns()
    model, _ = Zk.keras_build(c)
    model.compile(optimizer=Zk.keras_optimizer(c["optimizer"]), loss=Zk.keras_loss(model))
    t = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate(model, c["batch"], Zk.keras_optimizer(c["optimizer"]), method="measure", device="cpu")
    return _row(est, time.time() - t)


def _torch_case(c: Dict[str, Any]) -> Dict[str, Any]:
    import warnings
    import torch
    from distmem.estimate import estimate
    model, inputs = Zt.torch_build(c, "cuda")
    args, kwargs = inputs(c["batch"], "meta")
    opt = Zt.torch_optimizer(c["optimizer"], [torch.nn.Parameter(torch.zeros(2, 2))])
    prec = {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}.get(c["precision"])
    t = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate(model, c["batch"], opt, method="measure", example_input=kwargs or args, precision=prec,
                       device="cuda")
    return _row(est, time.time() - t)


def _row(est, seconds: float) -> Dict[str, Any]:
    m = est.measurement or {}
    detail = est.peak_detail()
    return {"measured_path": int(est.peak_bytes), "modelled_target": int(detail.get("modelled_peak", 0)),
            "points": m.get("points"), "modelled": m.get("modelled"), "device": m.get("device"),
            "step_peaks": m.get("steps"), "measure_seconds": m.get("seconds"), "seconds": round(seconds, 2),
            "rule": m.get("rule"), "warnings": list(est.warnings)}


def _worker(framework: str, case: str) -> int:
    c = json.loads(case)
    out = _keras_case(c) if framework == "keras" else _torch_case(c)
    print(json.dumps(out))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=("keras", "torch"), default="keras")
    p.add_argument("--models", default=None, help="comma-separated model names (a subset of the zoo)")
    p.add_argument("--out", default=None, help="JSON lines, one per case, appended as each finishes")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--skip-done", action="store_true", help="leave out cases already in --out")
    p.add_argument("--jobs", type=int, default=1, help="cases at once (GPU: each process's peaks are its own)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args.framework, args.worker)
    if not args.out:
        p.error("--out is required")
    # the hand-written cases first: a run stopped early has those
    cases = (Zk.KERAS_WRITTEN + [c for c in Zk.KERAS_CASES if c not in Zk.KERAS_WRITTEN] if args.framework == "keras"
             else Zt.TORCH_WRITTEN + [c for c in Zt.TORCH_CASES if c not in Zt.TORCH_WRITTEN])
    if args.models:
        keep = set(args.models.split(","))
        cases = [c for c in cases if c["model"] in keep]
    done = set()
    if args.skip_done and os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            done = {json.loads(line)["id"] for line in f if line.strip()}
    env = dict(os.environ, DISTMEM_MEASURE_CACHE="off", TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="1",
               TF_CPU_ALLOCATOR_USE_BFC="true")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    import threading
    from concurrent.futures import ThreadPoolExecutor
    lock = threading.Lock()

    def one(c: Dict[str, Any]) -> None:
        cid = Z.case_id(c)
        row: Dict[str, Any] = {"id": cid, **c}
        t = time.time()
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--framework", args.framework,
                                   "--worker", json.dumps(c)], capture_output=True, text=True, env=env,
                                  timeout=args.timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode or not lines:
                raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}")
            row.update(json.loads(lines[-1]))
        except Exception as exc:  # a case the measured path cannot run is a result: a crash
            row["error"] = str(exc)[-600:]
        row["process_seconds"] = round(time.time() - t, 1)
        print(f"[measured_path] {cid}: {row.get('measured_path', 0) / 2**20:.1f} MiB in {row.get('seconds')} s "
              f"{'ERROR ' + row['error'][-200:] if 'error' in row else ''}", file=sys.stderr, flush=True)
        with lock, open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, [c for c in cases if Z.case_id(c) not in done]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
