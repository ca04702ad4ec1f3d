"""Which rule carries measured Keras peaks to a batch that was not measured: chosen on the fit half of
``keras_heldout.py`` (its ``carried`` parts: the peaks measured at the batches that fit 3/4 of the
reference), reported on the held half. A diagnostic behind ``measure.carry.CARRY_RULE``: it replays
the rules (``measure.extrapolate``) on the recorded points and the model's figures at them, so it
quotes no product figure of its own (the README quotes ``keras_heldout.py``'s carried part).

distmem-bench: internal - it replays the carry rules of the measured path (``measure.extrapolate``)
on recorded points to choose among them; the product's carried figures are ``keras_heldout.py``'s.

    python bench/estimate/keras_carry_rules.py FILE.jsonl   # keras_heldout.py's lines (it reads them, writes nothing)
"""
from __future__ import annotations

import json
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import keras_models as M  # noqa: E402


def _modelled(c, batches):
    """The analytic model's CPU figure at each batch (for rows recorded without it)."""
    import tensorflow as tf
    from distmem.estimate import estimate
    model, _ = M.build(c)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate(model, max(batches), M._optimizer(c["optimizer"], tf.keras), device="cpu", method="model")
    out = {b: int(est.train_bytes(b)) for b in batches}
    tf.keras.mixed_precision.set_global_policy("float32")
    return out


def main(path: str) -> int:
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from distmem.estimate.measure.extrapolate import RULES, extrapolate, physical_interval, residual_terms
    rows = [json.loads(x) for x in open(path, encoding="utf-8") if x.startswith("{")]
    refs = {r["id"]: r["reference"] for r in rows if r["part"] == "reference" and "reference" in r}
    by_id = {M.case_id(c): c for c in M.CASES}
    cases = []
    for r in rows:
        if r["part"] != "carried" or not r.get("points") or r["id"] not in refs:
            continue
        c = by_id[r["id"]]
        pts = [(int(b), int(y)) for b, y in r["points"]]
        if r.get("modelled") and r.get("modelled_target"):
            m = {int(b): int(v) for b, v in r["modelled"]}
            m[c["batch"]] = int(r["modelled_target"])
        else:
            m = _modelled(c, [b for b, _ in pts] + [c["batch"]])
        cases.append({"id": r["id"], "half": r["half"], "pts": pts, "m": m, "B": c["batch"], "ref": refs[r["id"]]})
    out = {}
    for rule in RULES:
        for half in ("fit", "held"):
            errs = []
            for k in (x for x in cases if x["half"] == half):
                use = k["pts"][-3:] if len(k["pts"]) >= 3 else k["pts"]
                terms = residual_terms([(b, y, k["m"][b]) for b, y in use], rule)
                v = extrapolate(terms, k["m"][k["B"]], k["B"])
                lo, hi = physical_interval(k["pts"], k["B"])
                v = min(max(v, lo), hi)
                errs.append(v / k["ref"] - 1)
            if errs:
                out[f"{rule}/{half}"] = {"n": len(errs), "mean_abs": round(sum(abs(e) for e in errs) / len(errs), 4),
                                         "max": round(max(errs), 4), "worst": round(min(errs), 4)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
