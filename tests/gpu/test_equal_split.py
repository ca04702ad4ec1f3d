"""Equal split enforced on real GPUs: with two ranks per GPU (`mpirun -np 2N` over the machine's N
GPUs) each rank can allocate up to its planned share and no further - a real OOM inside its own share,
with the GPU still free - while its neighbour keeps its full share; with one rank per GPU (`-np N`)
and memory="limit" (expandable segments on) the same hard limit holds.

Tolerance: a tenant counts as having got its share when the caching allocator reserved at least
share - 32 MiB (the fill ends with 1 MiB requests in 2 MiB segments; 32 MiB leaves room for
allocator rounding) and never more than the share."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "progs"))

import launch  # noqa: E402

MiB = launch.MiB
TOL = 32 * MiB
pytestmark = pytest.mark.gpus(1)
#: The machine's GPUs (1 when there are none: the cases are then skipped by tests/gpu/conftest.py).
N = max(launch.gpu_count(), 1)
CASES = [(2 * N, {}), (N, {"EQ_MEMORY": "limit", "DISTMEM_TORCH_EXPANDABLE_SEGMENTS": "1"})]


def _facts(data, row):
    g = next(x for x in data["nvml"] if x["index"] == row["physical"])
    free, total = row["cuda_free_total"]
    return (f"[GPU {g['index']}: NVML total {g['total'] // MiB} MiB, NVML reserved {(g['reserved'] or 0) // MiB} MiB, "
            f"CUDA total {total // MiB} MiB; share {row['share'] // MiB} MiB x {row['k']}, plan overhead "
            f"{data['plan']['overhead_bytes'] // MiB} MiB, reserve {data['plan']['reserve_bytes'] // MiB} MiB; "
            f"this process after a step: NVML {(row['nvml_after_step'] or 0) // MiB} MiB, torch reserved "
            f"{row['reserved_after_step'] // MiB} MiB; plan warnings: {data['warnings']}]")


def _got_share(row, phase, data):
    got, share = row[phase]["reserved"], row["share"]
    who = f"rank {row['rank']} (tenant {row['pos']} of GPU {row['physical']}) in phase {phase}"
    assert got <= share, f"{who} reserved {got // MiB} MiB, above its share {share // MiB} MiB: the limit leaks"
    assert got >= share - TOL, (f"{who} got only {got // MiB} MiB of its {share // MiB} MiB share (short by "
                                f"{(share - got) // MiB} MiB): {row[phase]['last_oom']} {_facts(data, row)}")


@pytest.mark.parametrize("np,env", CASES, ids=[f"np{2 * N}-two-per-gpu", f"np{N}-limit-expandable"])
def test_each_rank_gets_its_share_and_no_more(np, env):
    data = launch.scenario("equal_split.py", np, env)
    rows = sorted(data["rows"], key=lambda r: r["rank"])
    assert len(rows) == np
    overhead = data["plan"]["overhead_bytes"]
    for row in rows:
        assert row["enforce"], f"rank {row['rank']}: the plan does not enforce a limit ({row})"
        assert row["k"] == np // N, f"rank {row['rank']}: {row['k']} ranks on its GPU, {np} ranks on {N} GPU(s)"
        if row["pos"] == 0:
            a = row["A"]
            assert a["ooms"] >= 1 and a["last_oom"], f"rank {row['rank']}: the fill ended without an OOM: {a}"
            _got_share(row, "A", data)
            room = a["nvml_gpu"]["free"]
            need = (row["k"] - 1) * row["share"] + 16 * MiB
            assert room >= need, (f"rank {row['rank']} stopped with only {room // MiB} MiB free on its GPU (need "
                                  f"{need // MiB} MiB for the other tenants): the OOM was the device, not its limit "
                                  f"{_facts(data, row)}")
            assert a["nvml_process"] <= row["share"] + overhead, (
                f"rank {row['rank']}: NVML shows {a['nvml_process'] // MiB} MiB for the process, above share + "
                f"overhead = {(row['share'] + overhead) // MiB} MiB {_facts(data, row)}")
        else:
            _got_share(row, "B", data)
        _got_share(row, "C", data)
    launch.evidence(f"equal-split-np{np}", {
        "env": env, "warnings": data["warnings"],
        "rows": [{k: row.get(k) for k in ("rank", "pos", "physical", "share", "k", "nvml_after_step",
                                          "reserved_after_step", "cuda_free_total", "expandable")}
                 | {p: {x: row[p][x] for x in ("reserved", "ooms", "seconds", "nvml_process", "last_oom")
                        if x in row[p]} for p in ("A", "B", "C") if p in row} for row in rows],
        "nvml": data["nvml"]})


def test_limit_holds_with_expandable_segments():
    data = launch.scenario("equal_split.py", *CASES[1])
    flags = [r["expandable"] for r in data["rows"]]
    if any(f is None for f in flags):
        pytest.skip(f"this torch's memory_snapshot() does not say whether segments are expandable: {flags}")
    assert all(flags), f"DISTMEM_TORCH_EXPANDABLE_SEGMENTS=1 did not turn expandable segments on: {flags}"
