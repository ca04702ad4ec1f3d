import json
import os

import pytest

import distmem
from distmem import comm
from distmem.errors import ConfigError, DistmemError


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for k in [k for k in os.environ if k.startswith(("OMPI_", "PMI", "HOROVOD_", "SLURM_"))] + ["TF_CONFIG", "DISTMEM_FLEET"]:
        monkeypatch.delenv(k, raising=False)
    distmem.reset()
    yield
    distmem.reset()


def test_snapshot_needs_init():
    with pytest.raises(DistmemError, match="call distmem.init"):
        distmem.snapshot()


def test_cpu_mode_plans_and_reports(tmp_path, capsys):
    plan = distmem.init(framework="none")
    assert plan.mine.mode == "cpu" and plan.source == "none"
    assert "no GPU" in capsys.readouterr().err
    path = tmp_path / "sub" / "report.json"
    rep = distmem.report(path=str(path))
    assert rep is not None and [s.rank for s in rep.ranks] == [0] and rep.missing == []
    data = json.loads(path.read_text())
    assert data["ranks"][0]["pid"] == os.getpid() and data["ranks"][0]["rss_bytes"] > 0
    assert not [p for p in os.listdir(path.parent) if p.startswith(".distmem-")]  # temp file renamed away
    assert "distmem report: 1 rank," in capsys.readouterr().out


def test_fleet_dry_run_records_limits_without_applying(monkeypatch):
    monkeypatch.setenv("DISTMEM_FLEET", "1x16GiB")
    plan = distmem.init(framework="none", memory="limit", verbose=False)
    assert plan.source == "fleet:1x16GiB" and plan.mine.devices[0].enforce
    rep = distmem.report(print_table=False)
    assert rep.ranks[0].plan_source == "fleet:1x16GiB"
    from distmem.report.sinks import table

    assert "dry run" in table(rep)


def test_bad_arguments_name_the_fix():
    with pytest.raises(ConfigError, match="enforce='hard'"):
        distmem.init(enforce="hard")
    with pytest.raises(ConfigError, match="limit= applies to strategy='data'"):
        distmem.init(strategy="pipeline", limit="1GiB", framework="none")
    with pytest.raises(ConfigError, match="framework='mxnet'"):
        distmem.init(framework="mxnet")
    distmem.init(framework="none", verbose=False)
    with pytest.raises(ConfigError, match="detail='all'"):
        distmem.report(detail="all")


def test_launched_rank_without_transport_is_an_error(monkeypatch):
    distmem.init(framework="none", verbose=False)
    monkeypatch.setenv("HOROVOD_RANK", "1")
    monkeypatch.setenv("HOROVOD_SIZE", "4")
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "1")
    monkeypatch.setenv("HOROVOD_LOCAL_SIZE", "4")
    comm.set_comm(None)
    with pytest.raises(ConfigError, match="rank 1 of 4.*hvd.init"):
        comm.get_comm()


def test_tensorflow_cpu_stats_are_real():
    tf = pytest.importorskip("tensorflow")
    distmem.init(framework="tensorflow", verbose=False)
    x = tf.random.uniform((512, 512))
    y = tf.matmul(x, x)
    snap = distmem.snapshot()
    assert snap.framework == "tensorflow"
    assert snap.peak_bytes is not None and snap.peak_bytes >= 2 * 512 * 512 * 4
    assert snap.current_bytes is not None and snap.current_bytes >= 512 * 512 * 4
    del y


def test_overhead_auto_uses_the_outside_model_and_counts_nccl(monkeypatch):
    """Without a GPU to measure on, overhead='auto' is the measured model of memory outside the
    allocator (context + cuBLAS + cuDNN); a job on NCCL adds its communicator's buffers."""
    from distmem import api
    from distmem.plan.outside import outside_allocator_bytes

    monkeypatch.setenv("DISTMEM_QUIET", "1")
    distmem.reset()
    plain = distmem.init(framework="torch", overhead="auto", fleet="1x16GiB").overhead_bytes
    assert plain == outside_allocator_bytes("torch") and plain != 768 * 1024**2
    distmem.reset()
    monkeypatch.setattr(api.runtime, "nccl_communicators", lambda: 1)
    nccl = distmem.init(framework="torch", overhead="auto", fleet="1x16GiB").overhead_bytes
    assert nccl == outside_allocator_bytes("torch", nccl_communicators=1) > plain + 256 * 1024**2
    distmem.reset()


def test_the_final_report_carries_the_timeline_the_job_collected(tmp_path, monkeypatch):
    """ReportEvery without path= collects points; a later distmem.report(path=...) writes them."""
    import json

    monkeypatch.setenv("DISTMEM_QUIET", "1")
    distmem.reset()
    distmem.init(framework="none", verbose=False)
    every = distmem.ReportEvery(2)
    for _ in range(6):
        every.step()
    out = tmp_path / "report.json"
    rep = distmem.report(path=str(out), print_table=False)
    assert [p["step"] for p in rep.timeline] == [2, 4, 6]
    assert [p["step"] for p in json.loads(out.read_text())["timeline"]] == [2, 4, 6]
    distmem.reset()
