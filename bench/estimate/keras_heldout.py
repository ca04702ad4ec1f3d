"""Keras estimates against measured training-step peaks, on models written the way TensorFlow users
write them and on keras.applications (``keras_models.py``), through the public door.

Per case, each part in a fresh process (one JSON line per part, appended to ``--out`` as it is
done, so a long run resumes where it stopped):

* ``reference``: the model compiled as its task compiles it, ``model.train_on_batch`` at the
  target batch for ``--steps`` steps (default 6), then ``model.fit`` on the same batch from a
  ``tf.data`` dataset batched without ``drop_remainder`` for as many, on TensorFlow's BFC CPU
  allocator (as distmem's TensorFlow adapter sets it up), ``get_memory_info('CPU:0')['peak']`` of
  each step; the worst is the reference (``reference_static`` / ``reference_open``: each trace's).
  Both, because Keras traces the train function with the batch dimension known in the first
  (``train_on_batch``, ``fit`` on arrays the batch divides) and open in the second (a batched
  dataset, arrays with a partial last batch), and TensorFlow plans the two differently (recurrent
  layers: 30-45% more open); a limit must hold whichever the job's input makes. Six, not three: a step's peak moves between modes with the executor's order (the fit
  half's Conv2DTranspose autoencoder on TF 2.21: 30.7 and 38.8 MB steps in one process), and a
  reference that misses the high one under-states what a limit must hold.
* ``default``: ``distmem.estimate(model, batch, optimizer, device="cpu")``, the default path
  (measured at the target batch where it fits the host), its figure, bound, cost and warnings.
* ``carried``: the same with ``memory_at_hand`` at 3/4 of the reference, so the target batch does
  not fit and the figure is carried from the largest batches that do.
* ``model``: ``method="model"`` (the analytic model, nothing run).
* ``calibrate`` (not run by default): ``method="model", calibrate=True``, the older hybrid (the
  model plus a measured small-batch step's excess); ``distmem estimate --calibrate`` is now the
  measured path, whose figures are the ``default`` part's.

``--score`` reads the lines of one TensorFlow version and writes the summary (``--summary``): per
part and half, mean / max / worst relative error against the reference, crashes, how often the
reference lies inside the bound, cost. Rules and margins may be fitted on the ``fit`` half only;
the ``held`` half is what is reported.

    python bench/estimate/keras_heldout.py --half all --out bench/results/estimate_keras_heldout_tf215.jsonl
    python bench/estimate/keras_heldout.py --score --out bench/results/estimate_keras_heldout_tf215.jsonl \\
        --summary bench/results/estimate_keras_heldout_tf215.json \\
        --fit-also bench/results/estimate_keras_heldout_tf221.jsonl

``--score --repeat-of FIRST.jsonl --out AGAIN.jsonl``: ``AGAIN`` holds the reference part measured
again in fresh processes (``--parts reference`` into a new file); how far each case's reference
moved between processes, beside the default estimate's error on the same cases: the noise floor
that any estimate is scored against. Where ``AGAIN`` holds the ``default`` part run again instead, the
same for the estimate's own figure (``estimate_keras_heldout_default_repeat_*.json``), both runs'
errors against each case's worst reference over every process, as ``--score`` takes it.

The margins are fitted on the fit half of every TensorFlow version run (``--fit-also``: the other
versions' lines), so each version's summary scores its held-out half under the same margins.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import keras_models as M  # noqa: E402

PARTS = ("reference", "default", "carried", "model", "calibrate")
DEFAULT_PARTS = ("reference", "default", "carried", "model")
STEPS = 6


def log(msg: str) -> None:
    print(f"[keras_heldout] {msg}", file=sys.stderr, flush=True)


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env.update(TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="true", DISTMEM_MEASURE_CACHE="off",
               TF_ENABLE_ONEDNN_OPTS=env.get("TF_ENABLE_ONEDNN_OPTS", "1"))
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# ------------------------------------------------------------------ workers (one part, fresh process)

def _tensors(tf, v):
    if isinstance(v, dict):
        return {k: tf.constant(a) for k, a in v.items()}
    if isinstance(v, list):
        return [tf.constant(a) for a in v]
    return tf.constant(v)


def _tuples(v):
    if isinstance(v, (list, tuple)):
        return tuple(_tuples(e) for e in v)
    if isinstance(v, dict):
        return {k: _tuples(e) for k, e in v.items()}
    return v


def part_reference(c: Dict[str, Any], steps: int) -> Dict[str, Any]:
    import tensorflow as tf
    model, make = M.build(c)
    x, y = make(c["batch"])
    x, y = _tensors(tf, x), _tensors(tf, y)
    info = tf.config.experimental.get_memory_info
    peaks, seconds = [], []
    for _ in range(steps):
        tf.config.experimental.reset_memory_stats("CPU:0")
        t = time.time()
        model.train_on_batch(x, y)
        seconds.append(round(time.time() - t, 3))
        peaks.append(int(info("CPU:0")["peak"]))
    # the same batch through model.fit from a tf.data dataset batched as users batch one (no
    # drop_remainder): Keras traces its train function with the batch dimension open there
    # (lists as tuples: tf.data stacks a list into one tensor)
    ds = tf.data.Dataset.from_tensors(_tuples((x, y))).unbatch().batch(c["batch"]).repeat()
    fitted: List[int] = []

    class Peaks(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, b, logs=None):
            tf.config.experimental.reset_memory_stats("CPU:0")

        def on_train_batch_end(self, b, logs=None):
            fitted.append(int(info("CPU:0")["peak"]))
    model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[Peaks()])
    return {"reference": max(peaks + fitted), "steps": peaks + fitted, "static_steps": peaks, "open_steps": fitted,
            "reference_static": max(peaks), "reference_open": max(fitted), "step_seconds": seconds,
            "params": int(model.count_params())}


def _estimate_row(est, seconds: float) -> Dict[str, Any]:
    bd = est.bound()
    m = est.measurement or {}
    return {"figure": int(est.peak_bytes), "low": bd.low_bytes, "high": bd.high_bytes, "source": bd.source,
            "method": est.method, "seconds": round(seconds, 2), "warnings": list(est.warnings),
            "points": m.get("points"), "point_steps": m.get("steps"), "measure_seconds": m.get("seconds"),
            "ladder": m.get("ladder"), "loss": m.get("loss"), "refused": m.get("refused"),
            "modelled": m.get("modelled"), "modelled_target": est.peak_detail().get("modelled_peak"),
            "fallback": m.get("fallback"), "calibration": est.calibration}


def part_estimate(c: Dict[str, Any], part: str, reference: Optional[int]) -> Dict[str, Any]:
    import warnings
    from distmem.estimate import estimate
    model, _ = M.build(c)
    opt = M._optimizer(c["optimizer"], __import__("tensorflow").keras)
    kw: Dict[str, Any] = {"device": "cpu"}
    if part == "carried":
        if not reference:
            raise RuntimeError("the carried part needs the reference first")
        kw["memory_at_hand"] = int(reference * 0.75)
    elif part == "model":
        kw["method"] = "model"
    elif part == "calibrate":
        kw.update(method="model", calibrate=True)
    t = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate(model, c["batch"], opt, **kw)
        row = _estimate_row(est, 0.0)
    row["seconds"] = round(time.time() - t, 2)
    return row


def _worker(args) -> int:
    from distmem.errors import DistmemError
    c = json.loads(args.case)
    try:
        if args.worker == "reference":
            out = part_reference(c, args.steps)
        else:
            out = part_estimate(c, args.worker, args.reference)
    except DistmemError as exc:  # refused with a reason: an answer, not a crash
        out = {"error": str(exc)}
    print("RESULT " + json.dumps(out))
    return 0


# ------------------------------------------------------------------ driver

def _done(path: str) -> Dict[tuple, Dict[str, Any]]:
    got: Dict[tuple, Dict[str, Any]] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    r = json.loads(line)
                    got[(r["id"], r["part"])] = r
    return got


def again_files(path: str) -> List[str]:
    """The runs that measured ``path``'s references again, each case in a fresh process:
    ``NAME_again*.jsonl`` beside ``NAME.jsonl`` (``--parts reference`` into a new file)."""
    return sorted(glob.glob(glob.escape(path[:-len(".jsonl")] if path.endswith(".jsonl") else path) + "_again*.jsonl"))


def scored_rows(path: str) -> List[Dict[str, Any]]:
    """``path``'s lines as scored: a case's reference is the worst over every run that measured it
    (``path`` and :func:`again_files`), the level a job running many steps meets, not one process's
    draw of the executor's order (one process's reference moves by up to 22% in the next,
    ``estimate_keras_heldout_reference_repeat_*.json``); each figure's error against that."""
    got = _done(path)
    runs = again_files(path)
    for again in runs:
        for (cid, part), row in _done(again).items():
            first = got.get((cid, part))
            if part != "reference" or first is None or "reference" not in row or "reference" not in first:
                continue
            seen = first.get("reference_runs") or [first["reference"]]
            got[(cid, part)] = {**first, "reference": max(seen + [row["reference"]]),
                                "reference_runs": seen + [row["reference"]]}
    refs = {cid: r["reference"] for (cid, part), r in got.items() if part == "reference" and "reference" in r}
    out = []
    for (cid, part), row in got.items():
        if part != "reference" and "figure" in row and cid in refs:
            row = {**row, "error": round(row["figure"] / refs[cid] - 1, 4)}
        out.append(row)
    return out


def _run_part(c: Dict[str, Any], part: str, args, reference: Optional[int]) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", part, "--case", json.dumps(c),
           "--steps", str(args.steps)] + (["--reference", str(reference)] if reference else [])
    t = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=_env())
    except subprocess.TimeoutExpired:
        return {"crash": f"timed out after {args.timeout} s", "wall_seconds": round(time.time() - t, 1)}
    lines = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-3:]
        return {"crash": f"exit {proc.returncode}: {' | '.join(tail)[-600:]}", "wall_seconds": round(time.time() - t, 1)}
    out = json.loads(lines[-1])
    out["wall_seconds"] = round(time.time() - t, 1)
    return out


def _versions() -> Dict[str, str]:
    out = subprocess.run([sys.executable, "-c", "import tensorflow as tf; print(tf.__version__, tf.keras.__version__ "
                          "if hasattr(tf.keras, '__version__') else '')"], capture_output=True, text=True,
                         env=_env(), timeout=300)
    tf_v, _, keras_v = out.stdout.strip().partition(" ")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {"tensorflow": tf_v, "keras": keras_v, "distmem": rev}


def run(args) -> int:
    chosen = M.cases(args.half)
    if args.cases:
        names = set(args.cases.split(","))
        chosen = [c for c in chosen if c["model"] in names or M.case_id(c) in names]
    parts = args.parts.split(",")
    done = _done(args.out)
    redo = set(args.redo.split(",")) if args.redo else set()
    versions = _versions()
    log(f"{len(chosen)} cases x {parts} on TensorFlow {versions['tensorflow']}, distmem {versions['distmem']}")
    for c in chosen:
        cid = M.case_id(c)
        for part in parts:
            if (cid, part) in done and part not in redo:
                continue
            ref = done.get((cid, "reference"), {}).get("reference")
            if part == "carried" and not ref:
                continue
            log(f"{cid} {part}")
            out = _run_part(c, part, args, ref)
            row = {"id": cid, "part": part, "half": c["half"], "family": c["family"], **versions, **out}
            if "figure" in out and ref:
                row["error"] = round(out["figure"] / ref - 1, 4)
            done[(cid, part)] = row
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            if "crash" in out or "error" in out:
                log(f"    {'crash' if 'crash' in out else 'error'}: {out.get('crash', out.get('error'))[:300]}")
            elif part == "reference":
                log(f"    reference {out['reference'] / 2**20:.1f} MiB, steps {[round(p / 2**20, 1) for p in out['steps']]}")
            else:
                log(f"    {out['figure'] / 2**20:.1f} MiB ({out['source']}), "
                    + (f"{100 * row['error']:+.1f}% " if "error" in row else "") + f"{out['seconds']} s")
    return 0


# ------------------------------------------------------------------ scoring

def score(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per part and half: errors against the reference, crashes, bound coverage, cost."""
    refs = {r["id"]: r["reference"] for r in rows if r["part"] == "reference" and "reference" in r}
    out: Dict[str, Any] = {}
    for part in PARTS[1:]:
        for half in ("fit", "held"):
            sel = [r for r in rows if r["part"] == part and r["half"] == half]
            if not sel:
                continue
            errs, covered, cost, outside = [], 0, [], []
            crashes = [r["id"] for r in sel if "crash" in r]
            # a refusal's row holds the worker's message under "error"; a figure's, its relative error
            refused = [r["id"] for r in sel if isinstance(r.get("error"), str)]
            for r in sel:
                if "figure" not in r or r["id"] not in refs:
                    continue
                ref = refs[r["id"]]
                e = r["figure"] / ref - 1
                errs.append((e, r["id"]))
                covered += r["low"] <= ref <= r["high"]
                cost.append(r["seconds"])
                ratio = r["figure"] / ref
                if not 0.5 <= ratio <= 2.0:
                    named = any(("x the model" in w or "refused" in w) for w in r.get("warnings") or [])
                    outside.append({"id": r["id"], "ratio": round(ratio, 3), "warned": named})
            if not errs:
                out[f"{part}/{half}"] = {"cases": len(sel), "crashes": len(crashes), "crashed": crashes,
                                         "refused": refused}
                continue
            es = [e for e, _ in errs]
            worst = min(errs)
            most = max(errs)
            cost.sort()
            out[f"{part}/{half}"] = {
                "cases": len(sel), "scored": len(es), "crashes": len(crashes), "crashed": crashes, "refused": refused,
                "mean_abs": round(sum(abs(e) for e in es) / len(es), 4), "max": round(most[0], 4), "max_case": most[1],
                "worst": round(worst[0], 4), "worst_case": worst[1], "bound_covers": f"{covered}/{len(es)}",
                "percent": {"mean_abs": round(100 * sum(abs(e) for e in es) / len(es), 1),
                            "max": round(100 * most[0], 1), "worst": round(100 * worst[0], 1)},
                "outside_half_to_double": outside,
                "seconds_median": cost[len(cost) // 2], "seconds_max": cost[-1]}
    return out


#: the parts, by the path (``Bound.source``) that made their figures
PATHS = {"default": "measured", "carried": "carried", "model": "modelled", "calibrate": "modelled"}


def _up(x: float) -> float:
    """Rounded up to the next 5 points (0.083 -> 0.10; 0 -> 0)."""
    return math.ceil(max(x, 0.0) * 20 - 1e-9) / 20


def _inside(figure: int, ref: int, under: float, over: float) -> bool:
    """``ref`` inside the bound a margin gives ``figure``: ``[figure / (1 + over), figure x (1 + under)]``
    (README "No figure without a bound"), rounded outwards as the estimate's bound is."""
    return math.floor(figure / (1.0 + over)) <= ref <= math.ceil(figure * (1.0 + under))


def _pairs(rows: List[Dict[str, Any]], half: str, source: str) -> List[Any]:
    """``(row, its references)`` of one run's figures of ``half`` made by the path ``source``: every
    process's reference of the case (``reference_runs``, :func:`scored_rows`), so that a bound is
    fitted to hold, and scored on holding, each of them."""
    refs = {r["id"]: list(r.get("reference_runs") or [r["reference"]])
            for r in rows if r["part"] == "reference" and "reference" in r}
    return [(r, refs[r["id"]]) for r in rows if r.get("half") == half and r.get("source") == source
            and "figure" in r and r["id"] in refs]


def margins(rows: List[Dict[str, Any]], fit_also: Optional[List[List[Dict[str, Any]]]] = None) -> Dict[str, Any]:
    """Per path (the ``source`` of each figure), from the **fit** half only: the margin its cases
    need (``under``: the largest fraction a reference was above the figure, ``over``: the largest
    the figure was above a reference, each rounded up to 5 points; every process's reference of a
    case counts), then on the **held** half how many cases have every reference inside the bound that
    margin gives, and which do not. ``fit_also``: other
    runs' rows (another TensorFlow version's), whose fit half the margins are fitted on as well,
    each against its own run's references; the held half scored is this run's. The margins
    estimates use (``KERAS_MARGINS``) are to be these, from every version's fit half;
    ``tests/unit/estimate/test_keras_margins.py`` holds it."""
    out: Dict[str, Any] = {}
    for source in sorted(set(PATHS.values())):
        got = {"fit": _pairs(rows, "fit", source) + [p for other in (fit_also or []) for p in _pairs(other, "fit", source)],
               "held": _pairs(rows, "held", source)}
        if not got["fit"]:
            continue
        need_under = max(max(refs) / r["figure"] - 1 for r, refs in got["fit"])
        need_over = max(r["figure"] / min(refs) - 1 for r, refs in got["fit"])
        under, over = _up(need_under), _up(need_over)
        held = got["held"]
        ok = [all(_inside(r["figure"], ref, under, over) for ref in refs) for r, refs in held]
        out[source] = {
            "fit_cases": len(got["fit"]), "fit_need_under": round(need_under, 4), "fit_need_over": round(need_over, 4),
            "under": under, "over": over, "held_cases": len(held), "held_inside": f"{sum(ok)}/{len(held)}",
            "held_inside_n": sum(ok),
            "held_outside": [{"id": r["id"], "part": r["part"], "error": round(r["figure"] / max(refs) - 1, 4),
                              "errors": [round(r["figure"] / ref - 1, 4) for ref in refs]}
                             for (r, refs), good in zip(held, ok) if not good],
            "percent": {"fit_need_under": round(100 * need_under, 1), "fit_need_over": round(100 * need_over, 1),
                        "under": round(100 * under), "over": round(100 * over)},
        }
    return out


def repeat(first: List[Dict[str, Any]], again: List[Dict[str, Any]], part: str = "reference") -> Dict[str, Any]:
    """A part measured again in fresh processes (``again``) against the first run's (``first``),
    case by case. ``part="reference"``: how far one process's worst step moves between processes,
    beside the default estimate's error against the first reference on the same cases (the second is
    no better than the first can be reproduced). ``part="default"``: how far the default estimate's
    own figure moves between processes (same code), and its error in each run against the first
    reference."""
    key = "reference" if part == "reference" else "figure"
    refs = {r["id"]: r for r in first if r["part"] == "reference" and "reference" in r}
    firsts = {r["id"]: r for r in first if r["part"] == part and key in r}
    more = {r["id"]: r for r in again if r["part"] == part and key in r}
    est = {r["id"]: r for r in first if r["part"] == "default" and "figure" in r}
    ids = sorted(i for i in more if i in firsts and i in refs)
    out: Dict[str, Any] = {"cases": len(ids), "part": part}

    def stats(errs: List[Any]) -> Optional[Dict[str, Any]]:
        return ({"mean_abs": round(sum(abs(e) for e, _ in errs) / len(errs), 4), "worst": round(min(errs)[0], 4),
                 "max": round(max(errs)[0], 4), "beyond_5_percent": sum(abs(e) > 0.05 for e, _ in errs)}
                if errs else None)

    for half in ("fit", "held", "all"):
        sel = [i for i in ids if half == "all" or refs[i]["half"] == half]
        moved = [(more[i][key] / firsts[i][key] - 1, i) for i in sel]
        errs = [(est[i]["figure"] / refs[i]["reference"] - 1, i) for i in sel if i in est]
        if not moved:
            continue
        out[half] = {
            "cases": len(moved),
            f"{part}_moved": dict(stats(moved), worst_case=min(moved)[1], max_case=max(moved)[1]),
            "default_error": stats(errs),
            "cases_moved": {i: round(e, 4) for e, i in sorted(moved)},
        }
        if part == "default":
            out[half]["default_again_error"] = stats([(more[i]["figure"] / refs[i]["reference"] - 1, i) for i in sel])
        out[half]["percent"] = {"moved_mean_abs": round(100 * out[half][f"{part}_moved"]["mean_abs"], 1),
                                "moved_worst": round(100 * out[half][f"{part}_moved"]["worst"], 1),
                                "moved_max": round(100 * out[half][f"{part}_moved"]["max"], 1)}
        for name, errors in (("first", "default_error"), ("again", "default_again_error")):
            if out[half].get(errors):
                out[half]["percent"].update({f"{name}_{k}": round(100 * out[half][errors][k], 1)
                                             for k in ("mean_abs", "worst", "max")})
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--half", default="all", choices=("fit", "held", "all"))
    p.add_argument("--cases", default=None, help="comma-separated model names or case ids")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"of {', '.join(PARTS)}")
    p.add_argument("--redo", default="", help="parts to run again even where the output has them")
    p.add_argument("--steps", type=int, default=STEPS, help="reference steps (the worst is kept)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default=None, help="the jsonl the parts are appended to")
    p.add_argument("--score", action="store_true", help="score --out instead of running")
    p.add_argument("--summary", default=None, help="with --score: write the summary JSON here")
    p.add_argument("--fit-also", default="", help="with --score: other runs' jsonl (another TensorFlow version's), "
                   "comma-separated, whose fit half the margins are fitted on too")
    p.add_argument("--repeat-of", default=None, help="with --score: --out holds the reference measured again in "
                   "fresh processes; score how far it moved from this jsonl's (the first run's)")
    p.add_argument("--references", default=None, help="with --score --repeat-of of a default part: score both runs "
                   "against this jsonl's references (and its _again files) instead of --repeat-of's")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--reference", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    if not args.out:
        p.error("--out is required")
    if args.score and args.repeat_of:
        again = list(_done(args.out).values())
        part = "reference" if any(r["part"] == "reference" for r in again) else "default"
        # a reference measured again is compared with the first process's; a default part run again is
        # scored as --score scores the first one: against each case's worst reference over every process
        first = list(_done(args.repeat_of).values()) if part == "reference" else scored_rows(args.repeat_of)
        refs_from = args.references or args.repeat_of
        if part == "default" and args.references:  # the first run's references are kept beside another file's
            first = [r for r in first if r["part"] != "reference"] + [r for r in scored_rows(args.references)
                                                                     if r["part"] == "reference"]
        got = repeat(first, again, part)
        every = got.get("all", {})
        moved, err = every.get(f"{part}_moved") or {}, every.get("default_error") or {}
        line = {"bench": f"estimate_keras_heldout_{part}_repeat", "cases": got["cases"],
                "figure": {f"{part}_moved_mean_abs": moved.get("mean_abs"), "worst": moved.get("worst"),
                           "max": moved.get("max"), "beyond_5_percent": moved.get("beyond_5_percent")},
                "peer": {"default_error_mean_abs": err.get("mean_abs"), "worst": err.get("worst"), "max": err.get("max")},
                "ratio": round(err["mean_abs"] / moved["mean_abs"], 2) if err.get("mean_abs") and moved.get("mean_abs")
                else None}
        print(json.dumps(line))
        if args.summary:
            with open(args.summary, "w", encoding="utf-8") as f:
                json.dump({**line, "summary": got, "first": os.path.basename(args.repeat_of),
                           "again": os.path.basename(args.out),
                           "references": ("the first process's" if part == "reference" else
                                          "each case's worst over every process that measured it: "
                                          + ", ".join([os.path.basename(refs_from)]
                                                      + [os.path.basename(x) for x in again_files(refs_from)]))},
                      f, indent=1)
                f.write("\n")
        return 0
    if args.score:
        rows = scored_rows(args.out)
        others = [p for p in args.fit_also.split(",") if p]
        fit_also = [scored_rows(p) for p in others]
        summary = score(rows)
        held = summary.get("default/held", {})
        base = summary.get("model/held", {})
        line = {"bench": "estimate_keras_heldout", "tensorflow": next((r["tensorflow"] for r in rows), None),
                "figure": {"default_held_mean_abs": held.get("mean_abs"), "max": held.get("max"),
                           "worst": held.get("worst"), "crashes": held.get("crashes")},
                "peer": {"model_held_mean_abs": base.get("mean_abs")},
                "ratio": round(base["mean_abs"] / held["mean_abs"], 2) if held.get("mean_abs") and base.get("mean_abs")
                else None}
        print(json.dumps(line))
        if args.summary:
            with open(args.summary, "w", encoding="utf-8") as f:
                json.dump({**line, "summary": summary, "margins": margins(rows, fit_also), "source": os.path.basename(args.out),
                           "references_again": [os.path.basename(p) for p in again_files(args.out)],
                           "margins_fit_also": [os.path.basename(p) for p in others],
                           "rows": sorted(rows, key=lambda r: (r["half"], r["id"], r["part"]))}, f, indent=1)
                f.write("\n")
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
