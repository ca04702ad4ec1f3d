"""The expected-placement helper against the launchers' documented examples (pure; no cluster needed).

If these were wrong, the launch tests would compare distmem with the wrong answer.
"""
from __future__ import annotations

import uuid

import pytest

from expect import (GiB, MiB, compare, expected, fleet_uuid, map_node, map_slot, parse_fleet_spec, share_bytes,
                    slurm_block, slurm_cyclic, torchrun_hosts)


def test_open_mpi_mappings():
    # Open MPI's mpirun(1) examples: --map-by slot fills a host's slots first, --map-by node round robin.
    assert map_slot("a:2,b:2") == ["a", "a", "b", "b"]
    assert map_node("a:2,b:2") == ["a", "b", "a", "b"]
    assert map_node("a:3,b:1") == ["a", "b", "a", "a"]  # b is full after one rank
    assert map_slot("a:4,b:2") == ["a"] * 4 + ["b"] * 2


def test_slurm_and_torchrun_mappings():
    assert slurm_block(["n1", "n2"], 2) == ["n1", "n1", "n2", "n2"]
    assert slurm_cyclic(["n1", "n2"], 2) == ["n1", "n2", "n1", "n2"]
    assert torchrun_hosts({1: "a", 0: "b"}, 2) == ["b", "b", "a", "a"]


def test_share_formula():
    # 16 GiB, one rank: 16384 - 256 - 768 MiB; two ranks: (16384 - 256 - 1536) / 2 MiB.
    assert share_bytes(16 * GiB, 1) == 15360 * MiB
    assert share_bytes(16 * GiB, 2) == 7296 * MiB
    assert share_bytes(80 * GiB, 2) == (81920 - 256 - 1536) // 2 * MiB
    assert share_bytes(16 * GiB + 3, 3) % MiB == 0


def test_fleet_uuid_and_spec():
    assert fleet_uuid("hosta", 1) == "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, "distmem-fleet://hosta/1"))
    assert fleet_uuid("hosta", 0) != fleet_uuid("hostb", 0)
    per = parse_fleet_spec("hosta=2x80GiB;*=1x16GiB", ["hosta", "hostb"])
    assert per == {"hosta": [80 * GiB, 80 * GiB], "hostb": [16 * GiB]}
    assert parse_fleet_spec("2x16GiB", ["x", "y"]) == {"x": [16 * GiB] * 2, "y": [16 * GiB] * 2}


def test_map_by_node_local_ranks_and_gpus():
    want = expected(map_node("a:2,b:2"), parse_fleet_spec("2x16GiB", ["a", "b"]))
    assert [(w.host, w.local_rank, w.index) for w in want] == [("a", 0, 0), ("b", 0, 0), ("a", 1, 1), ("b", 1, 1)]
    assert all(w.shared_by == 1 and not w.enforce and w.planned_bytes == 15360 * MiB for w in want)
    assert want[2].uuid == fleet_uuid("a", 1)


def test_uneven_hosts_and_mixed_gpus():
    want = expected(map_slot("a:4,b:2"), parse_fleet_spec("a=2x80GiB;b=2x16GiB", ["a", "b"]))
    assert [w.uuid for w in want[:4]] == [fleet_uuid("a", i % 2) for i in range(4)]
    assert [(w.shared_by, w.enforce) for w in want] == [(2, True)] * 4 + [(1, False)] * 2
    assert want[0].planned_bytes == share_bytes(80 * GiB, 2) and want[4].planned_bytes == share_bytes(16 * GiB, 1)


def test_visible_devices():
    fleet = parse_fleet_spec("2x16GiB", ["a", "b"])
    # One GPU per task by CUDA_VISIBLE_DEVICES=$SLURM_LOCALID: alone on it, framework index 0.
    one = expected(slurm_cyclic(["a", "b"], 2), fleet, visible=lambda r, h, l: [l])
    assert [(w.host, w.local_rank, w.index, w.uuid, w.shared_by) for w in one] == [
        ("a", 0, 0, fleet_uuid("a", 0), 1), ("b", 0, 0, fleet_uuid("b", 0), 1),
        ("a", 1, 0, fleet_uuid("a", 1), 1), ("b", 1, 0, fleet_uuid("b", 1), 1)]
    # Every rank told GPU 0: both ranks of a host share it.
    same = expected(map_slot("a:2,b:2"), fleet, visible=lambda r, h, l: [0])
    assert [(w.index, w.shared_by, w.enforce) for w in same] == [(0, 2, True)] * 4
    assert same[1].uuid == fleet_uuid("a", 0) and same[2].uuid == fleet_uuid("b", 0)
    # GPU 1 only, seen as index 0 by the framework.
    g1 = expected(["a"], fleet, visible=lambda r, h, l: [1])
    assert (g1[0].index, g1[0].uuid) == (0, fleet_uuid("a", 1))


def _row(w, **change):
    d = {"index": w.index, "uuid": w.uuid, "shared_by": w.shared_by, "enforce": w.enforce,
         "planned_bytes": w.planned_bytes}
    row = {"rank": w.rank, "host": w.host, "hostname": w.host, "local_rank": w.local_rank, "devices": [d], "pid": 1}
    for k, v in change.items():
        (d if k in d else row)[k] = v
    return row


def test_compare_flags_every_difference():
    want = expected(map_node("a:2,b:2"), parse_fleet_spec("2x16GiB", ["a", "b"]))
    assert compare(want, [_row(w) for w in want]) == []
    got = [_row(w) for w in want]
    got[2] = _row(want[2], local_rank=0, index=0, uuid=fleet_uuid("a", 0))
    problems = compare(want, got)
    assert len(problems) == 1 and "rank 2" in problems[0] and "local_rank 0 != 1" in problems[0]
    # Two processes claiming one rank (torchrun under sbatch read as SLURM's rank 0) is named.
    dup = [_row(want[0]), _row(want[0], pid=2)] + [_row(w) for w in want[2:]]
    assert any("2 processes planned as rank 0" in p for p in compare(want, dup))
    assert any("missing [1]" in p for p in compare(want, dup))


@pytest.mark.parametrize("field,value,text", [("shared_by", 2, "shared_by 2 != 1"), ("enforce", True, "enforce"),
                                              ("planned_bytes", 7296 * MiB, "planned 7296 MiB != 15360 MiB"),
                                              ("host", "node0", "host 'node0'")])
def test_compare_names_the_field(field, value, text):
    want = expected(["a"], parse_fleet_spec("1x16GiB", ["a"]))
    problems = compare(want, [_row(want[0], **{field: value})])
    assert len(problems) == 1 and text in problems[0], problems
