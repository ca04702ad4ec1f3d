"""The estimator against measured training-step peaks on a wide zoo nobody tuned it for.

Same method as ``bench/estimate/estimate_accuracy.py``: each case is measured in a fresh subprocess over
four full training steps (forward, backward, optimizer update), the largest allocator peak of the
four (the first included) is the reference, and the estimate is computed in the parent without
running the model.

* Keras on CPU (TF 2.15 / Keras 2 and TF 2.21 / Keras 3): every ``keras.applications`` family at
  two input sizes, GRU, bidirectional LSTM, LSTM, Conv1D, a transformer encoder, an embedding-heavy
  recommender, an MLP; SGD, momentum, RMSprop, Adam, AdamW; ``mixed_float16`` and
  ``mixed_bfloat16``. Reference: ``tf.config.experimental.get_memory_info('CPU:0')['peak']``.
* PyTorch on CUDA: torchvision families (vision transformers among them) and Hugging Face
  ``transformers`` models built from configs with random weights (encoder, decoder,
  encoder-decoder); fp32, autocast bf16, autocast fp16 with ``GradScaler``; SGD-momentum,
  RMSprop, Adam, AdamW, Adafactor. Reference: ``torch.cuda.max_memory_allocated()``. The peer,
  in the same run: PyTorch's own ``MemTracker`` (``torch.distributed._tools.mem_tracker``) under
  ``FakeTensorMode``, the method torchtitan's estimator uses.

Beside each estimate: a naive baseline, ``weight bytes x (2 + optimizer slots) + the sum of layer
outputs x batch``. One JSON line (the summary) goes to stdout, the full result to ``--out``.

    python bench/estimate/estimate_zoo.py --framework keras --out bench/results/estimate_accuracy_keras_tf215.json
    PYTHONPATH=. python3 bench/estimate/estimate_zoo.py --framework torch --out $OUT/torch.json     # on a GPU
    python bench/estimate/estimate_zoo.py --framework torch --estimate-only                         # CPU: estimates run
    python bench/estimate/estimate_zoo.py --framework keras --reuse OLD.json --out NEW.json         # re-estimate only

``--reuse`` takes the measured peaks of an earlier result file (same case ids, same measuring
code) and recomputes only the estimates: the measurements do not depend on the estimator.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line
from bench.estimate.estimate_zoo_keras import COST, KERAS_CASES, keras_estimate, keras_measure, keras_ns  # noqa: E402
from bench.estimate.estimate_zoo_torch import TORCH_CASES, torch_estimate, torch_measure, torch_memtracker  # noqa: E402


STEPS = 4
TARGETS = {"keras": {"mean_abs_err": 0.03, "max_abs_err": 0.08, "worst_under": -0.03},
           "torch": {"mean_abs_err": 0.015, "max_abs_err": 0.05, "worst_under": -0.02}}


def log(msg: str) -> None:
    print(f"[estimate_zoo] {msg}", file=sys.stderr, flush=True)


def case_id(c: Dict[str, Any]) -> str:
    return "{model}@{size}/b{batch}/{optimizer}/{precision}".format(**c)


def add_case_arguments(p) -> None:
    """The positional arguments naming one zoo case: MODEL SIZE BATCH OPTIMIZER PRECISION."""
    p.add_argument("model")
    p.add_argument("size", type=int)
    p.add_argument("batch", type=int)
    p.add_argument("optimizer")
    p.add_argument("precision")


def case_of(args) -> Dict[str, Any]:
    """The case dict of parsed :func:`add_case_arguments` arguments."""
    return {k: getattr(args, k) for k in ("model", "size", "batch", "optimizer", "precision")}




def stats(rows: List[Dict[str, Any]], key: str) -> Dict[str, Any]:
    errs = [r[f"{key}_err"] for r in rows if r.get(f"{key}_err") is not None]
    if not errs:
        return {"cases": 0}
    a = [abs(e) for e in errs]
    return {"cases": len(errs), "mean_abs_err": round(sum(a) / len(a), 4),
            "median_abs_err": round(statistics.median(a), 4), "max_abs_err": round(max(a), 4),
            "worst_under": round(min(min(errs), 0.0), 4),
            "share_under": round(sum(1 for e in errs if e < 0) / len(errs), 3)}


def _worker(args) -> int:
    c = json.loads(args.worker)
    if args.framework == "keras":
        out = keras_measure(c, args.steps)
    elif args.peer:
        out = torch_memtracker(c)
    else:
        out = torch_measure(c, args.steps)
    print(json.dumps(out))
    return 0


def _subprocess(framework: str, c: Dict[str, Any], steps: int, timeout: int, peer: bool = False) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--framework", framework, "--worker", json.dumps(c),
           "--steps", str(steps)] + (["--peer"] if peer else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = runner.ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    env.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}")
    return json.loads(lines[-1])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=("keras", "torch"), default="keras")
    p.add_argument("--models", default=None, help="comma-separated model names (a subset of the zoo)")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--estimate-only", action="store_true", help="estimate every case, measure nothing")
    p.add_argument("--no-peer", dest="peer", action="store_false", help="torch: skip MemTracker")
    p.add_argument("--reuse", default=None, help="take measured peaks (and the peer's) from this earlier result")
    p.add_argument("--out", default=None)
    p.add_argument("--jsonl", default=None, help="also write one JSON line per case, then the summary line")
    p.add_argument("--timeout", type=int, default=600, help="seconds per measuring subprocess")
    p.add_argument("--jobs", type=int, default=1, help="measuring subprocesses at once (GPU: 4 is fine)")
    p.add_argument("--fast-first", action="store_true", help="measure the quick cases first (a shared CPU)")
    p.add_argument("--no-estimate", action="store_true", help="measure only (estimate later with --reuse)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--peer", dest="peer_worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.peer = args.peer_worker
        return _worker(args)
    cases, env, estimate_fn, reused = _setup(args)
    t0 = time.time()
    rows = _estimate_rows(cases, estimate_fn, args.no_estimate)
    _measure_rows(rows, args, reused)
    _score(rows)
    return _write(rows, args, env, t0)


def _setup(args):
    """The cases asked for, the environment to record, the estimating function, earlier rows to reuse."""
    fw = args.framework
    cases = KERAS_CASES if fw == "keras" else TORCH_CASES
    if args.models:
        keep = set(args.models.split(","))
        cases = [c for c in cases if c["model"] in keep]
    reused: Dict[str, Dict[str, Any]] = {}
    if args.reuse:
        with open(args.reuse, encoding="utf-8") as f:
            reused = {r["id"]: r for r in json.load(f)["rows"]}
    env: Dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    if fw == "keras":
        tf, K = keras_ns()
        env.update(tensorflow=tf.__version__, keras=getattr(K, "__version__", None), measured_on="CPU:0",
                   TF_ENABLE_ONEDNN_OPTS=os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                   TF_CPU_ALLOCATOR_USE_BFC=os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"))
        estimate_fn = keras_estimate
    else:
        import torch
        env["torch"] = torch.__version__
        env["measured_on"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        try:
            import transformers
            env["transformers"] = transformers.__version__
        except ImportError:
            cases = [c for c in cases if not c["model"].startswith("hf_")]
            log("transformers is not importable: the hf_* cases are left out")
        estimate_fn = torch_estimate
    return cases, env, estimate_fn, reused


def _estimate_rows(cases, estimate_fn, no_estimate: bool) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    for c in cases:  # estimates first, one after another in this process (their speed is reported)
        cid = case_id(c)
        row: Dict[str, Any] = {"id": cid, **c}
        if no_estimate:
            rows.append(row)
            continue
        try:
            row.update(estimate_fn(c))
        except Exception as exc:  # an estimate that cannot run is a result, reported as such
            row["estimate_error"] = f"{type(exc).__name__}: {exc}"[:500]
            log(f"{cid}: estimate failed: {row['estimate_error']}")
        log(f"{cid}: ours {row.get('ours', 0) / 2**20:.1f} MiB [{row.get('estimate_seconds', '?')} s]")
        rows.append(row)

    return rows


def _measure_rows(rows: List[Dict[str, Any]], args, reused: Dict[str, Dict[str, Any]]) -> None:
    fw = args.framework
    measure = not args.estimate_only

    def measure_row(row: Dict[str, Any]) -> None:
        c = {k: row[k] for k in ("model", "size", "batch", "optimizer", "precision")}
        old = reused.get(row["id"])
        if old and old.get("measured"):
            for k in ("measured", "measured_steps", "measured_spread", "peer", "peer_steps", "peer_error",
                      "peer_seconds", "step_seconds", "max_reserved", "measured_source", "measured_at"):
                if k in old:
                    row[k] = old[k]
            # the run that measured it, through any number of re-estimates
            row["measured_reused_from"] = old.get("measured_reused_from") or \
                (None if old.get("measured_at") else os.path.basename(args.reuse))
            return
        if not measure:
            return
        try:
            m = _subprocess(fw, c, args.steps, args.timeout)
            row["measured"] = max(m["peaks"])
            row["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            row["measured_steps"] = m["peaks"]
            row["measured_spread"] = round((max(m["peaks"]) - min(m["peaks"])) / max(m["peaks"]), 4)
            row["step_seconds"] = m["step_seconds"]
            if "max_reserved" in m:
                row["max_reserved"] = m["max_reserved"]
        except Exception as exc:
            row["measure_error"] = str(exc)[-500:]
            log(f"{row['id']}: measuring failed: {row['measure_error']}")
        if fw == "torch" and args.peer and row.get("measured"):
            try:
                row.update(_subprocess(fw, c, args.steps, args.timeout, peer=True))
            except Exception as exc:
                row["peer_error"] = str(exc)[-300:]

    # each measurement is its own process; on a GPU several can share it (each process's
    # max_memory_allocated is its own), on a shared CPU one at a time
    import threading
    from concurrent.futures import ThreadPoolExecutor
    lock = threading.Lock()

    def measure_and_save(row: Dict[str, Any]) -> None:
        measure_row(row)
        if args.out:  # a checkpoint after every case, so a run stopped early keeps what it measured
            with lock, open(args.out + ".partial", "w", encoding="utf-8") as f:
                json.dump({"rows": rows}, f)
    order = sorted(rows, key=lambda r: COST.get(r["model"], 5)) if args.fast_first else rows
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(measure_and_save, order))


def _score(rows: List[Dict[str, Any]]) -> None:
    for row in rows:
        if row.get("measured") and row.get("ours"):
            row["ours_err"] = round(row["ours"] / row["measured"] - 1, 4)
            row["baseline_err"] = round(row["baseline"] / row["measured"] - 1, 4)
            if row.get("peer"):
                row["peer_err"] = round(row["peer"] / row["measured"] - 1, 4)
        if row.get("measured"):
            msg = (f"{row['id']}: ours {row.get('ours', 0) / 2**20:.1f} MiB, measured {row['measured'] / 2**20:.1f} "
                   f"MiB ({100 * row.get('ours_err', 0):+.1f}%), baseline {100 * row.get('baseline_err', 0):+.1f}%")
            if row.get("peer_err") is not None:
                msg += f", MemTracker {100 * row['peer_err']:+.1f}%"
            log(msg)


def _write(rows: List[Dict[str, Any]], args, env: Dict[str, Any], t0: float) -> int:
    fw = args.framework
    result: Dict[str, Any] = {
        "bench": "estimate_zoo", "framework": fw, "env": env,
        "measured": ("get_memory_info('CPU:0')['peak'] (TensorFlow CPU allocator)" if fw == "keras"
                     else "torch.cuda.max_memory_allocated()"),
        "peak_of": f"max over {args.steps} training steps (first included), each case in a fresh process",
        "cases": len(rows), "ours": stats(rows, "ours"), "baseline": stats(rows, "baseline"),
        "targets": TARGETS[fw], "seconds": round(time.time() - t0, 1),
    }
    if fw == "torch":
        result["peer"] = {"name": "torch.distributed._tools.mem_tracker.MemTracker under FakeTensorMode",
                          **stats(rows, "peer"),
                          "could_not_run": sum(1 for r in rows if r.get("peer_error"))}
    s = result["ours"]
    if s.get("cases"):
        t = TARGETS[fw]
        result["targets_met"] = (s["mean_abs_err"] <= t["mean_abs_err"] and s["max_abs_err"] <= t["max_abs_err"]
                                 and s["worst_under"] >= t["worst_under"])
        result["misses"] = [r["id"] for r in rows if r.get("ours_err") is not None and
                            (abs(r["ours_err"]) > t["max_abs_err"] or r["ours_err"] < t["worst_under"])]
    result["rows"] = rows
    runner.emit({k: v for k, v in result.items() if k != "rows"}, args.out, full=result)
    if args.out:
        log(f"wrote {args.out}")
    if args.jsonl:
        write_jsonl(result, args.jsonl)
        log(f"wrote {args.jsonl}")
    return 0


def write_jsonl(result: Dict[str, Any], path: str) -> None:
    """Per-case rows (measured, ours, baseline and their errors), then one summary line: mean,
    median and max absolute error, worst under-estimate and share of under-estimates, ours and
    the naive baseline's."""
    keep = ("id", "model", "size", "batch", "optimizer", "precision", "measured", "measured_steps", "ours",
            "ours_err", "baseline", "baseline_err", "peer", "peer_err", "phase", "warnings", "measure_error",
            "estimate_error", "measured_reused_from", "measured_at")
    with open(path, "w", encoding="utf-8") as f:
        for row in result["rows"]:
            f.write(json.dumps({k: row[k] for k in keep if k in row}) + "\n")
        f.write(json.dumps({"summary": True, **{k: v for k, v in result.items() if k != "rows"}}) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
