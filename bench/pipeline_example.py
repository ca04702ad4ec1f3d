"""``examples/pipeline.py`` under ``horovodrun -np 4`` on CPU: each rank's TensorFlow allocator peak
against its planned limit, with the example's all-gather exchange stated to the plan and without.

    python bench/pipeline_example.py --out bench/results/pipeline_example_cpu.json   # main environment

Two launches of the same job (``--exchange-in-plan on`` and ``off``), each with a hard timeout; each
rank's planned bytes and peak come from the job's own distmem report. One JSON line: the largest
|peak / planned - 1| over the ranks with the exchange stated (the figure), the same without it (the
baseline, the plan before ``exchange_bytes``), and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from faults import _tool  # noqa: E402  the launchers beside this interpreter (scripts/env.sh main)

MiB = 1024 ** 2


def launch(exchange: str, folder: str, timeout: float) -> List[Dict[str, Any]]:
    report = os.path.join(folder, f"report-{exchange}.json")
    cmd = [_tool("horovodrun"), "-np", "4", "-H", "localhost:4", "--gloo", sys.executable,
           os.path.join(ROOT, "examples", "pipeline.py"), "--exchange-in-plan", exchange, "--report", report]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", DISTMEM_QUIET="1")
    cp = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if cp.returncode != 0 or not os.path.exists(report):
        raise SystemExit(f"bench/pipeline_example.py: {' '.join(cmd)} exited {cp.returncode}: {cp.stderr[-1500:]}")
    with open(report) as f:
        rep = json.load(f)
    rows = []
    for r in rep["ranks"]:
        planned = (r.get("allocation") or {}).get("planned_bytes") or r.get("limit_bytes")
        peak = r.get("peak_bytes")
        rows.append({"rank": r["rank"], "stage": r.get("stage"), "planned_mib": round(planned / MiB, 1),
                     "peak_mib": round(peak / MiB, 1), "peak_over_plan_pct": round(100.0 * (peak / planned - 1), 1)})
    return sorted(rows, key=lambda r: r["rank"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        on, off = launch("on", folder, a.timeout), launch("off", folder, a.timeout)
    worst = max(abs(r["peak_over_plan_pct"]) for r in on)
    base = max(abs(r["peak_over_plan_pct"]) for r in off)
    line = {"bench": "pipeline_example", "launcher": "horovodrun -np 4 --gloo (CPU, TensorFlow's allocator)",
            "figure": "max |peak / planned - 1| % over the ranks, exchange stated (exchange_bytes)", "value": worst,
            "baseline": "the same job planned without its exchange", "baseline_value": base,
            "ratio": round(base / worst, 2) if worst else None, "with_exchange": on, "without_exchange": off}
    print(json.dumps(line))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(line, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
