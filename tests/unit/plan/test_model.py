"""Model-parallel planner: devices per rank, per-device limits, placement map, does-not-fit errors."""
import math

import pytest

from distmem.costs import LayerCost
from distmem.discover.gpus import Inventory, fleet_inventory
from distmem.errors import ConfigError, DoesNotFitError
from distmem.plan import make_plan
from distmem.plan.partition import partition_model
from distmem.discover.identity import Topology
from distmem.units import GiB, MiB

CPU = Inventory([], "none")


def topo(size, local_size, rank=0):
    return Topology(rank=rank, size=size, local_rank=rank % local_size, local_size=local_size, host="n")


def layers(n=12):
    return [LayerCost(f"l{k}", (k % 4 + 1) * 256 * MiB, (6 - k % 5) * 128 * MiB, (k % 3 + 1) * 8 * MiB)
            for k in range(n)]


def test_default_gpus_per_rank_and_device_ownership():
    plan = make_plan("model", topo(2, 2), fleet_inventory("4x80GiB"), layers=layers())
    assert plan.extras["model"]["gpus_per_rank"] == 2
    assert [[d.index for d in a.devices] for a in plan.allocations] == [[0, 1], [2, 3]]
    assert [d.label for d in plan.allocations[1].devices] == ["group 0", "group 1"]


def test_per_device_limits_follow_the_groups():
    costs = layers()
    plan = make_plan("model", topo(1, 1), fleet_inventory("4x80GiB"), layers=costs, headroom="5%")
    part = partition_model(costs, 4)
    got = [d.planned_bytes for d in plan.mine.devices]
    assert got == [math.ceil(s.total_bytes * 1.05 / MiB) * MiB for s in part.stages]
    assert all(d.enforce for d in plan.mine.devices) and plan.mine.mode == "limit"
    assert plan.mine.demand_bytes == sum(s.total_bytes for s in part.stages)
    groups = plan.extras["model"]["groups"]
    assert [g["demand_bytes"] for g in groups] == [s.total_bytes for s in part.stages]


def test_placement_map_covers_every_layer_in_order():
    costs = layers()
    plan = make_plan("model", topo(1, 1), fleet_inventory("3x80GiB"), layers=costs)
    placement = plan.extras["model"]["placement"]
    assert list(placement) == [l.name for l in costs]
    devices = list(placement.values())
    assert devices[0] == "/GPU:0" and devices[-1] == "/GPU:2"
    assert devices == sorted(devices)  # contiguous groups


def test_cpu_mode_uses_logical_cpu_devices():
    plan = make_plan("model", topo(2, 2), CPU, layers=layers(), gpus_per_rank=3)
    assert plan.extras["cpu_logical_devices"] == 3
    assert set(plan.extras["model"]["placement"].values()) == {"/CPU:0", "/CPU:1", "/CPU:2"}
    assert all(a.mode == "cpu" and not a.devices and a.demand_bytes > 0 for a in plan.allocations)
    assert plan.mine.breakdown["planned_bytes"] >= plan.mine.demand_bytes
    single = make_plan("model", topo(1, 1), CPU, layers=layers())
    assert "cpu_logical_devices" not in single.extras and set(single.extras["model"]["placement"].values()) == {"/CPU:0"}


def test_too_many_gpus_per_rank():
    with pytest.raises(DoesNotFitError, match=r"2 ranks per host x 3 GPUs per rank need 6 GPUs but the host "
                                              r"shows 4; use gpus_per_rank=2"):
        make_plan("model", topo(2, 2), fleet_inventory("4x80GiB"), layers=layers(), gpus_per_rank=3)


def test_fewer_gpus_than_ranks():
    with pytest.raises(DoesNotFitError, match="run at most 2 rank"):
        make_plan("model", topo(4, 4), fleet_inventory("2x80GiB"), layers=layers())


def test_group_does_not_fit():
    big = [LayerCost(f"l{k}", 7 * GiB, GiB, MiB) for k in range(4)]
    with pytest.raises(DoesNotFitError) as err:
        make_plan("model", topo(1, 1), fleet_inventory("2x16GiB"), layers=big)
    msg = str(err.value)
    assert "layer group 0 (l0..l1, 2 layers) needs 16.0 GiB" in msg
    assert "weights+grads+optimizer 14.0 GiB, activations 2.0 GiB" in msg
    assert "gpus_per_rank" in msg and "after the reserve" in msg


@pytest.mark.parametrize("kwargs,needle", [
    ({}, "exactly one of"),
    ({"layers": [LayerCost("a", 1, 1)], "model": "keras:X"}, "exactly one of"),
    ({"layers": [LayerCost("a", 1, 1)], "gpus_per_rank": 0}, "at least 1"),
    ({"layers": [LayerCost("a", 1, 1)], "gpus_per_rank": 2}, "cannot fill 2 parts"),
])
def test_bad_input(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        make_plan("model", topo(1, 1), fleet_inventory("2x80GiB"), **kwargs)


def test_same_plan_on_every_rank():
    prints = {make_plan("model", topo(2, 2, rank=r), fleet_inventory("4x80GiB"), layers=layers()).fingerprint()
              for r in range(2)}
    assert len(prints) == 1


def test_framework_option_is_accepted():
    # distmem.init passes framework= to the model planner
    plan = make_plan("model", topo(1, 1), CPU, layers=layers(), framework="tensorflow")
    assert plan.options["framework"] == "tensorflow"


def test_a_group_counts_its_backward_in_flight_as_a_pipeline_stage_does():
    """Issue 35: examples/model_parallel.py peaked above its plan on every rank. A model-parallel
    device runs the backward of its layers as a pipeline stage does: the gradient it received for
    its output, the busiest layer's output and input gradients, and what that layer's backward step
    allocates besides (``backward_bytes``: Keras's optimizer updates run beside the backward). The
    group's demand counts them, by the stage's rule (partition.backward_transient)."""
    from distmem.plan.partition import backward_transient

    rows = [LayerCost(f"l{k}", 64 * MiB, 8 * MiB, 4 * MiB, backward_bytes=(32 if k == 1 else 0) * MiB)
            for k in range(4)]
    plan = make_plan("model", topo(1, 1), fleet_inventory("2x80GiB"), layers=rows, headroom=0)
    groups = plan.extras["model"]["groups"]
    bounds = [(0, 2), (2, 4)]
    assert [(g["first_layer"], g["last_layer"]) for g in groups] == [("l0", "l1"), ("l2", "l3")]
    for g, (i, j) in zip(groups, bounds):
        assert g["transient_bytes"] == backward_transient(rows, i, j) > 0
        assert g["demand_bytes"] == 2 * 72 * MiB + g["transient_bytes"] + (4 * MiB if i else 0)
    # the first group: its output's gradient (4 MiB) held, at l1 its output and input gradients
    # (4 + 4 MiB) and the 32 MiB its step allocates
    assert groups[0]["transient_bytes"] == (4 + 4 + 4 + 32) * MiB
    assert plan.mine.breakdown["transient_bytes"] == sum(g["transient_bytes"] for g in groups)
    assert plan.mine.demand_bytes == sum(g["demand_bytes"] for g in groups)
