"""``examples/model_parallel.py`` under ``horovodrun -np 4`` on CPU: each rank's TensorFlow allocator
peak (its devices together) against its plan, with Horovod's fusion buffer and without it.

    python bench/plan/model_parallel_example.py --repeats 2 --out bench/results/model_parallel_example_cpu.json

Every launch has a hard timeout; each rank's demand, planned bytes (what the plan gives the rank:
its devices' limits, the fusion buffer kept for the job added after the headroom) and peak come
from the job's own distmem report. One JSON line: the largest peak / planned (%) over the ranks and
launches with the default fusion buffer (the figure: at most 100 means no rank went above its
plan), the same with ``HOROVOD_FUSION_THRESHOLD=0``, the count of ranks above their plan or its
demand, and the baseline: the same peaks against the demand without the Adam updates' temporaries
the example's layers count (``examples/model_parallel.layer_costs`` with ``update_temporaries=0``:
the bytes they add to the layers' state, taken off the demand), how far above its demand a rank
goes where the updates are left out.
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
from examples.model_parallel import layer_costs  # noqa: E402  the example's own per-layer costs

MiB = 1024 ** 2


def update_temporaries_bytes(batch: int = 64) -> int:
    """What the Adam updates' temporaries add to the example's layers' state at ``batch`` (its default)."""
    return (sum(c.state_bytes for c in layer_costs(batch))
            - sum(c.state_bytes for c in layer_costs(batch, update_temporaries=0)))


def launch(folder: str, timeout: float, env_extra: Dict[str, str]) -> List[Dict[str, Any]]:
    cmd, cp, rep = launch_example("model_parallel.py", folder, timeout, env_extra=env_extra)
    if rep is None:
        raise SystemExit(f"bench/plan/model_parallel_example.py: {' '.join(cmd)} exited {cp.returncode}: {cp.stderr[-1500:]}")
    rows, temps = [], update_temporaries_bytes()
    for r in rep["ranks"]:
        row = rank_row(r)
        row.update(update_temporaries_mib=round(temps / MiB, 2),
                   peak_over_demand_without_updates_pct=round(
                       100.0 * (r["peak_bytes"] / (r["allocation"]["demand_bytes"] - temps) - 1), 1),
                   warnings=[f["kind"] for f in rep.get("findings", []) if r["rank"] in f.get("ranks", [])
                             and f["kind"] in ("above_plan", "near_limit")])
        rows.append(row)
    return sorted(rows, key=lambda r: r["rank"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    cases = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, extra in (("fusion", {}), ("no_fusion", {"HOROVOD_FUSION_THRESHOLD": "0"})):
            runs = [launch(folder, a.timeout, extra) for _ in range(a.repeats)]
            rows = [r for run in runs for r in run]
            cases[name] = {"env": extra, "launches": a.repeats, "runs": runs,
                           "max_peak_of_planned_pct": round(max(100 + r["peak_over_planned_pct"] for r in rows), 1),
                           "ranks_above_plan": sum(r["peak_over_planned_pct"] > 0 for r in rows),
                           "ranks_above_demand": sum(r["peak_over_demand_pct"] > 0 for r in rows),
                           "ranks_warned": sum(bool(r["warnings"]) for r in rows),
                           "max_peak_over_demand_pct": max(r["peak_over_demand_pct"] for r in rows),
                           "max_peak_over_demand_without_updates_pct": max(r["peak_over_demand_without_updates_pct"]
                                                                           for r in rows)}
            print(f"[bench/model_parallel_example] {name}: {a.repeats} launches ok", file=sys.stderr, flush=True)
    fusion, plain = cases["fusion"], cases["no_fusion"]
    line = {"bench": "model_parallel_example", "launcher": "horovodrun -np 4 --gloo (CPU, TensorFlow's allocator, "
                                                           "2 logical devices per rank)",
            "figure": "largest peak / planned bytes (%) over the ranks and launches, default fusion buffer",
            "value": fusion["max_peak_of_planned_pct"],
            "planned_mib": max(r["planned_mib"] for run in fusion["runs"] for r in run),
            "no_fusion_planned_mib": max(r["planned_mib"] for run in plain["runs"] for r in run),
            "max_peak_over_demand_pct": max(fusion["max_peak_over_demand_pct"], plain["max_peak_over_demand_pct"]),
            "no_fusion_value": plain["max_peak_of_planned_pct"],
            "ranks_above_plan": fusion["ranks_above_plan"] + plain["ranks_above_plan"],
            "ranks_above_demand": fusion["ranks_above_demand"] + plain["ranks_above_demand"],
            "ranks_warned": fusion["ranks_warned"] + plain["ranks_warned"],
            "baseline": "the same peaks over the demand without the Adam updates' temporaries, largest, %",
            "baseline_value": max(fusion["max_peak_over_demand_without_updates_pct"],
                                  plain["max_peak_over_demand_without_updates_pct"]),
            "cases": cases}
    runner.emit({k: v for k, v in line.items() if k != "cases"}, a.out, full=line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
