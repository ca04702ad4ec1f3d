"""Markdown tables of an estimate_zoo result file (per case, then the summary), for the docs.

    python bench/estimate/estimate_zoo_table.py bench/results/estimate_accuracy_torch_zoo_cpu_estimates.json
"""
from __future__ import annotations

import json
import sys


def pct(x):
    return "—" if x is None else f"{100 * x:+.1f}%"


def main(path: str) -> None:
    d = json.load(open(path, encoding="utf-8"))
    torch = d["framework"] == "torch"
    head = "| case | measured MiB | ours | baseline |" + (" MemTracker |" if torch else "")
    print(head)
    print("| --- | ---: | ---: | ---: |" + (" ---: |" if torch else ""))
    for r in d["rows"]:
        if not r.get("measured"):
            continue
        line = (f"| {r['id']} | {r['measured'] / 2**20:.1f} | {r['ours'] / 2**20:.1f} ({pct(r.get('ours_err'))}) "
                f"| {pct(r.get('baseline_err'))} |")
        if torch:
            line += f" {pct(r.get('peer_err')) if r.get('peer_err') is not None else 'could not run'} |"
        print(line)
    print()
    print("| | cases | mean abs | median abs | max abs | worst under | share under |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for key in ("ours", "baseline") + (("peer",) if torch else ()):
        s = d[key]
        if not s.get("cases"):
            continue
        print(f"| {key} | {s['cases']} | {100 * s['mean_abs_err']:.2f}% | {100 * s['median_abs_err']:.2f}% | "
              f"{100 * s['max_abs_err']:.1f}% | {100 * s['worst_under']:.1f}% | {100 * s['share_under']:.0f}% |")


if __name__ == "__main__":
    main(sys.argv[1])
