"""``examples/model_parallel.py`` under ``horovodrun -np 4`` on CPU: each rank's TensorFlow allocator
peak (its devices together) against its plan, with Horovod's fusion buffer and without it.

    python bench/plan/model_parallel_example.py --repeats 2 --out bench/results/model_parallel_example_cpu.json

Every launch has a hard timeout; each rank's demand, planned bytes (what the plan gives the rank:
its devices' limits, the fusion buffer kept for the job added after the headroom) and peak come
from the job's own distmem report. One JSON line: the largest |peak / planned - 1| over the ranks
and launches with the default fusion buffer (the figure), the same with
``HOROVOD_FUSION_THRESHOLD=0`` (no fusion buffer: the baseline, a job whose plan is smaller), and
the largest |peak / demand - 1| of both.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line
from bench.plan.pipeline_example import launch_example, rank_row  # noqa: E402  one launch, one rank's row


def launch(folder: str, timeout: float, env_extra: Dict[str, str]) -> List[Dict[str, Any]]:
    cmd, cp, rep = launch_example("model_parallel.py", folder, timeout, env_extra=env_extra)
    if rep is None:
        raise SystemExit(f"bench/plan/model_parallel_example.py: {' '.join(cmd)} exited {cp.returncode}: {cp.stderr[-1500:]}")
    return sorted((rank_row(r) for r in rep["ranks"]), key=lambda r: r["rank"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    cases = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, extra in (("fusion", {}), ("no_fusion", {"HOROVOD_FUSION_THRESHOLD": "0"})):
            runs = [launch(folder, a.timeout, extra) for _ in range(a.repeats)]
            rows = [r for run in runs for r in run]
            cases[name] = {"env": extra, "launches": a.repeats, "runs": runs,
                           "max_abs_peak_over_planned_pct": max(abs(r["peak_over_planned_pct"]) for r in rows),
                           "max_abs_peak_over_demand_pct": max(abs(r["peak_over_demand_pct"]) for r in rows)}
            print(f"[bench/model_parallel_example] {name}: {a.repeats} launches ok", file=sys.stderr, flush=True)
    line = {"bench": "model_parallel_example", "launcher": "horovodrun -np 4 --gloo (CPU, TensorFlow's allocator, "
                                                           "2 logical devices per rank)",
            "figure": "max |peak / planned - 1| % over the ranks and launches, default fusion buffer",
            "value": cases["fusion"]["max_abs_peak_over_planned_pct"],
            "baseline": "the same with HOROVOD_FUSION_THRESHOLD=0",
            "baseline_value": cases["no_fusion"]["max_abs_peak_over_planned_pct"],
            "ratio": round(cases["no_fusion"]["max_abs_peak_over_planned_pct"] / cases["fusion"]["max_abs_peak_over_planned_pct"], 2)
            if cases["fusion"]["max_abs_peak_over_planned_pct"] else None, "cases": cases}
    runner.emit({k: v for k, v in line.items() if k != "cases"}, a.out, full=line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
