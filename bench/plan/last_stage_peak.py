"""A pipeline stage's true peak beside fit's figure for it, and what is live at that peak, on the GPU.

    PYTHONPATH=. python3 bench/plan/last_stage_peak.py --from bench/results/fit_scale_h200_headroom2.jsonl \\
        --case 'hand:gpt-1b B=16 1x8x8GiB' --role chosen --case 'hand:gpt-125m B=64 1x4x24GiB' \\
        --role best_rejected --out $OUT

The figure it checks is ``distmem.fit``'s answer as ``fit_scale.py`` recorded it (the stage's
bounded figure, asked of the public door). Each selected run of the fit at scale (a stage's spec as
fit_scale ran it: ``fit_scale.gpu_run``, rank 0 alone, expandable segments) runs again in this
process with no cap (60 GiB) and torch's allocation history on. Per run: the true peak
(``peak_allocated``), the figure fit planned from (``estimated_peak``), their ratio, and what was
live at the peak grouped by who made it (``wrappers_peak_parts.peak_parts``). Written to
``last_stage_peak_h200.json``.
Found by the fit at scale under a 2% headroom (``fit_scale_h200_headroom2``): a pipeline's last
stage is priced without its loss.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line
from bench.plan import wrappers_peak_parts  # noqa: E402  the allocator trace replayed to its peak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="from_", required=True, help="a fit_scale .jsonl")
    ap.add_argument("--case", action="append", required=True, help="a case id's start (repeat)")
    ap.add_argument("--role", action="append", required=True, help="the run's role, one per --case")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for last_stage_peak_h200.json")
    a = ap.parse_args()
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    from bench.plan import fit_scale as fs

    recs = fs.read_records(a.from_)
    out = []
    for case, role in zip(a.case, a.role):
        spec = next(r["spec"] for d in recs if d["case"].startswith(case) for r in d["runs"]
                    if r["spec"]["role"] == role)
        torch.cuda.memory._record_memory_history(max_entries=200000)
        res = fs.gpu_run(dict(spec, limit_bytes=60 * 1024**3))
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        out.append({"case": spec["case"], "role": role, "describe": spec["describe"],
                    "stage_blocks": [spec["first_block"], spec["stop_block"], spec["blocks"]],
                    "estimated_peak": spec["estimated_peak"], "figure": spec.get("figure", "bounded"),
                    "peak_allocated": res.get("peak_allocated"), "error": res.get("error"),
                    "peak_over_figure": round((res.get("peak_allocated") or 0) / spec["estimated_peak"], 4),
                    "live_at_peak": wrappers_peak_parts.peak_parts(snap["device_traces"][0], 0)})
        torch.cuda.empty_cache()
    worst = max((r["peak_over_figure"] for r in out), default=None)
    # the one line: the worst true peak over fit's bounded figure; the peer is the bound's own promise (1.0)
    line = runner.line("last_stage_peak", worst, 1.0,
                       runs=[{k: r[k] for k in ("case", "role", "estimated_peak", "peak_allocated")} for r in out])
    runner.emit(line, os.path.join(a.out, "last_stage_peak_h200.json") if a.out else None,
                full=dict(line, device=torch.cuda.get_device_name(0), torch=torch.__version__, runs=out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
