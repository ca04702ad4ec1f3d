"""``distmem.fit`` asked again, on any machine, about the layouts the fit-at-scale benchmark ran on the
GPU: each case's chosen layout pinned (its pipeline, micro-batch, ranks per GPU, sharding, precision,
recompute), fit's estimate of that layout's allocator peak read from its answer and held against the
true peak the GPU run measured (``--results``: by default the benchmark's committed per-case file). What a change to fit's
costs moves, before the next GPU run.

    PYTHONPATH=. python3 bench/plan/fit_scale_reask.py ask --only '^hf:' --accumulation-only --out /tmp/new.jsonl
    PYTHONPATH=. python3 bench/plan/fit_scale_reask.py ask ... --attention-as-torch-2.11 --out /tmp/new211.jsonl
    python3 bench/plan/fit_scale_reask.py summarize --base B.jsonl[,B211.jsonl] --new N.jsonl[,N211.jsonl] \\
        --out bench/results/fit_scale_accumulation_cpu_reask.json

``--attention-as-torch-2.11``: the estimator prices scaled dot-product attention as torch 2.11's CUDA
kernels run it (the memory-efficient kernel takes no grouped K/V: ``EFFICIENT_ATTENTION_GROUPED_KV =
False``), as the GPU runs were made; a newer torch here prices grouped-K/V decoders in float32 5-18%
lower, which no change to fit's costs made. ``summarize``: later files win per case; each case's
point figure (fit's estimate less the modelled bound it prices) and planned figure against the
true peak, per half of :func:`fit_scale.half_of` (``fit``: where a rule may be read; ``held_out``).

distmem-bench: internal - sets the torch estimator's attention-kernel constant to price as the GPU
run's torch did; a study of what a change to fit's costs moves, no README/docs figure comes from it
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def ask(args: argparse.Namespace) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.attention_as_torch_2_11:
        import distmem.estimate.torch.kernels as kernels
        kernels.EFFICIENT_ATTENTION_GROUPED_KV = False
    import distmem
    from bench.plan import fit_scale as F
    pattern = re.compile(args.only or ".")
    done = set()
    if os.path.exists(args.out):
        with open(args.out) as f:
            done = {json.loads(line)["case"] for line in f if line.strip()}
    with open(args.results) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = open(args.out, "a")
    for r in rows:
        if not pattern.search(r["case"]) or r["case"] in done:
            continue
        ch = next((run for run in r.get("runs", []) if run["spec"].get("role") == "chosen"
                   and (run.get("result") or {}).get("peak_allocated")), None)
        if ch is None or (args.accumulation_only and ch["spec"]["accumulation"] <= 1):
            continue
        sp = ch["spec"]
        case = F.Case(**r["answer"]["params"])
        lay = r["answer"]["chosen"]["layout"]
        pinned = dict(F._fit_kwargs(case, "model"), pipelines=[lay["pipeline"]], micro_batches=[lay["micro_batch"]],
                      ranks_per_gpu=[lay["ranks_per_gpu"]], shardings=[lay["shard"]] if lay["shard"] else "none",
                      precision=lay["precision"], recompute=lay["recompute"], top=3, rejected=8)
        rec: Dict[str, Any] = {"case": r["case"], "model": sp["model"], "half": F.half_of(sp["model"]),
                               "layout": r["answer"]["chosen"]["describe"], "accumulation": sp["accumulation"],
                               "precision": sp["precision"], "shard": sp["shard"],
                               "true": ch["result"]["peak_allocated"], "committed": sp["estimated_peak"],
                               "attention": "torch 2.11" if args.attention_as_torch_2_11 else "this torch"}
        t = time.time()
        try:
            res = distmem.fit(F._asked_model(case.model), **pinned)
            cand = next((c for c in list(res.fits) + list(res.rejected) if c.layout.describe() == rec["layout"]), None)
            if cand is None:
                rec["error"] = "the layout is not among fit's answers"
            else:
                row = F._stage_row(cand.heaviest if cand.fits else cand.binding)
                rec["planned"] = int(row["allocator_bytes"])
                rec["point"] = rec["planned"] - int(sum(v for k, v in row["breakdown"].items()
                                                        if k.startswith("estimate uncertainty")))
        except Exception as exc:  # noqa: BLE001 - booked with the case
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rec["seconds"] = round(time.time() - t, 1)
        print(json.dumps(rec), flush=True)
        out.write(json.dumps(rec) + "\n")
        out.flush()


def _read(paths: str) -> Dict[str, Dict[str, Any]]:
    got: Dict[str, Dict[str, Any]] = {}
    for p in paths.split(","):
        with open(p) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    if "point" in r:
                        got[r["case"]] = r
    return got


def summarize(args: argparse.Namespace) -> None:
    base, new = _read(args.base), _read(args.new)
    cases: List[Dict[str, Any]] = []
    for c, n in new.items():
        b = base.get(c)
        if b is None:
            continue
        pct = lambda x: round(100.0 * (x / n["true"] - 1), 2)  # noqa: E731
        cases.append({k: n[k] for k in ("case", "half", "layout", "accumulation", "precision", "shard", "true",
                                        "attention")} |
                     {"committed_pct": pct(n["committed"]), "base_point_pct": pct(b["point"]),
                      "base_planned_pct": pct(b["planned"]), "new_point_pct": pct(n["point"]),
                      "new_planned_pct": pct(n["planned"])})
    summary: Dict[str, Any] = {}
    for half in ("fit", "held_out"):
        sel = [c for c in cases if c["half"] == half]
        if not sel:
            continue
        col = lambda k: [c[k] for c in sel]  # noqa: E731
        summary[half] = {"cases": len(sel)}
        for k in ("base_point_pct", "new_point_pct", "base_planned_pct", "new_planned_pct"):
            summary[half][k] = {"median": round(statistics.median(col(k)), 2), "min": min(col(k)), "max": max(col(k))}
        summary[half]["new_planned_under_true"] = sum(1 for x in col("new_planned_pct") if x < 0)
        summary[half]["new_point_more_than_1pct_under"] = sum(1 for x in col("new_point_pct") if x < -1)
    out = {"bench": "fit_scale_reask", "results": os.path.relpath(args.results, ROOT), "summary": summary,
           "cases": sorted(cases, key=lambda c: (c["half"], c["case"]))}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({"bench": "fit_scale_reask", **{h: {"cases": s["cases"], "new_point_median_pct":
                                                          s["new_point_pct"]["median"], "base_point_median_pct":
                                                          s["base_point_pct"]["median"]}
                                                      for h, s in summary.items()}}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["ask", "summarize"])
    ap.add_argument("--results", default=None, help="the benchmark's per-case file (default: its committed one)")
    ap.add_argument("--only", default=None, metavar="REGEX")
    ap.add_argument("--accumulation-only", action="store_true")
    ap.add_argument("--attention-as-torch-2.11", dest="attention_as_torch_2_11", action="store_true")
    ap.add_argument("--base", default=None, help="summarize: the re-asks before the change (comma-separated)")
    ap.add_argument("--new", default=None, help="summarize: the re-asks after it (comma-separated)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.results is None:
        from bench.plan import fit_scale
        args.results = os.path.join(ROOT, "bench", "results", fit_scale.NAME + ".jsonl")
    if args.mode == "ask":
        ask(args)
    else:
        summarize(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
