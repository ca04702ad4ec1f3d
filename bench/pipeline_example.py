"""``examples/pipeline.py`` under ``horovodrun -np 4`` on CPU: each rank's TensorFlow allocator peak
against its planned limit, with the example's all-gather exchange stated to the plan and without.

    python bench/pipeline_example.py --out bench/results/pipeline_example_cpu.json \
        --variant "--micro-batches 8" --variant "--micro-batch-size 32" --variant "--width-scale 2" \
        --variant "--allocator-region grow"

Two launches of the same job (``--exchange-in-plan on`` and ``off``), each with a hard timeout; each
rank's demand, planned bytes (the demand plus the plan's 10% headroom, rounded up to whole MiB) and
peak come from the job's own distmem report. One JSON line: the largest |peak / planned - 1| over
the ranks with the exchange stated (the figure), the same without it (the baseline, the plan before
``exchange_bytes``), their ratio, and the largest |peak / demand - 1| (how close the per-stage
demand is to what the stage holds). Each ``--variant`` (the example's options) is one more launch
with the exchange stated, booked under ``variants``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from faults import _tool  # noqa: E402  the launchers beside this interpreter (scripts/env.sh main)

MiB = 1024 ** 2


def launch(exchange: str, folder: str, timeout: float, options: Sequence[str] = ()) -> List[Dict[str, Any]]:
    report = os.path.join(folder, f"report-{exchange}-{len(os.listdir(folder))}.json")
    cmd = [_tool("horovodrun"), "-np", "4", "-H", "localhost:4", "--gloo", sys.executable,
           os.path.join(ROOT, "examples", "pipeline.py"), *options, "--exchange-in-plan", exchange, "--report", report]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", DISTMEM_QUIET="1")
    cp = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if cp.returncode != 0 or not os.path.exists(report):
        raise SystemExit(f"bench/pipeline_example.py: {' '.join(cmd)} exited {cp.returncode}: {cp.stderr[-1500:]}")
    with open(report) as f:
        rep = json.load(f)
    rows = []
    for r in rep["ranks"]:
        alloc = r.get("allocation") or {}
        planned = alloc.get("planned_bytes") or r.get("limit_bytes")
        demand = alloc.get("demand_bytes")
        peak = r.get("peak_bytes")
        rows.append({"rank": r["rank"], "stage": r.get("stage"), "demand_mib": round(demand / MiB, 2),
                     "planned_mib": round(planned / MiB, 1), "peak_mib": round(peak / MiB, 2),
                     "peak_over_plan_pct": round(100.0 * (peak / planned - 1), 1),
                     "peak_over_demand_pct": round(100.0 * (peak / demand - 1), 1)})
    return sorted(rows, key=lambda r: r["rank"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--variant", action="append", default=[], metavar="OPTIONS",
                    help="the example's options for one more launch (exchange stated), e.g. '--micro-batches 8'")
    a = ap.parse_args()
    worst = lambda rows, key: max(abs(r[key]) for r in rows)  # noqa: E731
    with tempfile.TemporaryDirectory() as folder:
        on, off = launch("on", folder, a.timeout), launch("off", folder, a.timeout)
        variants = []
        for options in a.variant:
            rows = launch("on", folder, a.timeout, shlex.split(options))
            variants.append({"options": options, "value": worst(rows, "peak_over_plan_pct"),
                             "value_vs_demand": worst(rows, "peak_over_demand_pct"), "with_exchange": rows})
    value, base = worst(on, "peak_over_plan_pct"), worst(off, "peak_over_plan_pct")
    line = {"bench": "pipeline_example", "launcher": "horovodrun -np 4 --gloo (CPU, TensorFlow's allocator)",
            "figure": "max |peak / planned - 1| % over the ranks, exchange stated (exchange_bytes)", "value": value,
            "baseline": "the same job planned without its exchange", "baseline_value": base,
            "ratio": round(base / value, 2) if value else None,
            "value_vs_demand": worst(on, "peak_over_demand_pct"),
            "with_exchange": on, "without_exchange": off, "variants": variants}
    print(json.dumps(line))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(line, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
