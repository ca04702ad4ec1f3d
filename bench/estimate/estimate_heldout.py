"""Held-out accuracy of the estimator: every choice fitted on one half of a zoo, scored on the other.

Each zoo (torch on the H200; Keras on CPU per TensorFlow version) is split in two halves by a hash
of the case name (deterministic, blind to the results). The figures are the door's: each row of
the measured path's JSON lines (``bench/estimate/estimate_measured_path.py``) holds what
``distmem.estimate(..., method="measure")`` answered (``measured_path``, with the rule it said it
carried the points by), the small-batch peaks it measured (``points``) and its model's peaks
(``modelled``, ``modelled_target``; zeros where the model could not be trusted for the case). On
the fitting half the script chooses what the estimator would otherwise have had tuned on the whole
zoo, from those recorded answers:

* the measured path's extrapolation rule among the candidates of :data:`CANDIDATES` (offset,
  linear, ratio, scale, blend, measured, model; written here as the study's own arithmetic on the
  door's points and model peaks, and checked against the door: the shipped rule's formula
  reproduces each recorded answer it carried, ``study_matches_door``), the one with the least mean
  absolute error among those whose worst under-estimate is no worse than -5% (or the least mean if
  none is); a case whose model was not trusted is scored by the door's own answer under every rule;
* torch: the cuDNN split-K constant among those of ``--priors`` (each case's model peaks estimated
  again per candidate by ``bench/estimate/estimate_cudnn_candidates.py``, a study of that internal
  constant), the one with the least mean absolute error of the model alone;

and reports both paths (the measured path, what the planners use where it runs, and the model
alone) on the other half; then the halves swap, so every case is held out once. ``production``:
the door's own answers on every case (``measured_path``, ``modelled_target``), as recorded. The
Keras margin (``table.KERAS_ESTIMATE_MARGIN``) is the held-out worst under-estimate of the measured
path on both TensorFlow versions, rounded up to 5%.

    python bench/estimate/estimate_heldout.py --framework keras --zoo bench/results/estimate_accuracy_keras_tf215.json \\
        --measured bench/results/estimate_measured_keras_tf215.jsonl --out bench/results/estimate_heldout_keras_tf215.json
    python bench/estimate/estimate_heldout.py --framework torch --zoo A.json,B.json --measured M.jsonl --priors P.json --out ...
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

WORST_BOUND = -0.05
#: the extrapolation rules the study chooses among (docs/estimate.md describes each)
CANDIDATES = ("offset", "linear", "ratio", "scale", "blend", "measured", "model")


def carried(points: List[List[int]], modelled: List[int], target_modelled: int, batch: int, rule: str) -> float:
    """The estimate at ``batch`` by ``rule`` from the measured ``points`` ([batch, peak]) and the
    model's peaks at them (``modelled``) and at the target (``target_modelled``)."""
    pts = sorted((int(b), int(y), int(m)) for (b, y), m in zip(points, modelled))
    res = [y - m for _, y, m in pts]
    if rule == "model" or not pts:
        return float(target_modelled)
    if rule == "offset" or len(pts) < 2:
        return target_modelled + sum(res) / len(res)
    (b1, y1, m1), (b2, y2, m2) = pts[0], pts[-1]
    if rule == "ratio":
        return target_modelled * sum(y / max(m, 1) for _, y, m in pts) / len(pts)
    if rule == "scale":
        return target_modelled * y2 / max(m2, 1)
    beta = ((y2 - m2) - (y1 - m1)) / (b2 - b1)
    linear = (y1 - m1) - beta * b1
    if rule == "linear":
        return target_modelled + linear + beta * batch
    if rule == "blend":
        return target_modelled + (sum(res) / len(res) + linear) / 2 + beta / 2 * batch
    if rule == "measured":
        return y2 + (y2 - y1) / (b2 - b1) * (batch - b2)
    raise ValueError(f"unknown rule {rule!r}; one of {CANDIDATES}")


def half_of(case_id: str) -> int:
    """0 or 1: the case's half, from a hash of its name."""
    return int(hashlib.sha256(case_id.encode()).hexdigest()[:8], 16) % 2


def stats(errs: List[float]) -> Dict[str, Any]:
    if not errs:
        return {"cases": 0}
    a = [abs(e) for e in errs]
    return {"cases": len(errs), "mean_abs_err": round(statistics.mean(a), 4),
            "median_abs_err": round(statistics.median(a), 4), "max_abs_err": round(max(a), 4),
            "worst_under": round(min(min(errs), 0.0), 4), "share_under": round(sum(e < 0 for e in errs) / len(errs), 3)}


def _path_err(c: Dict[str, Any], rule: str, prior: Dict[str, int]) -> float:
    if not c.get("trusted", True):  # the door carried the points by their own line: its answer
        return c["door"] / c["reference"] - 1.0
    est = carried(c["points"], [prior[str(b)] for b, _ in c["points"]], prior[str(c["batch"])], c["batch"], rule)
    return est / c["reference"] - 1.0


def _choose_rule(cases: List[Dict[str, Any]], variant: Any) -> str:
    scored = []
    for rule in CANDIDATES:
        errs = [_path_err(c, rule, c["priors"][str(variant)]) for c in cases]
        s = stats(errs)
        scored.append((s["worst_under"] < WORST_BOUND, s["mean_abs_err"], rule))
    return min(scored)[2]


def _choose_variant(cases: List[Dict[str, Any]]) -> str:
    """The model peaks' variant (a cuDNN candidate of ``--priors``, or "recorded") with the least
    mean absolute error of the model alone."""
    keys = list(cases[0]["priors"]) if cases else ["recorded"]
    return min(keys, key=lambda k: statistics.mean(abs(c["priors"][k][str(c["batch"])] / c["reference"] - 1)
                                                   for c in cases))


def load_cases(zoo_files: List[str], measured_files: List[str]) -> List[Dict[str, Any]]:
    ref: Dict[str, Dict[str, Any]] = {}
    for f in zoo_files:
        with open(f, encoding="utf-8") as fh:
            for r in json.load(fh)["rows"]:
                if r.get("measured"):
                    ref[r["id"]] = r
    rows: Dict[str, Dict[str, Any]] = {}
    for f in measured_files:
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    r = json.loads(line)
                    rows[r["id"]] = r  # a later file's row replaces an earlier one's
    cases = []
    for cid, r in rows.items():
        c = {"id": cid, "model": r["model"], "batch": int(r["batch"]), "half": half_of(cid),
             "error": r.get("error"), "seconds": r.get("seconds"), "reference": ref.get(cid, {}).get("measured")}
        if not c["error"]:
            c["points"] = [[int(b), int(y)] for b, y in r["points"]]
            prior = {str(b): int(m) for b, m in r["modelled"]}
            prior[str(c["batch"])] = int(r["modelled_target"])
            c.update(door=int(r["measured_path"]), rule=r.get("rule"), modelled=[int(m) for _, m in r["modelled"]],
                     modelled_target=int(r["modelled_target"]),
                     # the door named no model peaks at the small batches: it carried them by their own line
                     trusted=any(int(m) for _, m in r["modelled"]))
            c["priors"] = {"recorded": prior}
            c["row"] = r
        cases.append(c)
    return cases


def read_priors(cases: List[Dict[str, Any]], path: str) -> None:
    """Each case's model peaks per cuDNN candidate, as ``estimate_cudnn_candidates.py`` wrote them."""
    with open(path, encoding="utf-8") as f:
        done = json.load(f)
    for c in cases:
        if not c.get("error") and c["id"] in done:
            c["priors"] = done[c["id"]]


def evaluate(cases: List[Dict[str, Any]], framework: str) -> Dict[str, Any]:
    scored = [c for c in cases if not c.get("error") and c.get("reference")]
    out: Dict[str, Any] = {"halves": []}
    per_case = []
    for held in (0, 1):
        fit = [c for c in scored if c["half"] != held]
        test = [c for c in scored if c["half"] == held]
        variant = _choose_variant(fit) if framework == "torch" else "recorded"
        rule = _choose_rule(fit, variant)
        path = [_path_err(c, rule, c["priors"][str(variant)]) for c in test]
        model = [c["priors"][str(variant)][str(c["batch"])] / c["reference"] - 1 for c in test]
        out["halves"].append({"held_out": held, "fitted_on": len(fit), "rule": rule, "cudnn_rows_per_partial": variant,
                              "measured_path": stats(path), "model": stats(model)})
        for c, e, m in zip(test, path, model):
            per_case.append({"id": c["id"], "half": held, "rule": rule, "measured_path_err": round(e, 4),
                             "model_err": round(m, 4), "seconds": c["seconds"],
                             "reference": c["reference"]})
    out["held_out"] = {"measured_path": stats([r["measured_path_err"] for r in per_case]),
                       "model": stats([r["model_err"] for r in per_case])}
    secs = [c["seconds"] for c in cases if c.get("seconds") is not None]
    out["measured_path_seconds"] = {"median": round(statistics.median(secs), 2) if secs else None,
                                    "max": max(secs) if secs else None}
    out["production"] = production(scored, framework)
    out["crashes"] = [{"id": c["id"], "error": c["error"][-300:]} for c in cases if c.get("error")]
    out["not_scored"] = [c["id"] for c in cases if not c.get("error") and not c.get("reference")]
    out["rows"] = sorted(per_case, key=lambda r: r["id"])
    return out


def production(scored: List[Dict[str, Any]], framework: str) -> Dict[str, Any]:
    """What the door answered on every case (``measured_path`` with the rule it named, and its
    model's peak), each case's points, model peaks and reference beside it, so a test can check the
    margin; ``study_matches_door``: the cases whose answer this study's formula for the door's rule
    reproduces (to 1 KiB), of those the door carried with its model."""
    cases, path, model, match, carried_n = [], [], [], 0, 0
    for c in scored:
        path.append(c["door"] / c["reference"] - 1)
        model.append(c["modelled_target"] / c["reference"] - 1)
        if c.get("trusted", True) and c.get("rule"):
            carried_n += 1
            mine = carried(c["points"], c["modelled"], c["modelled_target"], c["batch"], c["rule"])
            match += abs(mine - c["door"]) <= 1024
        cases.append({"id": c["id"], "batch": c["batch"], "points": c["points"], "rule": c.get("rule"),
                      "modelled": c["modelled"], "modelled_target": c["modelled_target"],
                      "reference": c["reference"], "measured_path": c["door"], "measured_path_err": round(path[-1], 4),
                      "model_err": round(model[-1], 4), "seconds": c["seconds"]})
    rules = sorted({c.get("rule") or "?" for c in scored})
    return {"rules": rules, "measured_path": stats(path), "model": stats(model),
            "study_matches_door": f"{match} of {carried_n}", "cases": cases}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=("keras", "torch"), required=True)
    p.add_argument("--zoo", required=True, help="comma-separated zoo result files (the references)")
    p.add_argument("--measured", required=True, help="comma-separated measured-path JSON lines (later files win)")
    p.add_argument("--priors", default=None, help="torch: each case's model peaks per cuDNN candidate "
                                                  "(estimate_cudnn_candidates.py); without it, the door's recorded ones")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    t0 = time.time()
    cases = load_cases(args.zoo.split(","), args.measured.split(","))
    if args.priors and args.framework == "torch":
        read_priors(cases, args.priors)
    result = {"bench": "estimate_heldout", "framework": args.framework, "zoo": args.zoo.split(","),
              "measured": args.measured.split(","), "split": "sha256(case id) % 2",
              "worst_bound_for_rule_choice": WORST_BOUND, **evaluate(cases, args.framework),
              "seconds": round(time.time() - t0, 1)}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
