"""Markdown tables of held-out results (``bench/estimate/estimate_heldout.py``): per half, then every case
with its held-out errors (the measured path with the rule fitted on the other half, the model
alone) and the measured path's cost in seconds.

    python bench/estimate/estimate_heldout_table.py bench/results/estimate_heldout_keras_tf215.json
"""
from __future__ import annotations

import json
import sys

__all__ = ["table"]


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def table(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    lines = ["| held out | fitted on | rule chosen | cuDNN rows/partial | measured path: mean / max / worst | "
             "model: mean / max / worst |", "| --- | ---: | --- | --- | --- | --- |"]
    for h in d["halves"]:
        mp, mo = h["measured_path"], h["model"]
        lines.append(f"| half {h['held_out']} ({mp['cases']}) | {h['fitted_on']} | {h['rule']} | "
                     f"{h['cudnn_rows_per_partial']} | {100 * mp['mean_abs_err']:.2f}% / {100 * mp['max_abs_err']:.1f}% / "
                     f"{100 * mp['worst_under']:+.1f}% | {100 * mo['mean_abs_err']:.2f}% / {100 * mo['max_abs_err']:.1f}% / "
                     f"{100 * mo['worst_under']:+.1f}% |")
    for k in ("measured_path", "model"):
        s = d["held_out"][k]
        lines.append(f"| **all, held out** ({s['cases']}) | | | | " if k == "measured_path" else "")
    mp, mo = d["held_out"]["measured_path"], d["held_out"]["model"]
    lines[-2:] = [f"| **both halves, held out** ({mp['cases']}) | | | | **{100 * mp['mean_abs_err']:.2f}%** / "
                  f"{100 * mp['max_abs_err']:.1f}% / {100 * mp['worst_under']:+.1f}% | {100 * mo['mean_abs_err']:.2f}% / "
                  f"{100 * mo['max_abs_err']:.1f}% / {100 * mo['worst_under']:+.1f}% |"]
    lines += ["", "| case | measured path (held out) | model | seconds |", "| --- | ---: | ---: | ---: |"]
    for r in d["rows"]:
        lines.append(f"| {r['id']} | {_pct(r['measured_path_err'])} | {_pct(r['model_err'])} | {r['seconds']} |")
    for c in d.get("crashes", []):
        lines.append(f"| {c['id']} | crashed | | |")
    secs = d.get("measured_path_seconds", {})
    lines.append(f"\nMeasured path cost: median {secs.get('median')} s, max {secs.get('max')} s per case "
                 f"(the whole call); crashes: {len(d.get('crashes', []))}.")
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(table(p))
        print()
