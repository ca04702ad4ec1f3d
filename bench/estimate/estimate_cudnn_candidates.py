"""Each held-out torch case's model peaks again with every candidate of the cuDNN split-K constant.

distmem-bench: internal - a study of one internal constant (``distmem.estimate.torch.kernels.CUDNN_ROWS_PER_PARTIAL``):
it sets the constant to each candidate and asks ``estimate_torch`` again, so that
``estimate_heldout.py --priors`` can choose it on one half of the zoo and score it on the other. No
product figure comes from its file: the door ships one constant, and what it answers with it is
what the held-out figures report.

    python bench/estimate/estimate_cudnn_candidates.py --measured M.jsonl[,M2.jsonl] --out PRIORS.json

The cases are the measured path's rows (``estimate_measured_path.py``); each is built on the meta
device as the zoo builds it and estimated at its small batches and its target, per candidate; the
file is written as each case is done and read back (a case already in it is not estimated again).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402,F401  the tree on sys.path

#: the candidates (None: one partial per image, the earlier rule)
CUDNN_CANDIDATES = (None, 196, 392)


def rows_of(measured: List[str]) -> List[Dict[str, Any]]:
    rows: Dict[str, Dict[str, Any]] = {}
    for f in measured:
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    r = json.loads(line)
                    rows[r["id"]] = r  # a later file's row replaces an earlier one's
    return [r for r in rows.values() if not r.get("error")]


def reestimate(rows: List[Dict[str, Any]], store: str) -> Dict[str, Any]:
    import warnings
    import torch
    from bench.estimate import estimate_zoo_torch as Zt
    import distmem.estimate.torch.kernels as kernels
    from distmem.estimate import estimate_torch
    done: Dict[str, Any] = {}
    if os.path.exists(store):
        with open(store, encoding="utf-8") as f:
            done = json.load(f)
    shipped = kernels.CUDNN_ROWS_PER_PARTIAL
    try:
        for r in rows:
            if r["id"] in done:
                continue
            case = {k: r[k] for k in ("model", "size", "batch", "optimizer", "precision")}
            batches = [int(b) for b, _ in r["points"]] + [int(r["batch"])]
            priors: Dict[str, Dict[str, int]] = {}
            for v in CUDNN_CANDIDATES:
                kernels.CUDNN_ROWS_PER_PARTIAL = v
                model, inputs = Zt.torch_build(case, "meta")
                args, kwargs = inputs(case["batch"], "meta")
                has_conv = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())
                if not has_conv and priors:
                    priors[str(v)] = priors["None"]
                    continue
                opt = Zt.torch_optimizer(case["optimizer"], [torch.nn.Parameter(torch.zeros(2, 2))])
                prec = {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}.get(case["precision"])
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    est = estimate_torch(model, example_input=kwargs or args, batch_size=case["batch"], optimizer=opt,
                                         precision=prec, device="cuda", name=case["model"])
                    priors[str(v)] = {str(b): int(est.train_bytes(b)) for b in batches}
            done[r["id"]] = priors
            with open(store, "w", encoding="utf-8") as f:
                json.dump(done, f)
            print(f"[cudnn-candidates] {r['id']}: " + ", ".join(f"{k}: {v[str(r['batch'])]}" for k, v in priors.items()),
                  file=sys.stderr, flush=True)
    finally:
        kernels.CUDNN_ROWS_PER_PARTIAL = shipped
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--measured", required=True, help="comma-separated measured-path JSON lines (later files win)")
    p.add_argument("--out", required=True, help="the priors (JSON: case id -> candidate -> batch -> bytes)")
    args = p.parse_args()
    done = reestimate(rows_of(args.measured.split(",")), args.out)
    print(json.dumps({"bench": "estimate_cudnn_candidates", "cases": len(done), "candidates": [str(v) for v in
                                                                                               CUDNN_CANDIDATES]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
