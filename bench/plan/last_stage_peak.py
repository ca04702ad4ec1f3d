"""A pipeline stage's true peak beside fit's figure for it, and what is live at that peak, on the GPU.

    PYTHONPATH=. python3 bench/plan/last_stage_peak.py --from bench/results/fit_scale_h200_headroom2.jsonl \\
        --case 'hand:gpt-1b B=16 1x8x8GiB' --role chosen --case 'hand:gpt-125m B=64 1x4x24GiB' \\
        --role best_rejected --out $OUT

The figure it checks is ``distmem.fit``'s answer as ``fit_scale.py`` recorded it (the stage's bounded
figure, asked of the public door); each selected run of the fit at scale (a stage's spec as fit_scale ran it: ``fit_scale.gpu_run``,
rank 0 alone, expandable segments) runs again in this process with no cap (60 GiB) and torch's
allocation history on. Per run: the true peak (``peak_allocated``), the figure fit planned from
(``estimated_peak``, the bounded one), their ratio, and the live allocations at the peak grouped by
the line of user code that made them (largest first). Written to ``last_stage_peak_h200.json``.
Found by the fit at scale under a 2% headroom (``fit_scale_h200_headroom2``): a pipeline's last
stage is priced without its loss.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def live_at_peak(snap, top: int = 12):
    """The allocations live at the highest point of the recorded history, grouped by the first
    frame outside torch and the first frame at all (bytes each group)."""
    live, cur, best, best_live = {}, 0, 0, {}
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > best:
                best, best_live = cur, dict(live)
        elif e["action"] == "free_completed":
            x = live.pop(e["addr"], None)
            if x is not None:
                cur -= x["size"]
    groups = collections.Counter()
    for e in best_live.values():
        frames = [f for f in e.get("frames", []) if f["filename"].endswith(".py")]
        own = [f for f in frames if "torch/" not in f["filename"]]
        name = lambda f: f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"  # noqa: E731
        groups[(name(own[0]) if own else "(no frame)", name(frames[0]) if frames else "(no frame)", e["size"])] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[0][2] * kv[1])[:top]
    return best, [{"code": k[0], "call": k[1], "bytes_each": k[2], "count": n} for k, n in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="from_", required=True, help="a fit_scale .jsonl")
    ap.add_argument("--case", action="append", required=True, help="a case id's start (repeat)")
    ap.add_argument("--role", action="append", required=True, help="the run's role, one per --case")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    import torch
    import fit_scale as fs

    recs = [json.loads(l) for l in open(a.from_)]
    out = []
    for case, role in zip(a.case, a.role):
        spec = next(r["spec"] for d in recs if d["case"].startswith(case) for r in d["runs"]
                    if r["spec"]["role"] == role)
        torch.cuda.memory._record_memory_history(max_entries=200000)
        res = fs.gpu_run(dict(spec, limit_bytes=60 * 1024**3))
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        replayed, live = live_at_peak(snap)
        row = {"case": spec["case"], "role": role, "describe": spec["describe"],
               "stage_blocks": [spec["first_block"], spec["stop_block"], spec["blocks"]],
               "estimated_peak": spec["estimated_peak"], "figure": spec.get("figure", "bounded"),
               "peak_allocated": res.get("peak_allocated"), "error": res.get("error"),
               "peak_over_figure": round((res.get("peak_allocated") or 0) / spec["estimated_peak"], 4),
               "replayed_peak": replayed, "live_at_peak": live}
        out.append(row)
        torch.cuda.empty_cache()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "last_stage_peak_h200.json"), "w") as f:
            json.dump({"bench": "last_stage_peak", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "runs": out}, f, indent=1)
    worst = max((r["peak_over_figure"] for r in out), default=None)
    # the one line: the worst true peak over fit's bounded figure; the peer is the bound's own promise (1.0)
    print(json.dumps({"bench": "last_stage_peak", "figure": worst, "peer": 1.0, "ratio": worst,
                      "runs": [{k: r[k] for k in ("case", "role", "estimated_peak", "peak_allocated")} for r in out]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
