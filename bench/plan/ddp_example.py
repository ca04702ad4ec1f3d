"""``examples/ddp_train.py`` on a GPU: each rank's CUDA allocator peak under DistributedDataParallel
against the demand distmem planned for it (``strategy="auto", wrapper="ddp"``).

    PYTHONPATH=. python bench/plan/ddp_example.py run --out-dir $OUT          # on a GPU: both DDP variants
    PYTHONPATH=. python bench/plan/ddp_example.py replan RUN.json [RUN.json]  # today's rules on those runs

``run`` launches the example under ``torchrun --nproc_per_node 2`` twice (default buckets, and
``gradient_as_bucket_view``), ranks sharing the GPU (Gloo), and keeps each run's JSON. ``replan``
prices each run's configuration again with the rules as they are now (the estimator alone, the same
``fit`` search the example's ``init`` runs) and holds the result against the peaks the run measured:
one JSON line, the largest |peak / demand - 1| over the ranks beside the demand the run itself was
planned with.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

ROOT = runner.ROOT
sys.path.insert(0, os.path.join(ROOT, "examples"))


def run(out_dir: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    for view in (False, True):
        out = os.path.join(out_dir, f"ddp{'_view' if view else ''}.json")
        cmd = ["torchrun", "--nproc_per_node", "2", os.path.join(ROOT, "examples", "ddp_train.py"), "--width", "4096",
               "--depth", "6", "--steps", "6", "--out", out] + (["--bucket-view"] if view else [])
        subprocess.run(cmd, env=env, timeout=300, check=False)
        print(open(out).read() if os.path.exists(out) else f"no result from {' '.join(cmd)}")


def replan(paths: List[str]) -> Dict[str, Any]:
    import ddp_train
    from distmem import fit

    cases = []
    for path in paths:
        with open(path) as f:
            run_ = json.load(f)
        n, batch = int(run_["ranks"]), int(run_["global_batch_size"])
        model = ddp_train.build(int(run_["width"]), int(run_["depth"]), "meta")
        peaks = [r["peak"] for r in run_["rows"] if r.get("peak")]
        # the H200 the runs shared (its share per rank does not change the demand)
        res = fit(model, global_batch_size=batch, gpus="1x139GiB", input_shape=(int(run_["width"]),),
                  optimizer="adamw", precision="float32", pipelines=[1], shardings="none", micro_batches=[batch // n],
                  ranks_per_gpu=[n], estimate="model",
                  wrapper="ddp_bucket_view" if run_["gradient_as_bucket_view"] else "ddp")
        demand = res.chosen.heaviest.allocator_bytes
        cases.append({"run": os.path.basename(path), "gradient_as_bucket_view": run_["gradient_as_bucket_view"],
                      "peaks": peaks, "demand_now": demand, "demand_when_run": run_["rows"][0]["demand"],
                      "error_now_pct": round(100.0 * (demand / max(peaks) - 1), 2),
                      "error_when_run_pct": round(100.0 * (run_["rows"][0]["demand"] / max(peaks) - 1), 2)})
    worst = max(abs(c["error_now_pct"]) for c in cases)
    base = max(abs(c["error_when_run_pct"]) for c in cases)
    line = {"bench": "ddp_example", "figure": "max |planned demand / measured peak - 1| %", "value": worst,
            "baseline": "the demand the runs were planned with (the rule then: two bucket sets in every phase)",
            "baseline_value": base, "ratio": round(base / worst, 2) if worst else None, "cases": cases}
    print(json.dumps(line))
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["run", "replan"])
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.mode == "run":
        run(a.out_dir)
        return 0
    line = replan(a.paths)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(line, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
