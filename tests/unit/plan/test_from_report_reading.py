"""The reading side of the next plan (issue 36, findings 7 and 9, within one user; the cross-user
cases are tests/security/test_security_runs.py): every figure checked, every record read with the
owner/type/link checks of distmem.untrusted, what is left out named."""
from __future__ import annotations

import json
import math
import os

import pytest

from distmem.errors import ConfigError
from distmem.plan.from_report import checked_figures, read_observed, read_oom_records_noted

GiB = 1024**3


def _report(tmp_path, peak):
    path = tmp_path / "report.json"
    path.write_text('{"world_size": 2, "strategy": "data", "ranks": [{"rank": 0, "peak_bytes": %s}, '
                    '{"rank": 1, "peak_bytes": 3221225472}]}' % peak)
    return str(path)


@pytest.mark.parametrize("peak,why", [("0", "under 1 MiB"), ("-1", "is negative"), ("1e300", "above 9223372036854775807"),
                                      ("NaN", "not a finite number"), ("Infinity", "not a finite number"),
                                      ('"4GiB"', "not a number"), ("true", "not a number"), ("2.5", "not a whole")])
def test_a_figure_no_rank_could_have_used_is_a_config_error(tmp_path, peak, why):
    with pytest.raises(ConfigError, match=f"rank 0's peak_bytes .*{why}"):
        read_observed(_report(tmp_path, peak))


def test_rows_and_sizes_that_are_not_ones_are_config_errors():
    with pytest.raises(ConfigError, match="world_size"):
        checked_figures({"world_size": -3, "ranks": []}, [])
    with pytest.raises(ConfigError, match="rank"):
        checked_figures({"world_size": 2, "ranks": [{"rank": 1.5, "peak_bytes": GiB}]}, [])
    with pytest.raises(ConfigError, match="not a list"):
        checked_figures({"world_size": 2, "ranks": {"0": 1}}, [])
    checked_figures({"world_size": 2, "ranks": [{"rank": 0, "peak_bytes": GiB}]}, [])
    assert not math.isnan(GiB)


def test_records_that_are_not_records_are_left_out_and_named(tmp_path):
    oom = tmp_path / "oom"
    oom.mkdir(mode=0o700)
    good = {"distmem_oom": 1, "rank": 0, "allocated_bytes": GiB, "request_bytes": GiB, "pid": 1}
    (oom / "rank-0.json").write_text(json.dumps(good))
    (oom / "rank-1.json").write_text(json.dumps(dict(good, rank=1, allocated_bytes=-5)))
    (oom / "rank-2.json").write_text(json.dumps(dict(good, rank="2")))
    (oom / "rank-3.json").symlink_to(oom / "rank-0.json")
    os.mkfifo(oom / "rank-4.json")
    (oom / "rank-5.json").write_text("[" * 50_000)
    records, ignored = read_oom_records_noted(str(tmp_path))
    assert [r["rank"] for r in records] == [0]
    text = "\n".join(ignored)
    for what in ("rank-1.json: its allocated_bytes -5 is negative", "rank-2.json: its rank '2' is not a whole",
                 "rank-3.json: the record is a symbolic link", "rank-4.json: the record is not a regular file",
                 "rank-5.json: the record is not JSON"):
        assert what in text, text
