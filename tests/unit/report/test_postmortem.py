"""The post-mortem's rules, one test per cause (each fails without its rule: the cause is then named
as something else or as unexplained), the record a rank writes, and `distmem postmortem`."""
import json
import os
import stat

import pytest

from distmem.guard import oom
from distmem.observe import oom_record
from distmem.report import postmortem as pm
from distmem.units import GiB, MiB


def rec(**kw):
    base = {"distmem_oom": 1, "rank": 0, "world_size": 4, "time": 1.0, "source": "torch-allocator", "strategy": "data",
            "stage": None, "stages": [], "limit_bytes": 20 * GiB, "allocated_bytes": 10 * GiB,
            "reserved_bytes": 10 * GiB + 100 * MiB, "largest_free_bytes": 50 * MiB, "request_bytes": 2 * GiB,
            "gpu_processes": [], "foreign_planned_bytes": 0, "device_free_bytes": 1 * GiB}
    base.update(kw)
    return base


def kinds(r, records=()):
    return [c["kind"] for c in pm.diagnose(r, records)]


def test_over_plan_names_the_rank_and_by_how_much():
    r = rec(rank=2, allocated_bytes=19 * GiB, reserved_bytes=19 * GiB + 10 * MiB)
    causes = pm.diagnose(r)
    assert [c["kind"] for c in causes] == ["over_plan"]
    assert causes[0]["over_by_bytes"] == 1 * GiB
    assert causes[0]["would_hold_bytes"] == pm.would_hold(21 * GiB) >= 21 * GiB * 1.1
    assert "distmem plan --from" in causes[0]["remedy"]


def test_fragmentation_when_the_pool_has_room_but_no_block():
    r = rec(allocated_bytes=8 * GiB, reserved_bytes=14 * GiB, largest_free_bytes=600 * MiB, request_bytes=1 * GiB)
    assert kinds(r) == ["fragmentation"]
    # the same pool with a block large enough is not fragmentation
    assert "fragmentation" not in kinds(rec(allocated_bytes=8 * GiB, reserved_bytes=14 * GiB,
                                            largest_free_bytes=2 * GiB, request_bytes=1 * GiB))


def test_foreign_process_within_the_plan():
    procs = [{"device": 0, "pid": 111, "bytes": 9 * GiB, "who": "other"},
             {"device": 0, "pid": 222, "bytes": 3 * GiB, "who": "rank 1"},
             {"device": 0, "pid": os.getpid(), "bytes": 11 * GiB, "who": "self"}]
    r = rec(gpu_processes=procs, device_free_bytes=100 * MiB)
    causes = pm.diagnose(r)
    assert [c["kind"] for c in causes] == ["foreign_process"]
    assert causes[0]["pids"] == [111] and causes[0]["unplanned_bytes"] == 9 * GiB
    # memory the plan reserved for others (foreign=) is not a cause
    assert "foreign_process" not in kinds(dict(r, foreign_planned_bytes=10 * GiB))


def test_wrong_stage_from_the_stage_rows():
    stages = [{"stage": 0, "demand_bytes": 10 * GiB, "planned_bytes": 11 * GiB},
              {"stage": 1, "demand_bytes": 4 * GiB, "planned_bytes": 5 * GiB - 100 * MiB}]
    r1 = rec(rank=1, strategy="pipeline", stage=1, stages=stages, limit_bytes=5 * GiB - 100 * MiB,
             allocated_bytes=4 * GiB, reserved_bytes=4 * GiB + 10 * MiB, request_bytes=2 * GiB)
    r0 = rec(rank=0, strategy="pipeline", stage=0, stages=stages, limit_bytes=11 * GiB, allocated_bytes=5 * GiB,
             request_bytes=1 * GiB)
    causes = pm.diagnose(r1, [r0, r1])
    assert [c["kind"] for c in causes] == ["wrong_stage"]
    assert causes[0]["stage"] == 1 and causes[0]["needed_bytes"] == 6 * GiB
    assert causes[0]["estimate_bytes"] == 4 * GiB
    assert kinds(r0, [r0, r1]) != ["wrong_stage"]


def test_unexplained_lists_the_figures():
    r = rec(allocated_bytes=1 * GiB, reserved_bytes=1 * GiB, request_bytes=1 * GiB)
    assert kinds(r) == ["unexplained"]


def test_page_names_the_first_rank_and_the_next_plan():
    late = rec(rank=3, time=5.0, allocated_bytes=19 * GiB)
    early = rec(rank=1, time=2.0, allocated_bytes=19 * GiB)
    page = pm.postmortem([late, early], run_dir="runs/x")
    assert page["first"] == 1 and page["ranks_out"] == [1, 3] and page["causes"] == {"over_plan": 2}
    text = pm.render_text(page)
    assert "2 of 4 ranks ran out of memory; first: rank 1" in text
    assert "distmem plan --from runs/x" in text


class FakeAllocator:
    """A CUDA caching allocator's figures (the real one needs a GPU): two segments, one live block
    with history from a model line that calls `self.fc1`, one without, one free hole."""

    def __init__(self, src):
        self.observers = []
        self.src = src

    def initialized(self):
        return True

    def memory_stats(self, device):
        return {"allocated_bytes.all.current": 3 * GiB, "reserved_bytes.all.current": 5 * GiB,
                "allocated_bytes.all.peak": 4 * GiB, "num_ooms": 1}

    def segments(self):
        return [{"device": 0, "total_size": 4 * GiB, "blocks": [
            {"size": 2 * GiB, "state": "active_allocated",
             "frames": [{"filename": "/x/site-packages/torch/nn/modules/linear.py", "line": 1, "name": "forward"},
                        {"filename": self.src, "line": 2, "name": "forward"}]},
            {"size": 2 * GiB, "state": "inactive"}]},
                {"device": 0, "total_size": 1 * GiB, "blocks": [{"size": 1 * GiB, "state": "active_allocated"}]}]

    def attach(self, observer):
        self.observers.append(observer)
        return True


@pytest.fixture
def hooks(tmp_path):
    import distmem

    distmem.reset()
    distmem.init(strategy="data", fleet="1x16GiB", framework="none", verbose=False)
    src = tmp_path / "model.py"
    src.write_text("class M:\n    def forward(self, x): return self.fc1(x)\n")
    oom_record.note_layers([{"name": "fc1", "total_bytes": 1536 * MiB}, {"name": "fc2", "total_bytes": 10 * MiB}])
    fake = FakeAllocator(str(src))
    oom.install(str(tmp_path / "run"), allocator=fake)
    yield fake, tmp_path / "run"
    oom.uninstall()
    oom_record.note_layers([])
    distmem.reset()


def test_the_allocator_observer_writes_a_private_record(hooks):
    fake, run = hooks
    oom_record.note_step(17)
    fake.observers[0](0, 2 * GiB, 16 * GiB, 300 * MiB)
    path = run / "oom" / "rank-0.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(run / "oom").st_mode) == 0o700
    r = json.loads(path.read_text())
    assert r["step"] == 17 and r["request_bytes"] == 2 * GiB and r["allocated_bytes"] == 3 * GiB
    assert r["largest_free_bytes"] == 2 * GiB and r["limit_bytes"] is not None
    groups = {g["layer"]: g for g in r["layers"]["groups"]}
    assert groups["fc1"]["bytes"] == 2 * GiB and groups["fc1"]["estimate_bytes"] == 1536 * MiB
    assert any(k.startswith("unknown (the allocator kept no history") for k in groups)
    # the exception that follows the same OOM adds its message, not a second record
    assert oom.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    r = json.loads(path.read_text())
    assert r["count"] == 1 and "Tried to allocate" in r["error"]


def test_an_uncaught_oom_writes_its_record(hooks, capsys):
    import sys

    _, run = hooks
    try:
        raise MemoryError("out of memory")
    except MemoryError:
        sys.excepthook(*sys.exc_info())
    r = json.loads((run / "oom" / "rank-0.json").read_text())
    assert r["source"] == "exception" and "MemoryError" in r["error"]
    assert "MemoryError" in capsys.readouterr().err  # the user's traceback still printed


def test_request_from_messages():
    assert oom_record.request_from_text("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0)") == 20 * MiB
    assert oom_record.request_from_text("OOM when allocating tensor with shape[64,1024] and type float on") \
        == 64 * 1024 * 4


def test_cli_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from distmem.cli import main

    oom_record.write_record(rec(rank=2, allocated_bytes=19 * GiB), str(tmp_path))
    assert main(["postmortem", str(tmp_path), "--json", "--plot", str(tmp_path / "pm.png")]) == 0
    page = json.loads(capsys.readouterr().out)
    assert page["first"] == 2 and page["entries"][0]["causes"][0]["kind"] == "over_plan"
    assert (tmp_path / "pm.png").stat().st_size > 1000
    assert main(["postmortem", str(tmp_path / "nothing")]) == 1


def test_an_oom_inside_the_guard_writes_its_record(hooks):
    from distmem.guard.protocol import attempt

    _, run = hooks

    def work():
        raise RuntimeError("CUDA out of memory. Tried to allocate 512.00 MiB")

    status = attempt(work, [False])[0]
    assert status.name == "OOM"
    r = json.loads((run / "oom" / "rank-0.json").read_text())
    assert r["source"] == "guard" and r["request_bytes"] == 512 * MiB


def test_tensorflow_resource_exhausted_uncaught(hooks, capsys):
    import sys

    tf = pytest.importorskip("tensorflow")
    _, run = hooks
    try:
        raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[64,1024] and type "
                                                           "float on /job:localhost/replica:0/task:0/device:GPU:0")
    except tf.errors.ResourceExhaustedError:
        sys.excepthook(*sys.exc_info())
    r = json.loads((run / "oom" / "rank-0.json").read_text())
    assert r["source"] == "exception" and r["request_bytes"] == 64 * 1024 * 4
    assert "ResourceExhaustedError" in r["error"]
    capsys.readouterr()


def test_foreign_process_when_nvml_pids_are_of_another_namespace():
    procs = [{"device": 0, "pid": 9001, "bytes": 100 * GiB, "who": "unknown"},
             {"device": 0, "pid": 9002, "bytes": 12 * GiB, "who": "unknown"}]
    r = rec(gpu_processes=procs, device_total_bytes=140 * GiB, device_free_bytes=200 * MiB, reserved_bytes=12 * GiB,
            allocated_bytes=12 * GiB, overhead_bytes=768 * MiB, shared_by=1, limit_bytes=40 * GiB)
    causes = pm.diagnose(r)
    assert [c["kind"] for c in causes] == ["foreign_process"] and causes[0]["estimated"]
    assert causes[0]["foreign_bytes"] == 140 * GiB - 200 * MiB - 12 * GiB - 768 * MiB


def test_the_report_names_this_jobs_oom_and_not_an_earlier_runs(tmp_path, monkeypatch, capsys):
    import distmem

    distmem.reset()
    monkeypatch.setenv("DISTMEM_RUN_DIR", str(tmp_path))
    distmem.init(strategy="data", fleet="1x16GiB", framework="none", verbose=False)
    oom_record.write_record(rec(rank=0, pid=os.getpid(), allocated_bytes=19 * GiB, step=7), str(tmp_path))
    rep = distmem.report(print_table=False)
    assert rep.aggregates["postmortem"]["ranks_out"] == [0]
    assert any(w.startswith("rank 0 ran out of memory at step 7: over its plan") for w in rep.warnings)
    # a record an earlier run left (another pid, written before this process started) is not this job's
    oom_record.write_record(rec(rank=0, pid=1, time=1.0, allocated_bytes=19 * GiB), str(tmp_path))
    assert "postmortem" not in distmem.report(print_table=False).aggregates
    distmem.reset()
