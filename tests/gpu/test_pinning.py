"""Pinning on real GPUs, judged by NVML (pynvml directly) and by the GPU's UUID as torch reports it:
under `mpirun -np 2` and `-np 4` over the machine's GPUs (one GPU: all ranks share it) every rank's
process appears on its planned GPU and on no other (no stray context on GPU 0), and nothing before
distmem.init() started CUDA. CUDA started before init() is refused with TooLateError where the
configuration differs - on another GPU (two GPUs), or with the allocator already holding more than the
planned limit (one GPU) - and accepted on the planned GPU."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "progs"))

import launch  # noqa: E402

pytestmark = pytest.mark.gpus(1)
PROGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "progs")


@pytest.mark.parametrize("np", [2, 4])
def test_every_rank_is_on_its_planned_gpu_and_no_other(np):
    data = launch.scenario("pin_report.py", np)
    ngpu = len(data["nvml"])
    rows = sorted(data["rows"], key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == list(range(np))
    for r in rows:
        who = f"rank {r['rank']} (pid {r['pid']}, local rank {r['local_rank']})"
        assert r["before"] == {}, (f"{who}: NVML lists it on GPU(s) {sorted(r['before'])} before distmem.init(): "
                                   "the launcher or MPI started CUDA; OMPI_MCA_pml=ob1 keeps UCX off the GPUs")
        want = r["planned_nvml_index"]
        assert want is not None, f"{who}: the plan names no NVML GPU (source {data['plan']['source']})"
        assert r["planned_index"] == r["local_rank"] % ngpu, f"{who}: planned cuda:{r['planned_index']}"
        assert r["physical_nvml_index"] == want, (f"{who}: torch's cuda:{r['planned_index']} is NVML GPU "
                                                  f"{r['physical_nvml_index']} by UUID, the plan meant {want}")
        for when in ("where", "after_report"):
            assert sorted(int(i) for i in r[when]) == [want], (
                f"{who}: NVML lists it on GPU(s) {sorted(r[when])} ({when}), planned only GPU {want}: a stray "
                f"context; NVML per GPU: {[{'gpu': g['index'], 'pids': g['procs']} for g in data['nvml']]}")
    job = {r["pid"]: r for r in rows}
    for g in data["nvml"]:
        ours = sorted(job[int(p)]["rank"] for p in g["procs"] if int(p) in job)
        planned = sorted(r["rank"] for r in rows if r["planned_nvml_index"] == g["index"])
        assert ours == planned, f"GPU {g['index']} holds ranks {ours}, planned {planned}"
    launch.evidence(f"pinning-np{np}", {"placement": {r["rank"]: r["where"] for r in rows},
                                         "init_s": [r["init_s"] for r in rows]})


def _too_late(*args):
    rc, out = launch.run_python([os.path.join(PROGS, "too_late.py"), *map(str, args)], timeout=120)
    lines = [ln for ln in out.splitlines() if ln.startswith("TOO_LATE ")]
    assert rc == 0 and lines, f"too_late.py {' '.join(map(str, args))} exited {rc}:\n{out[-4000:]}"
    return json.loads(lines[-1][len("TOO_LATE "):])


@pytest.mark.gpus(2)
def test_cuda_started_on_another_gpu_is_too_late():
    res = _too_late(1)  # the plan gives this process GPU 0
    launch.evidence("too-late-other-gpu", res)
    assert res["error_type"] == "TooLateError", res
    for part in ("cuda:1", "planned cuda:0", "distmem.init(framework='torch')"):
        assert part in res["error"], f"{part!r} missing from: {res['error']}"
    assert sorted(res["where"]) == ["1"], f"refusing must not touch GPU 0: NVML shows {res['where']}"


def test_allocator_above_the_planned_limit_is_too_late():
    # one GPU's case: CUDA started on the planned GPU, but torch already holds 30% of it and the plan
    # limits this process to 20%: the limit cannot be applied any more
    res = _too_late(0, 0.3, "20%")
    launch.evidence("too-late-above-limit", res)
    assert res["error_type"] == "TooLateError", res
    for part in ("limit cuda:0", "the caching allocator already holds", "distmem.init(framework='torch')"):
        assert part in res["error"], f"{part!r} missing from: {res['error']}"
    assert sorted(res["where"]) == ["0"], f"NVML shows the process on {res['where']}, expected only GPU 0"


def test_cuda_started_on_the_planned_gpu_is_accepted():
    res = _too_late(0)
    launch.evidence("too-late-same-gpu", res)
    assert res["error"] is None and res["planned"] == 0, res
    assert sorted(res["where"]) == ["0"], f"NVML shows the process on {res['where']}, expected only GPU 0"
