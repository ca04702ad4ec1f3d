"""``examples/pipeline.py`` under ``horovodrun -np 4`` on CPU: each rank's TensorFlow allocator peak
against its stage's planned demand, launch after launch, under the planned limit.

    python bench/plan/pipeline_example.py --repeats 3 --out bench/results/pipeline_example_cpu.json \
        --variant "--micro-batches 8" --variant "--micro-batch-size 32" --variant "--width-scale 2" \
        --variant "--allocator-region grow"

Every launch has a hard timeout; each rank's demand (the plan's figure for its stage's peak),
planned bytes (the demand plus the plan's 10% headroom, rounded up to whole MiB: the limit, which
the example's CPU allocator is capped at, as a GPU's would be) and peak come from the job's own
distmem report. A launch that fails (a rank out of memory under its limit) is booked, not
skipped. One JSON line: the largest |peak / demand - 1| over the ranks and launches of the
default job (the figure), the same against the demand the previous rule planned (without the
backward's gradients in flight: the baseline), their ratio, and the largest peak / planned.
Each ``--variant`` (the example's options) is booked the same way under ``variants``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

ROOT = runner.ROOT

MiB = 1024 ** 2


def launch_example(script: str, folder: str, timeout: float, options: Sequence[str] = (),
                   env_extra: Optional[Dict[str, str]] = None) -> Tuple[List[str], Any, Optional[Dict[str, Any]]]:
    """One ``horovodrun -np 4`` launch of ``examples/SCRIPT`` with a hard timeout: the command, its
    completed process and the job's own distmem report (None where the job wrote none)."""
    report = os.path.join(folder, f"report-{len(os.listdir(folder))}.json")
    cmd = [runner.tool("horovodrun"), "-np", "4", "-H", "localhost:4", "--gloo", sys.executable,
           os.path.join(ROOT, "examples", script), *options, "--report", report]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", DISTMEM_QUIET="1", **(env_extra or {}))
    cp = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if cp.returncode != 0 or not os.path.exists(report):
        return cmd, cp, None
    with open(report) as f:
        return cmd, cp, json.load(f)


def rank_row(r: Dict[str, Any]) -> Dict[str, Any]:
    """One rank of a report against its plan: demand, planned bytes (its limit) and peak, in MiB and %."""
    alloc = r.get("allocation") or {}
    planned = (alloc.get("breakdown") or {}).get("planned_bytes") or r.get("limit_bytes")
    demand, peak = alloc["demand_bytes"], r["peak_bytes"]
    return {"rank": r["rank"], "demand_mib": round(demand / MiB, 2), "planned_mib": round(planned / MiB, 1),
            "peak_mib": round(peak / MiB, 2), "peak_over_demand_pct": round(100.0 * (peak / demand - 1), 1),
            "peak_over_planned_pct": round(100.0 * (peak / planned - 1), 1)}


def launch(folder: str, timeout: float, options: Sequence[str] = ()) -> Dict[str, Any]:
    cmd, cp, rep = launch_example("pipeline.py", folder, timeout, options)
    if rep is None:
        if "OOM when allocating" not in cp.stdout + cp.stderr:
            raise SystemExit(f"bench/plan/pipeline_example.py: {' '.join(cmd)} exited {cp.returncode}: {cp.stderr[-1500:]}")
        return {"ok": False, "failure": "out of memory under the planned limit", "ranks": []}
    rows = []
    for r in rep["ranks"]:
        row = rank_row(r)
        transient = int(((r.get("allocation") or {}).get("breakdown") or {}).get("transient_bytes", 0))
        previous = r["allocation"]["demand_bytes"] - transient
        row.update(stage=r.get("stage"), transient_mib=round(transient / MiB, 2),
                   peak_over_previous_rule_pct=round(100.0 * (r["peak_bytes"] / previous - 1), 1))
        rows.append(row)
    return {"ok": True, "ranks": sorted(rows, key=lambda r: r["rank"])}


def book(folder: str, timeout: float, repeats: int, options: Sequence[str] = ()) -> Dict[str, Any]:
    """``repeats`` launches of one job: every launch's rows, and the worst of them."""
    runs = []
    for k in range(repeats):
        runs.append(launch(folder, timeout, options))
        print(f"[bench/pipeline_example] {' '.join(options) or 'default'}: launch {k + 1}/{repeats} "
              f"{'ok' if runs[-1]['ok'] else runs[-1]['failure']}", file=sys.stderr, flush=True)
    rows = [r for run in runs for r in run["ranks"]]
    worst = lambda key: max((abs(r[key]) for r in rows), default=None)  # noqa: E731
    return {"options": " ".join(options), "launches": repeats, "failed_launches": sum(not r["ok"] for r in runs),
            "max_abs_peak_over_demand_pct": worst("peak_over_demand_pct"),
            "max_abs_peak_over_previous_rule_pct": worst("peak_over_previous_rule_pct"),
            "max_peak_over_planned_pct": max((r["peak_over_planned_pct"] for r in rows), default=None),
            "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--repeats", type=int, default=3, help="launches of each job (default 3)")
    ap.add_argument("--variant", action="append", default=[], metavar="OPTIONS",
                    help="the example's options for one more job, e.g. '--micro-batches 8'")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        default = book(folder, a.timeout, a.repeats)
        variants = [book(folder, a.timeout, a.repeats, shlex.split(v)) for v in a.variant]
    value, base = default["max_abs_peak_over_demand_pct"], default["max_abs_peak_over_previous_rule_pct"]
    line = {"bench": "pipeline_example", "launcher": "horovodrun -np 4 --gloo (CPU, TensorFlow's allocator capped "
                                                     "at the planned bytes)",
            "figure": "max |peak / planned demand - 1| % over the ranks and launches of the default job",
            "value": value, "baseline": "the same against the demand the previous rule planned (no backward "
                                        "gradients in flight)", "baseline_value": base,
            "ratio": round(base / value, 2) if value else None,
            "failed_launches": default["failed_launches"] + sum(v["failed_launches"] for v in variants),
            "max_peak_over_planned_pct": default["max_peak_over_planned_pct"],
            "default": default, "variants": variants}
    runner.emit({k: v for k, v in line.items() if k not in ("default", "variants")}, a.out, full=line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
