"""The model behind ``distmem top``: rows by rank from report JSON and Prometheus textfiles (written
by distmem's own writers), merging several files, warnings as they first appear, the rendering
(hosts, stages, sort, collapse, scroll, colours only when asked) and the watcher that re-reads only
the files whose modification time or size changed."""
from __future__ import annotations

import json
import os
import re
import time

import pytest

from distmem.cli.top import Watcher, _keys
from distmem.observe.snapshot import Snapshot
from distmem.report.aggregate import aggregate
from distmem.report.live import LiveJob, ViewState, imbalance, parse_prometheus, parse_report, render
from distmem.report.sinks.prometheus import prometheus_text
from distmem.units import GiB, MiB


def _snap(rank: int, host: str, peak: int, stage=None, limit=4 * GiB) -> Snapshot:
    return Snapshot(rank=rank, size=8, local_rank=rank % 4, host=host, pid=100 + rank, framework="torch",
                    strategy="data", devices=[rank % 4], allocation={}, limit_bytes=limit, enforced=True,
                    current_bytes=peak - 100 * MiB, peak_bytes=peak, reserved_bytes=peak, stage=stage)


def _report(peaks, hosts=("a", "b"), missing=(), stages=False):
    snaps = [_snap(r, hosts[r // 4], p, stage=(r % 2 if stages else None)) for r, p in enumerate(peaks)
             if r not in missing]
    return aggregate(snaps, world_size=len(peaks), missing=list(missing))


def test_a_report_json_and_its_textfile_give_the_same_rows():
    rep = _report([1 * GiB, 2 * GiB, 1 * GiB, 1 * GiB, 5 * GiB, 1 * GiB, 1 * GiB, 1 * GiB])
    rows_j, warn_j, facts = parse_report(json.dumps(rep.to_dict()))
    rows_p, warn_p, facts_p = parse_prometheus(prometheus_text(rep, step=7))
    key = lambda r: (r.rank, r.host, r.planned, r.current, r.peak, r.up)  # noqa: E731
    assert sorted(map(key, rows_j)) == sorted(map(key, rows_p))
    assert facts["world_size"] == facts_p["world_size"] == 8 and facts_p["step"] == 7
    assert [k for k, _, _ in warn_j] == [f["kind"] for f in rep.findings]
    assert {k for k, _, _ in warn_p} == {f["kind"] for f in rep.findings} and "above_plan" in {k for k, _, _ in warn_p}
    assert rows_j[4].use == pytest.approx(5 / 4)


def test_missing_ranks_stay_visible():
    rep = _report([GiB] * 8, missing=(6,))
    for rows, _, _ in (parse_report(json.dumps(rep.to_dict())), parse_prometheus(prometheus_text(rep))):
        assert [r.rank for r in rows if not r.up] == [6]
    job = LiveJob()
    job.update("r.json", json.dumps(rep.to_dict()))
    assert "missing from the last report" in "\n".join(render(job, ViewState()))


def test_files_merge_by_rank_newest_report_wins_and_warnings_appear_once():
    job = LiveJob()
    a = _report([GiB] * 8)
    a.created = 100.0
    b = _report([GiB, GiB, GiB, GiB, 3 * GiB, GiB, GiB, 5 * GiB])
    b.created = 200.0
    job.update("host-a.prom", prometheus_text(a), now=1000.0)
    assert job.warnings == []
    job.update("host-b.json", json.dumps(b.to_dict()), now=1001.0)
    job.update("host-b.json", json.dumps(b.to_dict()), now=1002.0)  # the same report again
    rows = job.rows()
    assert [r.rank for r in rows] == list(range(8))
    assert rows[7].peak == 5 * GiB and rows[7].source == "host-b.json"
    assert [w.first_seen for w in job.warnings] == [1001.0] * len(b.warnings)
    assert job.update("broken.json", "{not json") is False and "broken.json" in job.errors
    c = _report([GiB, GiB, GiB, GiB, 3 * GiB, GiB, GiB, 5.5 * GiB])  # the same findings, new figures
    c.created = 300.0
    job.update("host-b.json", json.dumps(c.to_dict()), now=1003.0)
    assert [w.first_seen for w in job.warnings] == [1001.0] * len(b.warnings)
    assert any("5.5 GiB" in w.text for w in job.warnings)


def test_render_groups_by_host_and_stage_sorts_collapses_and_scrolls():
    rep = _report([GiB, 2 * GiB, 3 * GiB, GiB, GiB, GiB, 4.5 * GiB, GiB], stages=True)
    job = LiveJob()
    job.update("r.json", json.dumps(rep.to_dict()), now=rep.created)
    text = "\n".join(render(job, ViewState(), now=rep.created + 1, width=200))
    assert re.findall(r"^(\w): 4 rank\(s\)", text, re.M) == ["a", "b"]
    rank_lines = [int(m.group(1)) for m in re.finditer(r"^\s+(\d+)\s+(\d)\s", text, re.M)]
    assert rank_lines == [0, 2, 1, 3, 4, 6, 5, 7]  # by host, then stage, then rank
    assert "\x1b[" not in text
    state = ViewState(sort="peak", reverse=True)
    text = "\n".join(render(job, state, width=200))
    assert [int(m.group(1)) for m in re.finditer(r"^\s+(\d+)\s+(\d)\s", text, re.M)][:2] == [2, 0]
    assert "imbalance" in text and f"{imbalance(job.rows()):.2f}" in text
    state = ViewState(collapsed=True)
    assert not re.search(r"^\s+\d+\s+\d\s", "\n".join(render(job, state, width=200)), re.M)
    small = render(job, ViewState(), height=8, width=200)
    assert any("more line(s)" in ln for ln in small) and len(small) <= 12
    colored = "\n".join(render(job, ViewState(), color=True, width=200))
    assert "\x1b[31m" in colored  # rank 6 above its plan


def test_the_watcher_reads_only_what_changed(tmp_path):
    rep = _report([GiB] * 8)
    paths = []
    for h in ("a", "b"):
        p = tmp_path / f"host-{h}.prom"
        p.write_text(prometheus_text(rep))
        paths.append(p)
    (tmp_path / ".distmem-x.prom.tmp").write_text("half a fi")
    (tmp_path / "notes.txt").write_text("x")
    w, job = Watcher([str(tmp_path)]), LiveJob()
    assert w.poll(job) == 2 and w.poll(job) == 0
    time.sleep(0.01)
    rep2 = _report([GiB] * 7 + [6 * GiB])
    paths[1].write_text(prometheus_text(rep2))
    os.utime(paths[1], ns=(time.time_ns(), time.time_ns() + 10_000_000))
    assert w.poll(job) == 1 and job.rows()[7].peak == 6 * GiB
    paths[0].unlink()
    w.poll(job)
    assert list(job.by_source) == [str(paths[1])]


def test_keys_are_split_with_escape_sequences_whole():
    assert _keys("sh\x1b[Bq") == ["s", "h", "\x1b[B", "q"]
    assert _keys("\x1b[6~j") == ["\x1b[6~", "j"]


def test_two_jobs_in_one_folder_never_merge_by_rank(tmp_path):
    """Issue 36, finding 8: rows merged by rank alone, so another job's rank 0 replaced this one's.
    Each file's job id (what its writer put in it) keeps them apart; one job's per-host files merge."""
    a, b = _report([GiB] * 8), _report([3 * GiB] * 8)
    a.aggregates["job_id"], b.aggregates["job_id"] = "aaaa", "bbbb"
    b.created = a.created + 10
    job = LiveJob()
    job.update("a.prom", prometheus_text(a))
    job.update("b.json", json.dumps(b.to_dict()))
    rows = job.rows()
    assert len(rows) == 16 and {r.job for r in rows} == {"job aaaa", "job bbbb"}
    assert [r.peak for r in rows if r.rank == 0] == [GiB, 3 * GiB]
    text = "\n".join(render(job, ViewState(), width=200))
    assert "job aaaa: 8 rank(s)" in text and "job bbbb: 8 rank(s)" in text and "in 2 jobs" in text
    same = LiveJob()
    same.update("host-a.prom", prometheus_text(a))
    same.update("host-b.json", json.dumps(dict(a.to_dict(), created=a.created + 1)))
    assert len(same.rows()) == 8 and len(same.jobs()) == 1


def test_text_from_a_file_never_drives_the_terminal():
    rep = _report([GiB] * 8, hosts=("a\x1b]0;owned\x07", "b\x1b[2J"))
    rep.warnings.append("rank 1 \x1b[31mred\x1b[0m")
    job = LiveJob()
    job.update("r.json", json.dumps(rep.to_dict()))
    job.update("p.prom", prometheus_text(rep).replace('host="b', 'host="\\u001b[31mb'))
    job.update("bad\x1b[1m.json", "{not json")
    text = "\n".join(render(job, ViewState(), width=400))
    assert "\x1b" not in text and "\x07" not in text
    assert "a\\x1b]0;owned\\x07" in text and "\\x1b[31mred" in text


def test_top_says_what_it_found_where_no_report_is(tmp_path, capsys):
    from distmem.cli import main

    (tmp_path / "notes.json").write_text('{"name": "not a report"}')
    (tmp_path / "broken.json").write_text("{half")
    assert main(["top", str(tmp_path), "--once"]) != 0
    err = capsys.readouterr().err
    assert "2 file(s) ending in .json or .prom, none a report" in err
    assert "notes.json: ValueError: JSON but not a distmem report (no 'world_size')" in err and "broken.json" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.txt").write_text("x")
    assert main(["top", str(empty), "--once"]) != 0
    assert "nothing ending in .json or .prom (it holds 1 other file(s), e.g. x.txt)" in capsys.readouterr().err
