"""Every output of a report: plain and rich tables, JSON, Prometheus text, PNG, TensorBoard, and the
`distmem report` command over a saved file."""
import io
import json
import os
import re
import stat

import pytest

from distmem import cli
from distmem.errors import ConfigError
from distmem.report.sinks import (TensorBoard, plot, print_report, prometheus, prometheus_text, read_json, table,
    write_json)
from distmem.report.aggregate import aggregate
from distmem.report.summary import reduce_locally
from distmem.report.periodic import point
from distmem.units import GiB, MiB

from unit.report.test_findings import snap


def job(missing=()):
    snaps = [snap(r, peak=(3 + 2 * r) * GiB, current=(2 + r) * GiB, reserved=(4 + 2 * r) * GiB,
                  nvml={r: (5 + 2 * r) * GiB}, limit=8 * GiB) for r in range(4) if r not in missing]
    rep = aggregate(snaps, 4, missing=list(missing), strategy="data")
    rep.timeline = [point(aggregate([snap(r, peak=(1 + k + r) * GiB, current=(1 + k) * GiB) for r in range(4)], 4),
                          100 * (k + 1)) for k in range(5)]
    return rep


def test_plain_table_has_a_row_per_rank_and_marks_missing():
    text = table(job(missing=[2]))
    lines = text.splitlines()
    assert lines[0].startswith("distmem report: 4 ranks") and "missing [2]" in lines[0]
    rows = [ln for ln in lines if re.match(r"^\d+\s", ln)]
    assert [r.split()[0] for r in rows] == ["0", "1", "3", "2"]
    assert "(missing)" in rows[-1]
    assert any(ln.startswith("WARNING: rank 3 holds 10.0 GiB in its allocator (reserved; peak allocated 9.0 GiB), "
                             "above its plan of 8.0 GiB") for ln in lines)
    assert "timeline: 5 points, steps 100..500" in text


def test_summary_table_has_no_rows_but_the_aggregates():
    text = table(reduce_locally(job().ranks, 4))
    assert text.startswith("distmem report (summary): 4 ranks")
    assert "peak per rank: max 9.0 GiB (rank 3)" in text and "min 3.0 GiB (rank 0)" in text


def test_rich_output_on_demand_and_plain_in_logs():
    pytest.importorskip("rich")
    buf = io.StringIO()
    print_report(job(), file=buf)  # not a terminal: plain text
    assert buf.getvalue().startswith("distmem report:")
    buf = io.StringIO()
    print_report(job(), file=buf, use_rich=True)
    out = buf.getvalue()
    assert "rank" in out and "9.0 GiB" in out and "WARNING" in out


def test_json_round_trip_is_atomic_and_readable(tmp_path):
    rep = job(missing=[1])
    path = write_json(rep, str(tmp_path / "sub" / "r.json"))
    assert os.listdir(tmp_path / "sub") == ["r.json"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    back = read_json(path)
    assert back.to_dict() == json.loads(json.dumps(rep.to_dict()))


def test_read_json_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_json(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1}')
    with pytest.raises(ConfigError, match="not a distmem report"):
        read_json(str(bad))
    bad.write_text('{"world_size": ')
    with pytest.raises(ConfigError, match="not JSON"):
        read_json(str(bad))


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? '
                     r'(-?[0-9.e+]+|NaN|[+-]Inf)$')


def _parse(text):
    """A strict reader of the exposition format: HELP/TYPE before samples, every sample well formed."""
    typed, samples = set(), []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind == "gauge"
            typed.add(name)
            continue
        m = _SAMPLE.match(line)
        assert m, f"malformed sample line: {line!r}"
        assert m.group(1) in typed, f"{m.group(1)} has no TYPE line"
        samples.append((m.group(1), m.group(2) or "", float(m.group(3))))
    return samples


def test_prometheus_text_is_well_formed_with_rank_labels():
    rep = job(missing=[2])
    samples = _parse(prometheus_text(rep, {"run": 'res"net\\7'}, step=500))
    peak = {lab: v for name, lab, v in samples if name == "distmem_rank_peak_bytes"}
    assert peak['{run="res\\"net\\\\7",rank="3",host="node-a",local_rank="3",gpu="3"}'] == 9 * GiB
    up = {lab: v for name, lab, v in samples if name == "distmem_rank_up"}
    assert sorted(up.values()) == [0, 1, 1, 1]
    warn = {lab: v for name, lab, v in samples if name == "distmem_warnings"}
    assert warn['{run="res\\"net\\\\7",kind="missing"}'] == 1 and warn['{run="res\\"net\\\\7",kind="above_plan"}'] == 1
    assert ("distmem_report_step", '{run="res\\"net\\\\7"}', 500.0) in samples


def test_a_pipeline_rank_s_stage_is_a_label_top_groups_by():
    """The textfile carries each pipeline rank's stage, and `distmem top` reading it back groups by it
    (bug guarded: the textfile had no stage label, so top over Prometheus files showed every stage
    as '-')."""
    from distmem.report.live import parse_prometheus

    snaps = [snap(r, peak=(3 + r) * GiB, current=(2 + r) * GiB, limit=8 * GiB, stage=r // 2) for r in range(4)]
    text = prometheus_text(aggregate(snaps, 4, strategy="pipeline"))
    _parse(text)
    assert 'stage="1"' in text
    rows, _, _ = parse_prometheus(text)
    assert sorted((r.rank, r.stage) for r in rows) == [(0, 0), (1, 0), (2, 1), (3, 1)]
    # a data-parallel rank has no stage and no stage label
    assert "stage=" not in prometheus_text(job())


def test_prometheus_rejects_scraper_labels_and_writes_atomically(tmp_path):
    with pytest.raises(ConfigError, match="exported_job"):
        prometheus_text(job(), {"job": "x"})
    with pytest.raises(ConfigError, match="invalid"):
        prometheus_text(job(), {"1x": "y"})
    path = prometheus(job(), str(tmp_path / "distmem.prom"))
    assert os.listdir(tmp_path) == ["distmem.prom"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644  # node_exporter runs as another user
    _parse(open(path).read())


def test_summary_report_renders_everywhere(tmp_path):
    rep = reduce_locally(job().ranks, 4)
    _parse(prometheus_text(rep))
    plot(rep, str(tmp_path / "s.png"), timeline=[point(rep, 1), point(rep, 2)])
    assert open(tmp_path / "s.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("missing", [(), (1,)])
def test_plot_writes_a_png(tmp_path, missing):
    pytest.importorskip("matplotlib")
    path = plot(job(missing=missing), str(tmp_path / "r.png"))
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 1000 and height > 700  # two panels and the warnings
    assert os.listdir(tmp_path) == ["r.png"]


def test_plot_many_ranks_uses_bands(tmp_path):
    pytest.importorskip("matplotlib")
    snaps = [snap(r, size=100, peak=(1 + r % 7) * GiB, current=GiB) for r in range(100)]
    rep = aggregate(snaps, 100)
    rep.timeline = [point(rep, s) for s in (10, 20, 30)]
    plot(rep, str(tmp_path / "big.png"))
    assert os.path.getsize(tmp_path / "big.png") > 20_000


def test_tensorboard_scalars_per_rank(tmp_path):
    tf = pytest.importorskip("tensorflow")
    pytest.importorskip("tensorboard")
    tb = TensorBoard(str(tmp_path))
    assert tb.backend == "tf"
    for step in (100, 200):
        tb.write(job(), step)
    tb.close()
    assert sorted(os.listdir(tmp_path)) == ["job", "rank_0", "rank_1", "rank_2", "rank_3"]
    seen = {}
    for name in os.listdir(tmp_path / "rank_3"):
        for ev in tf.compat.v1.train.summary_iterator(str(tmp_path / "rank_3" / name)):
            for v in ev.summary.value:
                seen[(v.tag, ev.step)] = float(tf.make_ndarray(v.tensor))
    assert seen[("memory/peak_mib", 200)] == pytest.approx(9 * GiB / MiB)
    assert seen[("memory/limit_mib", 100)] == pytest.approx(8 * GiB / MiB)


def test_tensorboard_without_a_backend_skips_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setattr(TensorBoard, "_pick", staticmethod(lambda: "none"))
    tb = TensorBoard(str(tmp_path / "tb"))
    tb.write(job(), 1)
    assert "skipped" in tb.note and not os.path.exists(tmp_path / "tb")


def test_cli_report_renders_a_saved_file(tmp_path, capsys):
    path = write_json(job(missing=[2]), str(tmp_path / "r.json"))
    rc = cli.main(["report", path, "--plot", str(tmp_path / "r.png"), "--prometheus", str(tmp_path / "r.prom"),
                   "--label", "run=x", "--color", "never"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("distmem report: 4 ranks") and "(missing)" in out
    assert os.path.getsize(tmp_path / "r.png") > 20_000
    assert 'distmem_rank_up{run="x",rank="2"' in open(tmp_path / "r.prom").read()
    assert cli.main(["report", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["missing"] == [2]
    assert cli.main(["report", path, "--fail-on-warnings", "--color", "never"]) == 1
    assert cli.main(["report", str(tmp_path / "none.json")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_rich_table_into_a_pipe_keeps_every_column_whole():
    # `distmem report --color always | less`: a fixed 120-column console cut the columns to "…"
    pytest.importorskip("rich")
    wide = aggregate([snap(r, peak=(3 + r) * GiB, current=GiB, reserved=(4 + r) * GiB, nvml={r: (5 + r) * GiB},
                           host="a-long-host-name-of-a-real-cluster.example.org") for r in range(4)], 4)
    buf = io.StringIO()
    print_report(wide, file=buf, use_rich=True)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue())
    header = next(ln for ln in plain.splitlines() if "rank" in ln and "host" in ln)
    assert "headroom" in header and "…" not in plain and "6.0 GiB" in plain


def test_a_report_without_figures_says_why_on_the_picture(tmp_path, monkeypatch):
    # torch on the CPU reports no allocator figure: the panel says so instead of empty bars
    pytest.importorskip("matplotlib")
    from distmem.report.sinks import png

    said = []
    monkeypatch.setattr(png, "_nothing_to_draw", lambda ax, report, limits: said.append(report.world_size))
    plot(aggregate([snap(r, size=2, peak=None, current=None) for r in range(2)], 2), str(tmp_path / "e.png"))
    plot(job(), str(tmp_path / "r.png"))
    assert said == [2]
