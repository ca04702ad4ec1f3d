"""The Keras margins follow the measurement: each path's margin (``table.KERAS_MARGINS``) covers its
held-out cases on both TensorFlow versions (``bench/results/estimate_keras_heldout_tf2*.json``,
written by ``bench/estimate/keras_heldout.py``): measured at the target batch — the run-to-run spread
between the estimate's steps and a fresh process's; carried — the carry's error from the batches that
fit; modelled — the analytic model's. A margin made smaller than its path's worst held-out case, or a
path whose figures drift beyond its margin, fails here."""
from __future__ import annotations

import json
import math
import pathlib

import pytest

from distmem.estimate.table import KERAS_MARGINS, Bound

RESULTS = pathlib.Path(__file__).resolve().parents[3] / "bench" / "results"
#: the benchmark's parts, by the path that made their figures
PARTS = {"default": "measured", "carried": "carried", "model": "modelled"}


def _cases():
    files = sorted(RESULTS.glob("estimate_keras_heldout_tf2??.json"))
    out = []
    for f in files:
        data = json.loads(f.read_text())
        refs = {r["id"]: r["reference"] for r in data["rows"] if r["part"] == "reference" and "reference" in r}
        for r in data["rows"]:
            if r["part"] in PARTS and r.get("half") == "held" and "figure" in r and r["id"] in refs:
                out.append((f.name, r, refs[r["id"]]))
    return out


CASES = _cases()


@pytest.mark.parametrize("source", sorted(set(PARTS.values())))
def test_each_paths_margin_covers_its_held_out_cases(source):
    cases = [(f, r, ref) for f, r, ref in CASES if r.get("source") == source]
    if not cases:
        pytest.skip(f"no held-out {source} figures under bench/results (run bench/estimate/keras_heldout.py)")
    margin = KERAS_MARGINS[source]
    for name, row, ref in cases:
        bound = Bound.around(row["figure"], margin, source)
        assert bound.low_bytes <= ref <= bound.high_bytes, (
            f"{name} {row['id']} ({row['part']}): measured {ref:,} B outside [{bound.low_bytes:,}, "
            f"{bound.high_bytes:,}] around the {source} figure {row['figure']:,} B (margin under "
            f"{margin.under:.0%}, over {margin.over:.0%})")


def test_the_margins_are_no_wider_than_their_worst_case_needs():
    """A margin is its path's worst held-out case rounded up (to 5 points), not a blanket figure."""
    for source, margin in KERAS_MARGINS.items():
        cases = [(r, ref) for _, r, ref in CASES if r.get("source") == source]
        if not cases:
            continue
        need_under = max(ref / r["figure"] - 1 for r, ref in cases)
        need_over = max(r["figure"] / ref - 1 for r, ref in cases)
        assert margin.under <= math.ceil(max(need_under, 0) * 20 + 1e-9) / 20 + 0.05, (source, need_under)
        assert margin.over <= math.ceil(max(need_over, 0) * 20 + 1e-9) / 20 + 0.05, (source, need_over)
        assert "estimate_keras_heldout" in margin.basis, source
