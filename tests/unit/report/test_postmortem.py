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


GPU = {"device_total_bytes": 140 * GiB, "driver_reserved_bytes": 600 * MiB, "reserve_bytes": 256 * MiB,
       "overhead_bytes": 768 * MiB, "shared_by": 4, "foreign_planned_bytes": 0}


def rec(**kw):
    base = {"distmem_oom": 1, "kind": "oom", "rank": 0, "world_size": 4, "time": 1.0, "source": "torch-allocator",
            "strategy": "data", "stage": None, "stages": [], "limit_bytes": 20 * GiB, "allocated_bytes": 10 * GiB,
            "reserved_bytes": 10 * GiB + 100 * MiB, "largest_free_bytes": 50 * MiB, "request_bytes": 2 * GiB,
            "gpu_processes": [], "foreign_planned_bytes": 0, "device_free_bytes": 40 * GiB}
    base.update(kw)
    return base


def steps(*points):
    """Step notes: (step, allocated entering it, peak so far, samples) -> note_step's points."""
    return [{"step": s, "allocated_bytes": a, "peak_bytes": p, "samples": n, "elements": n * 1000}
            for s, a, p, n in points]


def kinds(r, records=()):
    return [c["kind"] for c in pm.diagnose(r, records)]


# -- the case of the issue: rank 3 fed 8x its peers' batch -----------------------------------

def issue_case():
    """4 ranks, each a hard limit of 34.1 GiB; ranks 0-2 peaked at 11.3 GiB on their step of 64 samples
    (6.5 GiB entering it), rank 3 was fed 512 and ran out 32 MiB short of a 2 GiB block."""
    peer = dict(GPU, kind="stopped", step=0, limit_bytes=int(34.1 * GiB), allocated_bytes=int(7.9 * GiB),
                reserved_bytes=12 * GiB, peak_bytes=int(11.3 * GiB), units={"samples": 64, "elements": 64000},
                steps=steps((0, int(6.5 * GiB), int(6.5 * GiB), 64)))
    peers = [dict(peer, rank=r) for r in range(3)]
    r3 = rec(**GPU, rank=3, step=0, limit_bytes=int(34.1 * GiB), allocated_bytes=int(30.1 * GiB),
             reserved_bytes=34 * GiB, largest_free_bytes=2 * GiB - 32 * MiB, request_bytes=2 * GiB,
             units={"samples": 512, "elements": 512000}, steps=steps((0, int(6.5 * GiB), int(6.5 * GiB), 512)))
    return r3, peers


def test_the_issue_case_is_imbalance_with_its_figures_not_fragmentation():
    r3, peers = issue_case()
    causes = pm.diagnose(r3, [r3] + peers)
    first = causes[0]
    assert first["kind"] == "imbalance" and first["confidence"] == "high"
    assert "fragmentation" not in [c["kind"] for c in causes]  # 32 MiB short of 2 GiB is a tie
    need = 6.5 * GiB + 8 * (11.3 - 6.5) * GiB  # its peers' step scaled to its batch: ~44.9 GiB
    assert abs(first["needed_bytes"] - need) < 2 * MiB and first["ratio"] == pytest.approx(need / (11.3 * GiB), 0.01)
    assert "4.0x the median of its 3 peers (11.3 GiB)" in first["message"]
    assert "it was fed 8.0x the median of theirs" in first["message"] and "44.9 GiB" in first["message"]
    # the change it names fits: every rank its share of the 704 samples, 176 each
    assert first["change"]["change"] == "balance_batch" and first["change"]["samples_per_rank"] == 176
    assert first["change"]["need_bytes"] * 1.1 <= 34.1 * GiB
    # the step needs more than the limit too: named after the imbalance
    assert [c["kind"] for c in causes][1] == "over_plan"


def test_the_issue_case_without_sizes_still_compares_the_bytes():
    # no batch noted: what it held at the failure is already 2.7x its peers' peak; they were stopped
    # inside their first step, so their peaks may be partial: medium, not high
    r3, peers = issue_case()
    for r in [r3] + peers:
        r["units"] = {}
        r["steps"] = [{k: v for k, v in p.items() if k not in ("samples", "elements")} for p in r["steps"]]
    causes = pm.diagnose(r3, [r3] + peers)
    assert causes[0]["kind"] == "imbalance" and causes[0]["confidence"] == "medium"
    assert causes[0]["needed_bytes"] == int(30.1 * GiB) + 2 * GiB  # a lower bound: "(at least)"
    assert "(at least)" in causes[0]["message"]
    assert "fragmentation" not in [c["kind"] for c in causes]


def test_a_tie_is_not_fragmentation_but_a_real_gap_is():
    # the pool holds 6 GiB free; the whole step (history: 9 GiB) fits in its 14 GiB pool
    hist = steps((4, 5 * GiB, 5 * GiB, 100), (5, 5 * GiB, 9 * GiB, 100))
    base = dict(step=5, steps=hist, units={"samples": 100, "elements": 100000}, allocated_bytes=8 * GiB,
                reserved_bytes=14 * GiB, request_bytes=1 * GiB)
    assert kinds(rec(**base, largest_free_bytes=600 * MiB))[0] == "fragmentation"
    c = pm.diagnose(rec(**base, largest_free_bytes=600 * MiB))[0]
    assert c["confidence"] == "high" and c["change"]["change"] == "expandable_segments" and c["change"]["fits"]
    assert "fragmentation" not in kinds(rec(**base, largest_free_bytes=1 * GiB - 20 * MiB))  # within 5%: a tie
    assert "fragmentation" not in kinds(rec(**base, largest_free_bytes=2 * GiB))  # a block fits
    # the same pool, but the step needs more than the pool could hold (25 GiB, limit 20): not its shape
    big = dict(base, units={"samples": 500, "elements": 500000})
    assert "fragmentation" not in kinds(rec(**big, largest_free_bytes=600 * MiB))


def test_over_plan_prices_the_whole_step_and_names_a_micro_batch_that_fits():
    # every rank fed too much: distmem's estimate of the model at 256 samples and halves of it
    est = {"batch_size": 256, "method": "simulated", "state_bytes": 2 * GiB,
           "points": [[256, 30 * GiB], [128, 19 * GiB], [64, 9 * GiB], [32, 5 * GiB]]}
    r = rec(rank=2, step=0, estimate=est, units={"samples": 256, "elements": 256000}, allocated_bytes=17 * GiB,
            reserved_bytes=18 * GiB, request_bytes=2 * GiB, steps=steps((0, 2 * GiB, 2 * GiB, 256)))
    causes = pm.diagnose(r)
    assert causes[0]["kind"] == "over_plan" and causes[0]["needed_bytes"] == 30 * GiB
    assert causes[0]["source"] == "estimate" and causes[0]["confidence"] == "high"
    change = causes[0]["change"]
    assert change["change"] == "micro_batch" and change["micro_batch"] == 64 and change["accumulation"] == 4
    # what it held at the failure alone would not have said it: 19 GiB of 20
    assert pm.needed_bytes(r) < r["limit_bytes"]


def test_a_micro_batch_holds_the_rest_of_the_batch_and_a_modelled_figure_keeps_more_room():
    # the estimate's step at 128 samples (15 GiB) would fit a 20 GiB limit; but the loop of micro-batches
    # still holds the other 128 samples' input (20 MiB each) and one micro-batch's outputs (4 MiB each), and
    # the estimate is a model: 15 + 2.5 + 0.5 GiB with 10% + 10% is over 20 GiB; 64 samples is 8 + 3.75 + 0.25
    est = {"batch_size": 256, "method": "simulated", "state_bytes": 2 * GiB, "input_bytes_per_sample": 20 * MiB,
           "output_bytes_per_sample": 4 * MiB, "points": [[256, 30 * GiB], [128, 15 * GiB], [64, 8 * GiB]]}
    r = rec(rank=2, step=0, estimate=est, units={"samples": 256, "elements": 256000}, allocated_bytes=17 * GiB,
            reserved_bytes=18 * GiB, request_bytes=2 * GiB, steps=steps((0, 2 * GiB, 2 * GiB, 256)))
    change = pm.diagnose(r)[0]["change"]
    assert change["change"] == "micro_batch" and change["micro_batch"] == 64 and change["accumulation"] == 4
    assert change["need_bytes"] == 12 * GiB and change["modelled"] is True
    assert "with the rest of the batch and one micro-batch's outputs held" in change["text"]


def test_over_plan_on_the_lower_bound_alone():
    r = rec(rank=2, allocated_bytes=19 * GiB, reserved_bytes=19 * GiB + 10 * MiB)
    causes = pm.diagnose(r)
    assert [c["kind"] for c in causes] == ["over_plan"]
    assert causes[0]["over_by_bytes"] == 1 * GiB and "(at least)" in causes[0]["message"]
    assert causes[0]["would_hold_bytes"] == pm.would_hold(21 * GiB) >= 21 * GiB * 1.1


def test_growth_across_steps():
    # 300 MiB more held entering each step: a loss history kept as tensors
    hist = steps(*[(k, 3 * GiB + k * 300 * MiB, 3 * GiB + k * 300 * MiB + 2 * GiB, 32) for k in range(20)])
    r = rec(step=19, steps=hist, units={"samples": 32, "elements": 32000}, limit_bytes=10 * GiB,
            allocated_bytes=3 * GiB + 19 * 300 * MiB + 1 * GiB, reserved_bytes=10 * GiB, request_bytes=2 * GiB)
    causes = pm.diagnose(r)
    assert causes[0]["kind"] == "growth" and causes[0]["confidence"] == "high"
    assert causes[0]["per_step_bytes"] == 300 * MiB
    assert causes[0]["change"]["change"] == "release_kept" and causes[0]["change"]["need_bytes"] <= 10 * GiB / 1.1
    # steady steps are not growth
    flat = steps(*[(k, 3 * GiB, 5 * GiB, 32) for k in range(20)])
    assert "growth" not in kinds(rec(step=19, steps=flat, limit_bytes=4 * GiB))


def test_foreign_process_when_the_gpu_was_full():
    procs = [{"device": 0, "pid": 111, "bytes": 100 * GiB, "who": "other"},
             {"device": 0, "pid": 222, "bytes": 11 * GiB, "who": "rank 1"},
             {"device": 0, "pid": os.getpid(), "bytes": 11 * GiB, "who": "self"}]
    r = rec(**GPU, gpu_processes=procs, device_free_bytes=100 * MiB)
    causes = pm.diagnose(r)
    assert [c["kind"] for c in causes] == ["foreign_process"]
    assert causes[0]["pids"] == [111] and causes[0]["unplanned_bytes"] == 100 * GiB
    # planning around 100 GiB leaves each of 4 ranks less than its step: stop it
    assert causes[0]["change"]["change"] == "stop_foreign"
    # memory the plan reserved for others (foreign=) is not a cause; nor is a GPU with room
    assert "foreign_process" not in kinds(dict(r, foreign_planned_bytes=100 * GiB))
    assert "foreign_process" not in kinds(dict(r, device_free_bytes=50 * GiB))


def test_outside_the_allocator_when_the_gpu_was_full():
    # each rank's process holds 6 GiB more than its pool and context: NCCL communicators, a library's pool
    procs = [{"device": 0, "pid": 10 + k, "bytes": 30 * GiB + 768 * MiB + 6 * GiB, "who": "self" if k == 0 else
              f"rank {k}"} for k in range(4)]
    r0 = rec(**GPU, rank=0, gpu_processes=procs, limit_bytes=34 * GiB, allocated_bytes=29 * GiB,
             reserved_bytes=30 * GiB, request_bytes=1 * GiB, device_free_bytes=200 * MiB, largest_free_bytes=0)
    peers = [dict(r0, rank=k, kind="stopped", peak_bytes=29 * GiB, request_bytes=None) for k in range(1, 4)]
    causes = pm.diagnose(r0, [r0] + peers)
    assert causes[0]["kind"] == "outside_allocator" and causes[0]["outside_bytes"] == 24 * GiB
    assert causes[0]["change"]["change"] == "outside_cap" and causes[0]["change"]["max_outside_bytes"] > 0
    assert "foreign_process" not in [c["kind"] for c in causes]


NCCL_FIRST_LINE = ("DistBackendError: NCCL error in: NCCLUtils.cpp:93, unhandled cuda error (run with NCCL_DEBUG=INFO "
                   "for details), NCCL version 2.28.9")


def test_a_rank_ended_on_a_cuda_failure_with_its_gpu_full_ran_out_outside_its_allocator():
    # the H200's case: NCCL's calloc refused by the driver, the record keeping only the error's first line
    # (no "out of memory", no request), written as a rank that ended on another error; the GPU full by NVML
    total = 140 * GiB
    each = (total - 600 * MiB - 16 * MiB) // 2
    procs = [{"device": 0, "pid": 10 + k, "bytes": each, "who": "self" if k == 1 else f"rank {k}"} for k in range(2)]
    r1 = rec(**dict(GPU, shared_by=2), rank=1, world_size=2, kind="stopped", source="stopped", error=NCCL_FIRST_LINE,
             gpu_processes=procs, limit_bytes=64 * GiB, allocated_bytes=5 * GiB, reserved_bytes=60 * GiB,
             request_bytes=None, device_free_bytes=None, largest_free_bytes=4 * GiB)
    r0 = dict(r1, rank=0, error="distmem: rank 1 (host vm) failed (" + NCCL_FIRST_LINE + "); stopping this rank",
              gpu_processes=[dict(p, who="self" if p["who"] == "rank 0" else "rank 1") for p in procs])
    page = pm.postmortem([r0, r1])
    assert page["ranks_out"] == [1] and [p["rank"] for p in page["stopped"]] == [0]
    cause = page["entries"][0]["causes"][0]
    assert cause["kind"] == "outside_allocator" and cause["confidence"] == "medium", cause
    assert "NVML left 16.0 MiB free" in cause["evidence"]
    # the same error with room on the GPU is not read as running out; nor is fail fast's word about another rank
    roomy = [dict(p, bytes=p["bytes"] - GiB) for p in procs]
    assert pm.postmortem([r0, dict(r1, gpu_processes=roomy)])["ranks_out"] == []
    assert pm.postmortem([r0])["ranks_out"] == []


def test_nccls_refused_allocation_is_an_oom_with_its_request():
    text = ("NCCL error in: NCCLUtils.cpp:93, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL "
            "version 2.28.9\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
            "Failed to CUDA calloc async 608 bytes")
    assert oom.is_oom(RuntimeError(text))
    assert "calloc async 608 bytes" in oom.describe(RuntimeError(text))
    assert oom_record.request_from_text(text) == 608
    assert not oom.is_oom(RuntimeError("NCCL error: unhandled system error, remote process exited"))


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
    stopped = rec(rank=0, time=2.1, kind="stopped", peak_bytes=19 * GiB, request_bytes=None)
    page = pm.postmortem([late, early, stopped], run_dir="runs/x")
    assert page["first"] == 1 and page["ranks_out"] == [1, 3] and page["causes"] == {"over_plan": 2}
    assert [p["rank"] for p in page["stopped"]] == [0]
    text = pm.render_text(page)
    assert "2 of 4 ranks ran out of memory; first: rank 1" in text
    assert "distmem plan --from runs/x" in text and "stopped by fail fast: rank 0" in text


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


def test_cli_plot_writes_the_format_its_name_says(tmp_path, capsys):
    """``--plot pm.svg`` is an SVG (it was PNG bytes under any name), and a name no picture format
    has is refused before the work, naming the formats."""
    pytest.importorskip("matplotlib")
    from distmem.cli import main

    oom_record.write_record(rec(rank=2, allocated_bytes=19 * GiB), str(tmp_path))
    assert main(["postmortem", str(tmp_path), "--plot", str(tmp_path / "pm.svg")]) == 0
    head = (tmp_path / "pm.svg").read_bytes()[:400]
    assert b"<svg" in head and not head.startswith(b"\x89PNG"), head[:40]
    capsys.readouterr()
    assert main(["postmortem", str(tmp_path), "--plot", str(tmp_path / "pm.txt")]) != 0
    err = capsys.readouterr().err
    assert "pm.txt" in err and ".png" in err and not (tmp_path / "pm.txt").exists()


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
    assert any(w.startswith("rank 0 ran out of memory at step 7: the step needs more than its limit")
               for w in rep.warnings)
    # a record an earlier run left (another pid, written before this process started) is not this job's
    oom_record.write_record(rec(rank=0, pid=1, time=1.0, allocated_bytes=19 * GiB), str(tmp_path))
    assert "postmortem" not in distmem.report(print_table=False).aggregates
    distmem.reset()


class Priced:
    """An estimate as note_estimate reads it: its batch, method, state, a sample's input and its last
    layer's output, and the step's peak at a batch."""

    class Row:
        def __init__(self, name, out):
            self.name, self.state_bytes, self.output_bytes_per_sample = name, 0, out

        def activation_bytes(self, b):
            return b * self.output_bytes_per_sample

    batch_size, method, state_bytes, input_bytes_per_sample = 64, "simulated", 1 * GiB, 512
    layers = [Row("fc1", 64), Row("head", 40)]

    def train_bytes(self, b):
        return 1 * GiB + b * 16 * MiB


def test_the_record_carries_the_steps_the_batch_and_the_estimate(hooks):
    import numpy as np

    fake, run = hooks
    oom_record.note_estimate(Priced())
    for step in (5, 6):
        oom_record.note_step(step, (np.zeros((32, 128)), np.zeros(32)))
    fake.observers[0](0, 2 * GiB, 16 * GiB, 300 * MiB)
    r = json.loads((run / "oom" / "rank-0.json").read_text())
    assert r["kind"] == "oom" and [p["step"] for p in r["steps"]] == [5, 6]
    assert r["steps"][-1]["allocated_bytes"] == 3 * GiB and r["steps"][-1]["peak_bytes"] == 4 * GiB
    assert r["units"] == {"samples": 32, "elements": 32 * 128}
    assert r["estimate"]["points"][:2] == [[32, GiB + 32 * 16 * MiB], [16, GiB + 16 * 16 * MiB]]
    # what a micro-batch loop holds besides the estimate's step: the rest of the batch, the last outputs
    assert r["estimate"]["input_bytes_per_sample"] == 512 and r["estimate"]["output_bytes_per_sample"] == 40
    assert r["reserve_bytes"] is not None and r["explicit_limit"] is False


def test_a_rank_stopped_by_fail_fast_writes_what_it_held_once(hooks):
    fake, run = hooks
    oom_record.note_step(3, 64)
    assert oom.record_stopped("rank 1 (host h) failed (OutOfMemoryError: ...)")
    r = json.loads((run / "oom" / "rank-0.json").read_text())
    assert r["kind"] == "stopped" and r["units"] == {"samples": 64, "elements": 64} and r["peak_bytes"] == 4 * GiB
    page = pm.postmortem([r])
    assert page["entries"] == [] and [p["rank"] for p in page["stopped"]] == [0]
    # its own out-of-memory error replaces it, counted as the first; then nothing replaces that
    fake.observers[0](0, 2 * GiB, 16 * GiB, 300 * MiB)
    r = json.loads((run / "oom" / "rank-0.json").read_text())
    assert r["kind"] == "oom" and r["count"] == 1 and "first" not in r
    assert oom.record_stopped("rank 1 failed") is None
    assert json.loads((run / "oom" / "rank-0.json").read_text())["kind"] == "oom"


def test_a_rank_that_ends_on_another_error_writes_what_it_held(hooks, capsys):
    import sys

    _, run = hooks
    try:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:31106")
    except RuntimeError:
        sys.excepthook(*sys.exc_info())
    r = json.loads((run / "oom" / "rank-0.json").read_text())
    assert r["kind"] == "stopped" and "Connection closed by peer" in r["error"]
    assert "Connection closed" in capsys.readouterr().err  # the user's traceback still printed
