"""Draw the report picture for 4, 16 and 64 ranks (docs/report-4.png, -16, -64) from synthetic
reports: hosts of 4 ranks on 4 GPUs each, a timeline of 12 gathers where several ranks have equal
figures (the case that used to hide all but the last line), one rank near its limit.

    python bench/report/report_pictures.py [--out docs]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

from distmem.observe.snapshot import Snapshot  # noqa: E402
from distmem.report.aggregate import aggregate  # noqa: E402
from distmem.report.periodic import point  # noqa: E402
from distmem.report.sinks import plot  # noqa: E402
from distmem.units import GiB, MiB  # noqa: E402


def report(n: int):
    limit = 7296 * MiB
    snaps = []
    for r in range(n):
        host, lr = f"node{r // 4}", r % 4
        peak = (5 + (r % 2)) * GiB + (1.3 * GiB if r == n - 2 else 0)  # pairs of equal ranks; one near its limit
        snaps.append(Snapshot(rank=r, size=n, local_rank=lr, host=host, pid=1000 + r, framework="torch",
                              strategy="data", devices=[lr], allocation={"devices": [{"index": lr}]},
                              limit_bytes=limit, enforced=True, current_bytes=int(peak * 0.8),
                              peak_bytes=int(peak), reserved_bytes=int(peak * 1.05)))
    timeline = []
    for k in range(12):
        step = (k + 1) * 50
        rep = aggregate([Snapshot(**{**s.__dict__, "current_bytes": int(s.current_bytes * (0.5 + k / 24)),
                                     "peak_bytes": int(s.peak_bytes * (0.55 + k / 26))}) for s in snaps], n,
                        strategy="data")
        timeline.append(point(rep, step))
    final = aggregate(snaps, n, strategy="data")
    final.timeline = timeline
    return final


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs"))
    args = ap.parse_args()
    for n in (4, 16, 64):
        path = os.path.join(args.out, f"report-{n}.png")
        plot(report(n), path)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
