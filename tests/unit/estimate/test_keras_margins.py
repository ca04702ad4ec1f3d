"""The Keras margins follow the measurement: each path's margin (``table.KERAS_MARGINS``) is the
worst case of its path on the benchmark's **fit** half, rounded up to 5 points
(``bench/results/estimate_keras_heldout_tf2*.json``, written by ``bench/estimate/keras_heldout.py
--score``; every process's reference of a case counts: the benchmark measures references again in
fresh processes, ``*_again*.jsonl``), and the held-out half is only reported against it: the summary's count of held-out
references inside the bound must be the count under the margins in the table now (a margin changed
without re-scoring would leave the README quoting another margin's coverage). A margin no fit half
measured says it is provisional."""
from __future__ import annotations

import json
import math
import pathlib

import pytest

from distmem.estimate.table import KERAS_MARGINS, Bound

RESULTS = pathlib.Path(__file__).resolve().parents[3] / "bench" / "results"
#: the benchmark's parts, by the path that made their figures
PARTS = {"default": "measured", "carried": "carried", "model": "modelled"}
SUMMARIES = sorted(RESULTS.glob("estimate_keras_heldout_tf2??.json"))


def _up(x: float) -> float:
    return math.ceil(max(x, 0.0) * 20 - 1e-9) / 20


def _pairs(data, half, source):
    """``(row, reference)`` for every process's reference of each case (``reference_runs``: the
    benchmark measures a case's reference again in fresh processes, and a bound must hold each)."""
    refs = {r["id"]: r.get("reference_runs") or [r["reference"]]
            for r in data["rows"] if r["part"] == "reference" and "reference" in r}
    return [(r, ref) for r in data["rows"] if r["part"] in PARTS and r.get("half") == half
            and r.get("source") == source and "figure" in r and r["id"] in refs for ref in refs[r["id"]]]


def _fit(source):
    return [(f.name, r, ref) for f in SUMMARIES for r, ref in _pairs(json.loads(f.read_text()), "fit", source)]


@pytest.mark.parametrize("source", sorted(set(PARTS.values())))
def test_each_paths_margin_is_its_fit_halfs_worst_case_rounded_up(source):
    margin = KERAS_MARGINS[source]
    cases = _fit(source)
    if not cases:
        assert "provisional" in margin.basis, (source, margin.basis)
        pytest.skip(f"no fit-half {source} figures under bench/results: the margin says it is provisional")
    need_under = max(ref / r["figure"] - 1 for _, r, ref in cases)
    need_over = max(r["figure"] / ref - 1 for _, r, ref in cases)
    assert (margin.under, margin.over) == (_up(need_under), _up(need_over)), (
        f"{source}: the fit half needs under {need_under:+.2%}, over {need_over:+.2%} "
        f"(rounded up: {_up(need_under):.2f}, {_up(need_over):.2f}); the table has {margin.under}, {margin.over}")
    for name, row, ref in cases:
        bound = Bound.around(row["figure"], margin, source)
        assert bound.low_bytes <= ref <= bound.high_bytes, (name, row["id"], ref, bound)
    assert "estimate_keras_heldout" in margin.basis and "fit half" in margin.basis, margin.basis
    assert "provisional" not in margin.basis, margin.basis


@pytest.mark.parametrize("source", sorted(set(PARTS.values())))
def test_the_summary_reports_the_held_out_half_under_the_margins_in_the_table(source):
    got = False
    for f in SUMMARIES:
        data = json.loads(f.read_text())
        held = _pairs(data, "held", source)
        if not held or source not in data.get("margins", {}):
            continue
        got = True
        margin = KERAS_MARGINS[source]
        recorded = data["margins"][source]
        assert (recorded["under"], recorded["over"]) == (margin.under, margin.over), (
            f"{f.name}: scored with {source} margins {recorded['under']} / {recorded['over']}, the table has "
            f"{margin.under} / {margin.over}: re-score (keras_heldout.py --score --summary) and update the quoted figures")
        cases = {}  # a case is inside where every process's reference is
        for r, ref in held:
            bound = Bound.around(r["figure"], margin, source)
            key = (r["id"], r["part"])
            cases[key] = cases.get(key, True) and bound.low_bytes <= ref <= bound.high_bytes
        inside = sum(cases.values())
        assert (recorded["held_inside_n"], recorded["held_cases"]) == (inside, len(cases)), (
            f"{f.name}: {recorded['held_inside']} recorded, {inside}/{len(cases)} under the table's {source} margin")
    if not got:
        pytest.skip(f"no scored held-out {source} figures under bench/results")


def test_a_part_measured_again_is_compared_case_by_case():
    """keras_heldout's --repeat-of: a reference measured again moves against the first reference; a
    default estimate run again moves against the first figure, and each run's error is read against
    the first reference (the noise floor docs/estimate.md quotes)."""
    import importlib.util

    path = RESULTS.parent / "estimate" / "keras_heldout.py"
    spec = importlib.util.spec_from_file_location("keras_heldout_bench", path)
    kh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kh)
    first = [{"id": "a", "part": "reference", "half": "held", "reference": 100},
             {"id": "a", "part": "default", "half": "held", "figure": 90},
             {"id": "b", "part": "reference", "half": "fit", "reference": 200},
             {"id": "b", "part": "default", "half": "fit", "figure": 210}]
    ref = kh.repeat(first, [{"id": "a", "part": "reference", "half": "held", "reference": 110}])
    assert ref["part"] == "reference" and ref["cases"] == 1
    assert ref["held"]["reference_moved"]["max"] == 0.1 and ref["held"]["default_error"]["worst"] == -0.1
    again = [{"id": "a", "part": "default", "half": "held", "figure": 81},
             {"id": "b", "part": "default", "half": "fit", "figure": 231}]
    got = kh.repeat(first, again, "default")
    assert got["cases"] == 2 and got["all"]["default_moved"]["worst"] == -0.1
    assert got["all"]["default_moved"]["worst_case"] == "a" and got["all"]["default_moved"]["max"] == 0.1
    assert got["held"]["default_error"]["worst"] == -0.1 and got["held"]["default_again_error"]["worst"] == -0.19
    assert got["fit"]["default_again_error"]["max"] == 0.155
    assert got["held"]["percent"]["again_worst"] == -19.0 and got["held"]["percent"]["first_worst"] == -10.0


def test_a_default_part_run_again_is_scored_against_every_processs_reference(tmp_path):
    """``--score --repeat-of FIRST --out AGAIN`` of a default part scores both runs as ``--score``
    does: against each case's worst reference over every process (``NAME_again*.jsonl``), from
    ``--references`` where the first run's rows were moved beside the main file; the bug scored
    them against the first process's reference alone, and quoted errors ``--score`` never gives."""
    import importlib.util

    path = RESULTS.parent / "estimate" / "keras_heldout.py"
    spec = importlib.util.spec_from_file_location("keras_heldout_bench", path)
    kh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kh)

    def write(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)
    ref = {"id": "a", "part": "reference", "half": "held", "reference": 100}
    main = write("run.jsonl", [ref, {"id": "a", "part": "default", "half": "held", "figure": 95}])
    write("run_again1.jsonl", [{**ref, "reference": 120}])
    old = write("run_old.jsonl", [ref, {"id": "a", "part": "default", "half": "held", "figure": 90}])
    again = write("run_default_again1.jsonl", [{"id": "a", "part": "default", "half": "held", "figure": 108}])
    for first, extra, want in ((main, [], (95 / 120 - 1, 108 / 120 - 1)),
                               (old, ["--references", main], (90 / 120 - 1, 108 / 120 - 1))):
        out = str(tmp_path / "repeat.json")
        assert kh.main(["--score", "--repeat-of", first, "--out", again, "--summary", out, *extra]) == 0
        got = json.loads(pathlib.Path(out).read_text())
        held = got["summary"]["held"]
        assert (held["default_error"]["worst"], held["default_again_error"]["worst"]) == tuple(round(w, 4) for w in want)
        assert "run_again1.jsonl" in got["references"], got["references"]
