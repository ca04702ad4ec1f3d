"""The headroom a hard limit needs over a rank's true peak under expandable segments, measured on the GPU.

    PYTHONPATH=. python3 bench/plan/fit_headroom.py run --from bench/results/fit_scale_h200.jsonl \\
        --budget-s 300 --out $OUT                                                    # on the GPU machine
    PYTHONPATH=. python3 bench/plan/fit_headroom.py run --cpu --from bench/results/fit_scale_h200.jsonl \\
        --max-specs 3 --budget-s 300 --out /tmp/fh                                     # CPU: the plumbing
    PYTHONPATH=. python3 bench/plan/fit_headroom.py summarize $OUT/fit_headroom_h200.jsonl \\
        --summary-out bench/results/fit_headroom_h200_summary.json

``distmem.fit`` plans a torch rank's hard limit as its estimated allocator peak plus a headroom
(:data:`distmem.defaults.LIMIT_HEADROOM`), which must cover two things: the estimate's error and what
the allocator holds above the bytes allocated (rounding, a segment's pages) when the cap is reached.
The headroom was measured with the default allocator (bench/results/fit_h200.json), whose split
blocks strand memory; every torch limit ``fit`` plans now assumes expandable segments (init() sets
them before CUDA starts). This bench measures what the allocator needs then: each rank the fit at
scale ran (bench/results/fit_scale_h200.jsonl: the chosen layouts, and the rejected ones that trained
under their share), again in a fresh process with expandable segments, under limits of its own true
peak (that run's ``peak_allocated``) times 1.00, 1.01, 1.02 and 1.04. The runs are fit_scale's own
(``fit_scale.gpu_run``: rank 0 of N through the fake process group, sharded layouts sharded,
pipeline stages alone), packed on the one GPU as fit_scale packs them.

Per rank: the smallest ratio it trained under (``min_ratio``), and what headroom over the figure fit
plans from that rank needed (``need = true / figure x min_ratio - 1``). That figure is the estimate's
bounded (high) one: fit prices ``Estimate.bound.high_bytes`` (the point figure x (1 + its path's
``under`` margin): +3% on the modelled path, distmem.estimate.table.TORCH_MARGINS) and adds the
headroom over it. fit_scale records the bounded figure (``figure: "bounded"``); runs made before the
bound existed recorded fit's point figure, and their need is taken over that figure x (1 + the
modelled path's margin), the figure fit plans from now (``need_over_point`` keeps the old reading).
The rule is read from the ``fit`` half (fit_scale.half_of: by model, CRC-32) and checked on the
``held_out`` half. One JSON line at the end: the headroom the fit half needs, the held-out ranks it
does not cover, beside the headroom in force.

``run --ratios 1.005,1.015,... --skip-done EARLIER.jsonl``: finer ratios, only those inside each rank's
bracket (between the largest it ran out under and the smallest it trained under).
``summarize --figures-from FIT_SCALE.jsonl``: each rank priced by the figure fit gives it in a later
fit_scale run (the same layout asked again), not the one recorded when it first ran. A rank out of
memory under every ratio tried has no need, only one it is known to exceed (``need_above``), which the
rule counts. The rule in force came from both (bench/results/fit_headroom_h200_fine2_summary.json).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import fit_scale as fs  # noqa: E402 - the bench beside this one: its models, runs and packing

NAME = "fit_headroom_h200"
RATIOS = (1.00, 1.01, 1.02, 1.04)
ROLES = ("chosen", "best_rejected", "mb_up")
T0 = time.time()


def log(msg: str) -> None:
    print(f"[fit-headroom {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _key(spec: Dict[str, Any]) -> Tuple[Any, ...]:
    """What makes two runs the same rank: the model and everything of the layout that shapes a step."""
    return tuple(spec.get(k) for k in ("model", "micro_batch", "accumulation", "precision", "shard", "world",
                                       "pipeline", "schedule", "recompute", "first_block", "stop_block",
                                       "in_flight"))


#: fit_scale's runs that recorded fit's bounded figure before their specs said so (``figure``):
#: bench/results/fit_scale_h200_r5.jsonl. Earlier runs (fit_scale_h200.jsonl) recorded the point figure.
BOUNDED_BEFORE_THE_FIELD = ("h200-5", "h200-6")


def figure_of(rec: Dict[str, Any], spec: Dict[str, Any]) -> str:
    """Which of fit's figures a fit_scale run's ``estimated_peak`` is: ``bounded`` or ``point``."""
    if spec.get("figure"):
        return str(spec["figure"])
    return "bounded" if rec.get("tag") in BOUNDED_BEFORE_THE_FIELD else "point"


def ranks(records: List[Dict[str, Any]], per_model: int = 3) -> List[Dict[str, Any]]:
    """The ranks to measure: every trained run of :data:`ROLES` with its true peak, one per distinct
    rank, at most ``per_model`` per model (the tightest first: the largest true peak over its
    estimate), both halves taking turns so that a budget cut leaves both."""
    seen, by_model = set(), {}
    for rec in records:
        for run in rec.get("runs", []):
            spec, res, v = run["spec"], run.get("result") or {}, run.get("verdict") or {}
            if spec["role"] not in ROLES or not v.get("trained") or not res.get("peak_allocated"):
                continue
            k = _key(spec)
            if k in seen:
                continue
            seen.add(k)
            row = {"case": rec["case"], "role": spec["role"], "half": fs.half_of(spec["model"]),
                   "true_peak": int(res["peak_allocated"]), "estimated_peak": int(spec["estimated_peak"]),
                   "figure": figure_of(rec, spec), "planned_bytes": int(spec["planned_bytes"]), "spec": spec}
            by_model.setdefault(spec["model"], []).append(row)
    for rows in by_model.values():
        rows.sort(key=lambda r: -r["true_peak"] / max(1, r["estimated_peak"]))
    picked = {m: rows[:per_model] for m, rows in sorted(by_model.items())}
    halves = {"fit": [], "held_out": []}
    for m, rows in picked.items():
        halves[fs.half_of(m)].extend(rows)
    out: List[Dict[str, Any]] = []
    for i in range(max(len(h) for h in halves.values())):
        for h in ("fit", "held_out"):
            if i < len(halves[h]):
                out.append(halves[h][i])
    return out


def jobs_of(rows: List[Dict[str, Any]], ratios=RATIOS) -> List[Dict[str, Any]]:
    """One run per (rank, ratio): 1.02 first, then 1.00 and 1.04 (so that a cut budget still brackets
    most ranks), the others last."""
    first = [r for r in (1.02, 1.00, 1.04) if r in ratios]
    order = first + [r for r in ratios if r not in first]
    jobs = []
    for r in order:
        for i, row in enumerate(rows):
            spec = dict(row["spec"], role=f"headroom_{r:.2f}", expandable=True,
                        limit_bytes=int(row["true_peak"] * r) // (2 * fs.MiB) * (2 * fs.MiB) + 2 * fs.MiB)
            jobs.append({"rank": i, "ratio": r, "spec": spec})
    return jobs


def after(jobs: List[Dict[str, Any]], rows: List[Dict[str, Any]], done: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The jobs an earlier run (its lines ``done``) left that can still move a rank's bracket (the
    largest ratio it ran out under, the smallest it trained under): first the next ratio up for ranks
    with no ratio trained, then the smallest ratio for ranks never run below a trained one, then the
    ratios inside a bracket; a ratio outside its rank's bracket says nothing new and is dropped."""
    lo: Dict[Tuple[Any, ...], float] = {}
    hi: Dict[Tuple[Any, ...], float] = {}
    for d in done:
        oom = d["result"].get("oom")
        if oom is None:
            continue
        k = tuple(d["key"])
        if oom:
            lo[k] = max(lo.get(k, 0.0), d["ratio"])
        else:
            hi[k] = min(hi.get(k, 9.0), d["ratio"])
    ranked = []
    for j in jobs:
        k = _key(rows[j["rank"]]["spec"])
        r, a, b = j["ratio"], lo.get(k), hi.get(k)
        if (a is not None and r <= a) or (b is not None and r >= b):
            continue
        if b is None:
            ranked.append(((0, r), j))
        elif a is None:
            ranked.append(((1, -r), j))  # down from the trained ratio, the nearest first
        else:
            ranked.append(((2, r), j))
    return [j for _, j in sorted(ranked, key=lambda x: x[0])]


def run(args: argparse.Namespace) -> str:
    records = fs.read_records(args.from_)
    rows = ranks(records, args.per_model)[: args.max_specs or None]
    jobs = jobs_of(rows, tuple(float(x) for x in args.ratios.split(",")) if args.ratios else RATIOS)
    done = read(args.skip_done) if args.skip_done else []
    if done:
        jobs = after(jobs, rows, done)
    log(f"{len(rows)} ranks ({sum(1 for r in rows if r['half'] == 'fit')} fit half), {len(jobs)} runs, "
        f"budget {args.budget_s:.0f} s")
    if args.cpu:
        os.environ[fs.SMOKE_SEQ_ENV] = "16"
        capacity = 64 * fs.GiB
        for j in jobs:
            j["spec"].update(device="cpu", micro_batch=1, steps=1)
    else:
        free, _ = fs._gpu_free()
        capacity = free - int(args.margin_gib * fs.GiB)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}.jsonl")
    tmp = tempfile.mkdtemp(prefix="fit-headroom-")
    pending = list(jobs)
    running: Dict[int, Tuple[Dict[str, Any], Any, str, float, int]] = {}
    used, seq, written = 0, 0, 0
    deadline = T0 + args.budget_s
    with open(path, "w") as out:
        for d in done:  # the earlier run's lines first, so this file is complete on its own
            out.write(json.dumps(d) + "\n")
        while pending or running:
            now = time.time()
            while pending and len(running) < args.workers and now < deadline - args.tail_s:
                need = fs.job_need(pending[0]["spec"])
                if used and used + need > capacity:
                    break
                job = pending.pop(0)
                seq += 1
                res_path = os.path.join(tmp, f"r{seq}.json")
                proc = fs._Fresh(job["spec"], res_path)
                running[seq] = (job, proc, res_path, now, need)
                used += need
            if not running and (not pending or now >= deadline - args.tail_s):
                break
            time.sleep(0.2)
            for k in list(running):
                job, proc, res_path, started, need = running[k]
                late = time.time() - started > args.run_timeout_s
                if proc.is_alive() and not late:
                    continue
                if late and proc.is_alive():
                    proc.kill()
                    proc.join(5)
                    result = {"oom": None, "error": f"killed after {args.run_timeout_s:.0f} s"}
                else:
                    try:
                        with open(res_path) as f:
                            result = json.load(f)
                    except (OSError, ValueError):
                        result = {"oom": None, "error": f"the run exited {proc.exitcode} without a result"}
                del running[k]
                used -= need
                row = rows[job["rank"]]
                line = {"case": row["case"], "role": row["role"], "half": row["half"], "model": row["spec"]["model"],
                        "rank": job["rank"], "key": list(_key(row["spec"])), "ratio": job["ratio"],
                        "true_peak": row["true_peak"], "estimated_peak": row["estimated_peak"],
                        "figure": row["figure"], "planned_bytes": row["planned_bytes"], "limit_bytes": job["spec"]["limit_bytes"],
                        "result": {k2: result.get(k2) for k2 in ("oom", "error", "peak_allocated", "peak_reserved",
                                                                 "alloc_retries", "expandable_effective", "cap_bytes",
                                                                 "physical_oom", "seconds", "torch")}}
                out.write(json.dumps(line) + "\n")
                out.flush()
                written += 1
                r = line["result"]
                log(f"{row['case'][:60]} {row['role']} x{_fmt(job['ratio'])}: "
                    + ("OOM" if r["oom"] else ("error " + str(r["error"])[:120]) if r["oom"] is None else "trained")
                    + f" ({written}/{len(jobs)})")
    log(f"{written} runs of {len(jobs)} in {time.time() - T0:.0f} s -> {path}")
    summary = summarize(read(path), seconds=time.time() - T0, budget_s=args.budget_s)
    with open(os.path.join(args.out, f"{args.name}_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(line_of(summary)))
    return path


def read(path: str) -> List[Dict[str, Any]]:
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def _fmt(x: float) -> str:
    """A ratio as the rows name it: two decimals, three where it has them (1.02, 1.025)."""
    return f"{x:.2f}" if abs(round(x, 2) - x) < 1e-9 else f"{x:.3f}"


def figures_of(path: str) -> Dict[Tuple[Any, ...], Tuple[int, str]]:
    """Per rank (:func:`_key`) the figure fit gave it in a fit_scale run (``estimated_peak`` and
    which figure it is): a rank asked again after the estimator changed is priced as fit prices it
    now, not by the figure recorded when it was first run."""
    out: Dict[Tuple[Any, ...], Tuple[int, str]] = {}
    for rec in fs.read_records(path):
        for run in rec.get("runs", []):
            spec = run["spec"]
            if spec.get("estimated_peak"):
                out[_key(spec)] = (int(spec["estimated_peak"]), figure_of(rec, spec))
    return out


def _up(x: float, step: float = 0.005) -> float:
    return round(math.ceil(x / step - 1e-9) * step, 4)


def modelled_bound_ratio() -> float:
    """The high figure over the point figure on torch's modelled path, as ``distmem.estimate``
    gives it (``Estimate.bound()`` of a small model estimated on the meta device)."""
    import torch

    from distmem.estimate import estimate

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    est = estimate(model, batch_size=64, input_shape=(1024,), method="model")
    bd = est.bound()
    assert bd.source == "modelled", bd
    return bd.high_bytes / est.train_bytes(64)


def bounded_figure(ln: Dict[str, Any], ratio: Optional[float] = None) -> int:
    """The figure fit plans the rank's limit from: the estimate's bounded (high) figure. A line
    recorded before the bound existed (no ``figure``, or ``"point"``) holds fit's point figure, whose
    bounded figure is the point x the modelled path's bound (``ratio``, :func:`modelled_bound_ratio`):
    fit_scale asks fit on the meta device (``estimate="model"``)."""
    if ln.get("figure", "point") == "bounded":
        return int(ln["estimated_peak"])
    return int(math.ceil(ln["estimated_peak"] * (ratio or modelled_bound_ratio())))


def summarize(lines: List[Dict[str, Any]], seconds: Optional[float] = None,
              budget_s: Optional[float] = None,
              figures: Optional[Dict[Tuple[Any, ...], Tuple[int, str]]] = None) -> Dict[str, Any]:
    """Per rank the smallest ratio it trained under (a ratio counts only when every larger ratio
    measured trained too) and the headroom over the bounded figure fit plans from that it needed;
    the rule from the fit half, checked on the held-out half. ``figures`` (:func:`figures_of`): the
    figure each rank has now, where a later run asked it again."""
    per: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
    recorded = lines  # what each run was planned with, as it ran (the headroom in force)
    if figures:
        lines = [dict(ln, estimated_peak=figures[tuple(ln["key"])][0], figure=figures[tuple(ln["key"])][1],
                      figure_from="asked again") if tuple(ln["key"]) in figures else ln for ln in lines]
    # the modelled path's bound, read from the estimator once where a figure must be carried between
    # point and bounded (it imports torch)
    ratio = modelled_bound_ratio() if lines else None
    for ln in lines:
        k = tuple(ln["key"])
        p = per.setdefault(k, {"figure_from": ln.get("figure_from", "first run"), "case": ln["case"],
                               "role": ln["role"], "half": ln["half"], "model": ln["model"],
                               "true_peak": ln["true_peak"], "estimated_peak": ln["estimated_peak"],
                               "figure": ln.get("figure", "point"), "bounded_peak": bounded_figure(ln, ratio), "runs": {}})
        r = ln["result"]
        p["runs"][ln["ratio"]] = ("trained" if r.get("oom") is False else "oom" if r.get("oom") else "error")
    rows = []
    for p in per.values():
        runs = p["runs"]
        measured = sorted(x for x, v in runs.items() if v != "error")
        if not measured:
            continue
        min_ratio = None
        for x in reversed(measured):  # the smallest ratio with every larger one trained
            if runs[x] != "trained":
                break
            min_ratio = x
        point = p["estimated_peak"] if p["figure"] != "bounded" else p["estimated_peak"] / ratio
        truth_over_est = p["true_peak"] / max(1.0, point)
        truth_over_bounded = p["true_peak"] / max(1, p["bounded_peak"])
        need = None if min_ratio is None else truth_over_bounded * min_ratio - 1
        need_point = None if min_ratio is None else truth_over_est * min_ratio - 1
        # a rank that ran out under every ratio tried says nothing about a rule whose limit is above
        # them all: its need is only known to exceed the largest (over the bounded figure)
        need_above = None if min_ratio is not None else round(truth_over_bounded * measured[-1] - 1, 4)
        rows.append(dict(p, runs={_fmt(x): v for x, v in sorted(runs.items())}, min_ratio=min_ratio,
                         need_above=need_above,
                         truth_over_estimate=round(truth_over_est, 4),
                         truth_over_bounded=round(truth_over_bounded, 4),
                         need=None if need is None else round(need, 4),
                         need_over_point=None if need_point is None else round(need_point, 4),
                         none_trained=min_ratio is None))

    def half(h: str) -> Dict[str, Any]:
        hr = [r for r in rows if r["half"] == h]
        mins = [r["min_ratio"] for r in hr if r["min_ratio"] is not None]
        needs = [r["need"] for r in hr if r["need"] is not None]
        return {"ranks": len(hr), "trained_at_1.00": sum(1 for r in hr if r["runs"].get("1.00") == "trained"),
                "none_trained": [r["case"] + " " + r["role"] for r in hr if r["none_trained"]],
                "none_trained_need_above_max": max((r["need_above"] for r in hr if r["none_trained"]), default=None),
                "min_ratio_max": max(mins) if mins else None,
                "allocator_slack_max": round(max(mins) - 1, 4) if mins else None,
                "need_max": max(needs) if needs else None,
                "need_over_point_max": max((r["need_over_point"] for r in hr if r["need_over_point"] is not None),
                                           default=None),
                "truth_over_bounded_max": max((r["truth_over_bounded"] for r in hr), default=None),
                "truth_over_estimate_max": max((r["truth_over_estimate"] for r in hr), default=None)}

    fit, held = half("fit"), half("held_out")
    rule = None
    if fit["need_max"] is not None:
        # half a point over the worst need, to the half point; a fit rank out of memory under every
        # ratio tried counts with the need it is known to exceed
        worst = max(fit["need_max"], fit["none_trained_need_above_max"] if fit["none_trained"] else -1.0, 0.0)
        rule = _up(worst + 0.005)
    held_rows = [r for r in rows if r["half"] == "held_out" and r["need"] is not None]
    uncovered = [f"{r['case']} {r['role']}: needs {r['need']:+.2%}" for r in held_rows if rule is not None
                 and r["need"] > rule]
    # held-out ranks out of memory under every ratio tried: uncovered where that already proves a need
    # at or above the rule
    uncovered += [f"{r['case']} {r['role']}: needs over {r['need_above']:+.2%}" for r in rows
                  if r["half"] == "held_out" and r["none_trained"] and rule is not None and r["need_above"] >= rule]
    return {"bench": "fit_headroom", "ratios": sorted({ln["ratio"] for ln in lines}), "ranks": len(rows),
            "runs": len(lines), "figures_asked_again": sum(1 for r in rows if r["figure_from"] == "asked again"),
            "fit": fit, "held_out": held, "headroom_in_force": in_force(recorded),
            "headroom_from_fit_half": rule,
            "over": "the bounded (high) figure fit plans from: the point figure x (1 + its path's under margin)",
            "held_out_covered": f"{len(held_rows) - len(uncovered)}/{len(held_rows)}",
            "held_out_uncovered": uncovered, "seconds": None if seconds is None else round(seconds, 1),
            "budget_s": budget_s, "rows": sorted(rows, key=lambda r: (r["half"], r["case"], r["role"]))}


def in_force(lines: List[Dict[str, Any]]) -> Optional[float]:
    """The headroom fit applied to these ranks (what the door planned over its estimate, the median:
    each limit is rounded to whole MiB)."""
    import statistics

    r = [ln["planned_bytes"] / ln["estimated_peak"] - 1 for ln in lines
         if ln.get("planned_bytes") and ln.get("estimated_peak") and ln["role"] == "chosen"]
    return round(statistics.median(r), 3) if r else None


def line_of(s: Dict[str, Any]) -> Dict[str, Any]:
    """The one JSON line: the headroom the fit half needs under expandable segments, the one in force
    (the peer: measured with the default allocator), their ratio, the held-out coverage."""
    fig = s["headroom_from_fit_half"]
    peer = s["headroom_in_force"]
    return {"bench": "fit_headroom", "figure": {"headroom_from_fit_half": fig,
                                                "held_out_covered": s["held_out_covered"]},
            "peer": {"headroom_in_force": peer}, "ratio": None if not fig or not peer else round(fig / peer, 3)}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["run", "summarize"])
    ap.add_argument("files", nargs="*", help="summarize: the .jsonl files")
    ap.add_argument("--from", dest="from_", default=os.path.join(ROOT, "bench", "results", "fit_scale_h200.jsonl"),
                    help="the fit at scale's records whose ranks to measure (default the committed ones)")
    ap.add_argument("--budget-s", type=float, default=None, help="run: device seconds for the whole run (required)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the results (default $OUT)")
    ap.add_argument("--name", default=NAME)
    ap.add_argument("--skip-done", default=None, metavar="FILE", help="run: an earlier run's .jsonl: its runs are "
                    "kept, the ranks it left unbracketed go first")
    ap.add_argument("--ratios", default=None, help="run: the limits to try, over each rank's true peak, comma-separated "
                    f"(default {','.join(f'{r:.2f}' for r in RATIOS)}); with --skip-done only those inside a rank's "
                    "bracket run")
    ap.add_argument("--figures-from", default=None, metavar="FILE", help="summarize: a later fit_scale run's .jsonl; "
                    "each rank's figure is the one fit gives it there (the same layout), where it was asked again")
    ap.add_argument("--per-model", type=int, default=3, help="ranks per model at most (default 3)")
    ap.add_argument("--max-specs", type=int, default=0, help="only the first N ranks")
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--margin-gib", type=float, default=6.0)
    ap.add_argument("--run-timeout-s", type=float, default=150.0)
    ap.add_argument("--tail-s", type=float, default=30.0)
    ap.add_argument("--summary-out", default=None)
    ap.add_argument("--cpu", action="store_true", help="run: the plumbing on CPU (micro-batch 1, one step)")
    a = ap.parse_args(argv)
    if a.mode == "summarize":
        lines = [x for p in a.files for x in read(p)]
        s = summarize(lines, figures=figures_of(a.figures_from) if a.figures_from else None)
        if a.summary_out:
            with open(a.summary_out, "w") as f:
                json.dump(s, f, indent=1)
        print(json.dumps({k: v for k, v in s.items() if k != "rows"}, indent=1))
        print(json.dumps(line_of(s)))
        return 0
    if a.budget_s is None or not a.out:
        ap.error("run needs --budget-s SECONDS and --out FOLDER (or $OUT)")
    run(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
