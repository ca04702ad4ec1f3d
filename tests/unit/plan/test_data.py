import json

import pytest

from distmem.discover.gpus import fleet_inventory, Inventory
from distmem.errors import ConfigError, DoesNotFitError
from distmem.plan import make_plan
from distmem.plan.types import DEFAULT_OVERHEAD_BYTES
from distmem.discover.identity import Topology
from distmem.units import GiB, MiB


def topo(size, local_size, rank=0):
    return Topology(rank=rank, size=size, local_rank=rank % local_size, local_size=local_size, host="n")


def test_one_rank_per_gpu_grows_with_full_budget():
    plan = make_plan("data", topo(4, 4), fleet_inventory("4x16GiB"))
    assert [a.device for a in plan.allocations] == [0, 1, 2, 3]
    expected = 16 * GiB - 256 * MiB - DEFAULT_OVERHEAD_BYTES
    for a in plan.allocations:
        assert a.mode == "growth" and not a.devices[0].enforce
        assert a.limit_bytes == expected and a.devices[0].shared_by == 1


def test_shared_gpu_equal_split_formula():
    # 8 ranks on 4 GPUs: k=2 each; (total - reserve - foreign - k*overhead)/k, floored to MiB
    plan = make_plan("data", topo(8, 8), fleet_inventory("4x80GiB"), reserve="1GiB", foreign="2GiB",
                     overhead="700MiB")
    share = (80 * GiB - GiB - 2 * GiB - 2 * 700 * MiB) // 2 // MiB * MiB
    assert {a.limit_bytes for a in plan.allocations} == {share}
    assert [a.device for a in plan.allocations] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert all(a.mode == "limit" and a.devices[0].enforce and a.devices[0].shared_by == 2 for a in plan.allocations)


def test_uneven_round_robin():
    plan = make_plan("data", topo(3, 3), fleet_inventory("2x16GiB"))
    k = [a.devices[0].shared_by for a in plan.allocations]
    assert k == [2, 1, 2]
    assert plan.allocations[1].mode == "growth" and plan.allocations[0].mode == "limit"


def test_modes_and_explicit_limit():
    inv = fleet_inventory("1x16GiB")
    assert make_plan("data", topo(1, 1), inv, memory="limit").mine.devices[0].enforce
    growth = make_plan("data", topo(2, 2), inv, memory="growth")
    assert not growth.mine.devices[0].enforce and "growth" in growth.mine.notes[0]
    lim = make_plan("data", topo(2, 2), inv, limit="6GiB")
    assert lim.mine.limit_bytes == 6 * GiB and lim.mine.devices[0].enforce
    frac = make_plan("data", topo(1, 1), inv, limit=0.25)
    assert frac.mine.limit_bytes == 4 * GiB
    with pytest.raises(DoesNotFitError, match=r"limit 7.5 GiB per rank does not fit GPU 0 \(16.0 GiB\) shared by 2 ranks: at most 7.1 GiB"):
        make_plan("data", topo(2, 2), inv, limit="7.5GiB")
    with pytest.raises(ConfigError, match="memory='lots'"):
        make_plan("data", topo(1, 1), inv, memory="lots")
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        make_plan("data", topo(1, 1), inv, limit=1.5)


def test_too_many_ranks_for_a_gpu():
    with pytest.raises(DoesNotFitError, match="cannot hold 32 ranks"):
        make_plan("data", topo(32, 32), fleet_inventory("1x16GiB"))


def test_no_gpu_is_cpu_mode():
    plan = make_plan("data", topo(4, 2, rank=3), Inventory([], "none"))
    assert plan.mine.mode == "cpu" and plan.mine.devices == [] and plan.mine.limit_bytes is None
    assert plan.mine.rank == 3 and plan.mine.host == "host1" and plan.mine.local_rank == 1


def test_every_rank_computes_the_same_plan():
    inv = fleet_inventory("4x16GiB")
    prints = {make_plan("data", topo(8, 4, rank=r), inv).fingerprint() for r in range(8)}
    assert len(prints) == 1
    other = make_plan("data", topo(8, 4), inv, reserve="1GiB").fingerprint()
    assert other not in prints


def test_unknown_strategy_and_layout():
    with pytest.raises(ConfigError, match="unknown strategy 'zero'"):
        make_plan("zero", topo(1, 1), fleet_inventory("1x16GiB"))
    with pytest.raises(ConfigError, match="do not divide into hosts"):
        make_plan("data", topo(6, 4), fleet_inventory("4x16GiB"))


def test_plan_serialises():
    plan = make_plan("data", topo(2, 2), fleet_inventory("1x16GiB"))
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["allocations"][1]["limit_bytes"] == plan.allocations[1].limit_bytes
    assert "GPU 0 hard limit" in plan.allocations[1].describe()
