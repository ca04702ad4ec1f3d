"""Aggregation and every warning kind, from hand-built snapshots: each fires with its numbers when it
should and stays silent when it should not; the summary reduction equals the full aggregation."""
import random

import pytest

from distmem.report.aggregate import (GROUP_ABOVE, WARN_IMBALANCE_MIN_BYTES, Report, Snapshot, aggregate,
    allocator_pool_bytes, outside_allocator_bytes)
from distmem.report.summary import STAGE_SLOTS, reduce_locally
from distmem.units import GiB, MiB

H = "node-a"


def snap(rank, *, size=4, peak=None, current=None, limit=10 * GiB, reserved=None, nvml=None, devices=None,
         gpu_pids=None, gpu_uuids=None, proc_bytes=None, stage=None, host=H, pid=None, overhead=768 * MiB,
         fingerprint="f" * 16, enforced=True, shared_by=1):
    devices = [rank % 4] if devices is None else devices
    return Snapshot(rank=rank, size=size, local_rank=rank % 4, host=host, pid=pid or 1000 + rank,
                    framework="torch", strategy="data", devices=devices,
                    allocation={"mode": "limit", "devices": [{"index": d, "shared_by": shared_by} for d in devices]},
                    limit_bytes=limit, enforced=enforced, current_bytes=current, peak_bytes=peak,
                    reserved_bytes=reserved, nvml_bytes=nvml or {}, gpu_pids=gpu_pids or {},
                    gpu_uuids=gpu_uuids if gpu_uuids is not None else {d: f"GPU-{host}-{d}" for d in devices},
                    gpu_process_bytes=proc_bytes or {}, stage=stage, plan_fingerprint=fingerprint,
                    overhead_bytes=overhead)


def kinds(rep):
    return [f["kind"] for f in rep.findings]


def find(rep, kind):
    hits = [f for f in rep.findings if f["kind"] == kind]
    assert hits, f"no {kind!r} finding in {rep.warnings}"
    return hits


def test_quiet_job_has_no_warnings():
    rep = aggregate([snap(r, peak=5 * GiB, current=4 * GiB) for r in range(4)], 4)
    assert rep.warnings == [] and rep.findings == []
    a = rep.aggregates
    assert a["total_peak_bytes"] == 20 * GiB and a["max_peak_rank"] == 0 and a["min_headroom_bytes"] == 5 * GiB
    assert a["stage_imbalance"] == {"all": 1.0}


def test_near_limit_names_the_rank_with_its_numbers():
    rep = aggregate([snap(0, peak=5 * GiB), snap(1, peak=int(9.5 * GiB))], 2)
    (f,) = find(rep, "near_limit")
    assert f["ranks"] == [1] and f["peak_bytes"] == int(9.5 * GiB) and f["limit_bytes"] == 10 * GiB
    assert "rank 1" in f["message"] and "9.5 GiB" in f["message"] and "95%" in f["message"]
    assert "above_plan" not in kinds(rep)


def test_above_plan_is_not_also_near_limit():
    rep = aggregate([snap(0, peak=11 * GiB, enforced=False)], 1)
    (f,) = find(rep, "above_plan")
    assert f["ratio"] == pytest.approx(1.1) and "110%" in f["message"] and "not hard-limited" in f["message"]
    assert "near_limit" not in kinds(rep)


def test_many_ranks_above_plan_are_one_sentence_naming_the_worst():
    snaps = [snap(r, peak=(11 + (r == 6)) * GiB, size=10) for r in range(10)]
    rep = aggregate(snaps, 10)
    (f,) = find(rep, "above_plan")
    assert len(f["ranks"]) == 10 > GROUP_ABOVE and f["worst_rank"] == 6
    assert "10 ranks went above their plan" in f["message"] and "rank 6" in f["message"]


def test_reserved_pool_at_the_cap_is_near_limit():
    # Measured on an H200 (torch, 2 ranks per GPU, hard limit): allocated peak 88% of the limit but the
    # caching allocator's reserved pool at 99.6% - the cap torch enforces.
    s = snap(3, peak=65622525952, current=58101785088, reserved=74153197568, limit=74437361664,
             nvml={1: 74948018176}, devices=[1])
    (f,) = find(aggregate([s], 4), "near_limit")
    assert f["used_bytes"] == 74153197568 and f["ratio"] == pytest.approx(0.9962, abs=1e-4)
    assert "reserved; peak allocated 61.1 GiB" in f["message"] and "100% of its limit 69.3 GiB" in f["message"]


def test_outside_allocator_counts_only_the_planned_gpu():
    # Measured on 2 H200s: rank 1 (planned GPU 1) also put 1.1 GiB on GPU 0. That memory is the
    # shared-GPU warning's business; on its own GPU rank 1 holds 2.6 GiB for a 2.0 GiB pool.
    s1 = snap(1, size=2, devices=[1], peak=2 * GiB, current=2 * GiB, reserved=2 * GiB,
              nvml={0: 1176502272, 1: 2787115008})
    assert outside_allocator_bytes(s1) == 2787115008 - 2 * GiB
    assert "outside_allocator" not in kinds(aggregate([s1], 2))


def test_shared_gpu_from_the_owner_pid_list_names_both_ranks():
    # Rank 1 was planned on GPU 1 but runs on GPU 0 as well (the every-rank-on-GPU-0 mistake).
    s0 = snap(0, size=2, peak=GiB, nvml={0: 2 * GiB}, gpu_pids={0: [1000, 1001]},
              proc_bytes={0: {1000: 2 * GiB, 1001: 700 * MiB}})
    s1 = snap(1, size=2, peak=GiB, nvml={0: 700 * MiB}, gpu_pids={1: []})
    rep = aggregate([s0, s1], 2)
    (f,) = find(rep, "shared_gpu")
    assert f["ranks"] == [0, 1] and f["planned_ranks"] == [0] and f["ranks_on_gpu"] == [0, 1]
    assert f["bytes_by_rank"] == {"0": 2 * GiB, "1": 700 * MiB}
    assert "rank 0 alone" in f["message"] and "ranks 0, 1" in f["message"] and "700.0 MiB" in f["message"]
    assert "foreign_process" not in kinds(rep)


def test_shared_gpu_seen_from_the_intruder_side_alone():
    # The owner's pid list is empty (NVML lists nothing it can attribute); the intruder's own NVML
    # usage on a device it was not planned on still gives it away, matched by the host's UUID map.
    s0 = snap(0, size=2, peak=GiB, nvml={0: GiB})
    s1 = snap(1, size=2, peak=GiB, nvml={0: 300 * MiB, 1: GiB})
    rep = aggregate([s0, s1], 2)
    (f,) = find(rep, "shared_gpu")
    assert f["ranks"] == [0, 1] and f["gpu"] == f"GPU-{H}-0"


def test_planned_sharing_is_not_a_warning():
    snaps = [snap(r, size=2, devices=[0], peak=GiB, nvml={0: GiB}, gpu_pids={0: [1000, 1001]}, shared_by=2)
             for r in range(2)]
    assert aggregate(snaps, 2).findings == []


def test_same_ordinal_on_different_hosts_is_different_gpus():
    snaps = [snap(0, host="a", devices=[0], nvml={0: GiB}, peak=GiB), snap(1, host="b", devices=[0], nvml={0: GiB},
                                                                        peak=GiB)]
    assert "shared_gpu" not in kinds(aggregate(snaps, 2))


def test_per_rank_visible_devices_do_not_alias_ordinals():
    # Each rank sees its own GPU as ordinal 0 (CUDA_VISIBLE_DEVICES per rank): UUIDs tell them apart.
    snaps = [snap(r, devices=[0], nvml={0: GiB}, peak=GiB, gpu_uuids={0: f"GPU-{r}"}, gpu_pids={0: [1000 + r]})
             for r in range(2)]
    assert aggregate(snaps, 2).findings == []


def test_foreign_process_with_bytes():
    s0 = snap(0, size=1, peak=GiB, nvml={0: GiB}, gpu_pids={0: [1000, 4242]}, proc_bytes={0: {1000: GiB, 4242: 3 * GiB}})
    rep = aggregate([s0], 1)
    (f,) = find(rep, "foreign_process")
    assert f["pids"] == [4242] and f["foreign_bytes"] == 3 * GiB and f["ranks"] == [0]
    assert "pid 4242 (3.0 GiB)" in f["message"] and "foreign='3.0 GiB'" in f["message"]


def test_imbalance_needs_ratio_and_bytes():
    big = [snap(r, peak=(8 if r == 3 else 2) * GiB, limit=None) for r in range(4)]
    (f,) = find(aggregate(big, 4), "imbalance")
    assert f["max_rank"] == 3 and f["min_rank"] == 0 and f["ratio"] == pytest.approx(8 / 3.5)
    # The same ratio over a few MiB is noise.
    tiny = [snap(r, peak=(8 if r == 3 else 2) * MiB, limit=None) for r in range(4)]
    assert 8 * MiB - 3.5 * MiB < WARN_IMBALANCE_MIN_BYTES
    assert "imbalance" not in kinds(aggregate(tiny, 4))


def test_imbalance_is_per_pipeline_stage():
    # Stages differ by design (stage 0 holds more activations); within a stage ranks should match.
    snaps = [snap(0, stage=0, peak=8 * GiB, limit=None), snap(1, stage=0, peak=8 * GiB, limit=None),
             snap(2, stage=1, peak=2 * GiB, limit=None), snap(3, stage=1, peak=2 * GiB, limit=None)]
    rep = aggregate(snaps, 4)
    assert "imbalance" not in kinds(rep)
    assert rep.aggregates["stage_imbalance"] == {"0": 1.0, "1": 1.0}
    snaps[3] = snap(3, stage=1, peak=6 * GiB, limit=None)
    (f,) = find(aggregate(snaps, 4), "imbalance")
    assert f["stage"] == 1 and f["max_rank"] == 3 and f["ranks"] == [2, 3] and "stage 1" in f["message"]


def test_outside_allocator_uses_reserved_then_peak():
    torch_like = snap(0, size=1, peak=4 * GiB, current=3 * GiB, reserved=5 * GiB, nvml={0: 6 * GiB})
    assert allocator_pool_bytes(torch_like) == 5 * GiB and outside_allocator_bytes(torch_like) == GiB
    (f,) = find(aggregate([torch_like], 1), "outside_allocator")
    assert f["outside_bytes"] == GiB and f["assumed_bytes"] == 768 * MiB and f["suggested_overhead_bytes"] == GiB
    assert "overhead='1GiB'" in f["message"] and "reserved" in f["message"]
    # TensorFlow: no reserved figure; the BFC pool is its peak, not its current use.
    tf_like = snap(0, size=1, peak=4 * GiB, current=GiB, nvml={0: 4 * GiB + 700 * MiB})
    assert outside_allocator_bytes(tf_like) == 700 * MiB
    assert "outside_allocator" not in kinds(aggregate([tf_like], 1))


def test_missing_and_plan_mismatch_come_first():
    snaps = [snap(0, peak=GiB), snap(1, peak=GiB, fingerprint="e" * 16)]
    rep = aggregate(snaps, 3, missing=[2])
    assert kinds(rep)[:2] == ["missing", "plan_mismatch"]
    assert "rank 2 did not report" in rep.warnings[0]


def test_snapshot_and_report_round_trip_through_json_types():
    s = snap(0, peak=GiB, nvml={0: GiB}, gpu_pids={0: [1000, 5]}, proc_bytes={0: {1000: GiB, 5: None}})
    back = Snapshot.from_dict(s.to_dict())
    assert back == s
    rep = aggregate([s], 1)
    import json

    again = Report.from_dict(json.loads(json.dumps(rep.to_dict())))
    assert again.findings == json.loads(json.dumps(rep.findings)) and again.ranks == [s]


# ---- the summary reduction against the full aggregation --------------------------------------------

_COMMON = ("ranks_reporting", "ranks_missing", "total_current_bytes", "total_peak_bytes", "max_peak_bytes",
           "min_peak_bytes", "mean_peak_bytes", "imbalance", "max_peak_rank", "total_limit_bytes",
           "min_headroom_bytes", "min_headroom_rank", "total_nvml_bytes", "stage_imbalance")


def _random_job(seed, n):
    rng = random.Random(seed)
    out = []
    for r in range(n):
        peak = rng.choice([None, rng.randrange(0, 12 * GiB, MiB), 6 * GiB])  # ties on purpose
        out.append(snap(r, size=n, peak=peak, current=None if peak is None else peak // 2,
                        limit=rng.choice([None, 10 * GiB]), stage=rng.choice([None, None, 0, 1, 40]),
                        nvml=rng.choice([{}, {r % 4: rng.randrange(GiB, 14 * GiB, MiB)}]),
                        reserved=rng.choice([None, rng.randrange(0, 13 * GiB, MiB)])))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_summary_reduction_equals_full_aggregation(seed):
    snaps = _random_job(seed, 1 + seed * 3)
    full = aggregate(snaps, len(snaps))
    summ = reduce_locally(snaps, len(snaps))
    for key in _COMMON:
        if key == "stage_imbalance" and any((s.stage or 0) >= STAGE_SLOTS - 1 for s in snaps):
            continue  # deep stages share the last slot in the summary (documented)
        assert summ.aggregates.get(key) == full.aggregates.get(key), key
    if not any((s.stage or 0) >= STAGE_SLOTS - 1 for s in snaps):
        assert set(summ.kinds()) - {"foreign_process"} == set(full.kinds()) - {"foreign_process"}


def test_summary_warnings_name_the_worst_rank_with_numbers():
    snaps = [snap(r, peak=(12 if r == 2 else 11) * GiB) for r in range(4)]
    (f,) = [f for f in reduce_locally(snaps, 4).findings if f["kind"] == "above_plan"]
    assert f["worst_rank"] == 2 and f["count"] == 4 and f["used_bytes"] == 12 * GiB and f["limit_bytes"] == 10 * GiB


def test_summary_names_intruder_and_owner():
    s0 = snap(0, size=2, peak=GiB, nvml={0: 2 * GiB}, gpu_pids={0: [1000, 1001]})
    s1 = snap(1, size=2, peak=GiB, nvml={0: 700 * MiB}, gpu_pids={1: []})
    (f,) = [f for f in reduce_locally([s0, s1], 2).findings if f["kind"] == "shared_gpu"]
    assert f["ranks"] == [0, 1] and f["intruder_rank"] == 1 and f["owner_rank"] == 0 and f["gpu"] == 0


def test_summary_plan_mismatch_names_two_differing_ranks():
    snaps = [snap(r, peak=GiB, fingerprint=("a" if r == 2 else "b") * 16) for r in range(4)]
    (f,) = [f for f in reduce_locally(snaps, 4).findings if f["kind"] == "plan_mismatch"]
    assert 2 in f["ranks"] and len(f["ranks"]) == 2
    assert "plan_mismatch" not in reduce_locally([snap(r, fingerprint="") for r in range(2)], 2).kinds()


def test_no_headroom_where_no_peak_is_known():
    """Ranks with a limit but no allocator figures (torch on a CPU): no "smallest headroom" made of
    the whole limit, in the full and the summary path alike, and host peaks are unknown, not 0."""
    from distmem.report.sinks.table import table

    snaps = [snap(r, size=2, peak=None, current=None) for r in range(2)]
    for rep in (aggregate(snaps, 2), reduce_locally(snaps, 2)):
        assert rep.aggregates.get("total_limit_bytes") == 20 * GiB
        assert "min_headroom_bytes" not in rep.aggregates, rep.aggregates
        assert "smallest headroom" not in table(rep)
    hosts = aggregate(snaps, 2).aggregates["hosts"]
    assert all(h["peak_bytes"] is None and h["max_peak_bytes"] is None for h in hosts.values())
    # One rank with a peak: the headroom is that rank's, not the other's whole limit.
    mixed = [snap(0, size=2, peak=None), snap(1, size=2, peak=7 * GiB)]
    for rep in (aggregate(mixed, 2), reduce_locally(mixed, 2)):
        assert rep.aggregates["min_headroom_bytes"] == 3 * GiB and rep.aggregates["min_headroom_rank"] == 1


@pytest.mark.parametrize("path", ["full", "summary"])
def test_a_limit_made_from_its_demand_warns_only_once_the_demand_is_passed(path):
    """Issue 35: a plan whose limit is its demand + 10% headroom put a rank that used exactly its
    demand at 91% of the limit, above the 90% warning: examples warned about their own correct
    plan. Where the allocation says its demand, "near the limit" starts above that demand (and above
    90%), on both report paths; without a demand (an equal split) 90% stays the rule."""
    def job(peaks, demand):
        out = []
        for r, p in enumerate(peaks):
            s = snap(r, size=len(peaks), peak=p, limit=11 * GiB)
            if demand is not None:
                s.allocation["demand_bytes"] = demand
            out.append(s)
        return out

    build = aggregate if path == "full" else reduce_locally
    within = build(job([10 * GiB, int(9.95 * GiB)], 10 * GiB), 2)
    assert "near_limit" not in within.kinds(), within.warnings
    past = build(job([int(10.2 * GiB), 5 * GiB], 10 * GiB), 2)
    assert "near_limit" in past.kinds() and "rank 0" in past.warnings[0]
    split = build(job([10 * GiB, 5 * GiB], None), 2)
    assert "near_limit" in split.kinds()  # an equal split's limit is what the GPU offers: 90% warns
