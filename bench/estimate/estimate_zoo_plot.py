"""One picture of an estimate_zoo result: each case's signed error, ours beside the naive baseline.

Cases run down the page; a bar per estimator (and per result file, when two are given: TF 2.15 and
TF 2.21 side by side); the shaded band is the issue's target (no under-estimate past -3%, nothing
past +8%). Under-estimates, the ones a limit set from the estimate would run out of memory on, are
to the left.

    python bench/estimate/estimate_zoo_plot.py docs/estimate-keras.png \\
        bench/results/estimate_accuracy_keras_tf215.json bench/results/estimate_accuracy_keras_tf221.json
"""
from __future__ import annotations

import json
import sys


def main(out: str, paths) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.load(open(p, encoding="utf-8")) for p in paths]
    ids = [r["id"] for r in results[0]["rows"]]
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(ids) + 1.6))
    width = 0.8 / (2 * len(results))
    colors = [("#1f77b4", "#aec7e8"), ("#d62728", "#ff9896")]
    for j, res in enumerate(results):
        by_id = {r["id"]: r for r in res["rows"]}
        label = res.get("env", {}).get("tensorflow") or res.get("env", {}).get("torch") or f"run {j + 1}"
        for k, (key, name) in enumerate((("ours_err", "distmem"), ("baseline_err", "naive baseline"))):
            ys, xs = [], []
            for i, cid in enumerate(ids):
                e = by_id.get(cid, {}).get(key)
                if e is not None:
                    ys.append(i + (2 * j + k) * width - 0.4 + width / 2)
                    xs.append(100 * e)
            ax.barh(ys, xs, height=width, color=colors[j % 2][k], label=f"{name}, TF {label}")
    ax.axvspan(-3, 8, color="#2ca02c", alpha=0.12, label="target band (-3% .. +8%)")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(ids)))
    ax.set_yticklabels(ids, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(-60, 60)
    ax.set_xlabel("estimate error vs the measured allocator peak (%)\nleft of 0: under-estimate (a limit set from it would run out)")
    means = "\n".join(f"TF {r.get('env', {}).get('tensorflow', '?')}: mean {100 * r['ours']['mean_abs_err']:.1f}% "
                      f"(baseline {100 * r['baseline']['mean_abs_err']:.1f}%)" for r in results)
    ax.set_title(f"Keras estimates on TensorFlow's CPU allocator\n{means}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
