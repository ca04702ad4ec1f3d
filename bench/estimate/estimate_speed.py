"""How long a 500-layer estimate takes, against the issue's targets (torch 1 s, Keras 0.1 s).

Each repeat builds nothing new: one 500-layer model (Dense + ReLU pairs, the shape ``speed()`` in
``bench/estimate/estimate_accuracy.py`` times) is estimated ``--repeats`` times in this process after one
small warm-up estimate, and the median and the fastest are reported with the target and the
median's ratio to it (below 1: the target is met). One JSON line; ``--out`` keeps it.

    python bench/estimate/estimate_speed.py --framework tf --out bench/results/estimate_speed_keras_tf215.json
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

TARGETS = {"tf": 0.1, "torch": 1.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=("tf", "torch"), default="tf")
    p.add_argument("--layers", type=int, default=500)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from bench.estimate import estimate_accuracy as ea
    runs = []
    for i in range(args.repeats):
        r = ea.speed(args.framework, args.layers)
        runs.append(r["seconds"])
        print(f"[estimate_speed] run {i + 1}/{args.repeats}: {r['seconds']:.3f} s", file=sys.stderr, flush=True)
    med = statistics.median(runs)
    env = {"python": platform.python_version(), "cpus": os.cpu_count(),
           "load_average": [round(x, 2) for x in os.getloadavg()]}
    if args.framework == "tf":
        import tensorflow as tf
        env["tensorflow"] = tf.__version__
    else:
        import torch
        env["torch"] = torch.__version__
    out = {"bench": "estimate_speed", "framework": args.framework, "layers": r["layers"], "method": r["method"],
           "seconds_median": round(med, 4), "seconds_min": round(min(runs), 4), "runs": [round(x, 4) for x in runs],
           "target_seconds": TARGETS[args.framework], "ratio_to_target": round(med / TARGETS[args.framework], 3),
           "target_met": med <= TARGETS[args.framework], "env": env}
    runner.emit(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
