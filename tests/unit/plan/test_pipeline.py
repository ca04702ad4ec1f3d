"""Pipeline planner: rank -> stage, per-stage limits, explicit stages, CPU mode, every does-not-fit error."""
import argparse
import json
import math

import pytest

from distmem.costs import LayerCost
from distmem.discover.gpus import Inventory, fleet_inventory
from distmem.errors import ConfigError, DoesNotFitError
from distmem.plan import make_plan
from distmem.plan.types import DEFAULT_OVERHEAD_BYTES
from distmem.plan.partition import partition_pipeline
from distmem import cli
from distmem.plan.budget import ceil_mib
from distmem.plan.strategies.pipeline import stage_of_rank
from distmem.discover.identity import Topology
from distmem.units import GiB, MiB

CPU = Inventory([], "none")


def topo(size, local_size, rank=0):
    return Topology(rank=rank, size=size, local_rank=rank % local_size, local_size=local_size, host="n")


def layers(n=16):
    return [LayerCost(f"l{k}", (k % 5 + 1) * 100 * MiB, (8 - k % 7) * 150 * MiB, 20 * MiB) for k in range(n)]


def test_stage_is_local_rank_with_one_pipeline_per_node():
    plan = make_plan("pipeline", topo(8, 4), fleet_inventory("4x80GiB"), layers=layers())
    assert [a.stage for a in plan.allocations] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [a.replica for a in plan.allocations] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert plan.extras["pipeline"]["num_stages"] == 4 and plan.extras["pipeline"]["replicas"] == 2


def test_rank_orders():
    assert [stage_of_rank(r, 8, 2) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [stage_of_rank(r, 8, 2, "replica") for r in range(8)] == [(0, 0), (0, 1), (0, 2), (0, 3),
                                                                      (1, 0), (1, 1), (1, 2), (1, 3)]
    with pytest.raises(ConfigError, match="do not divide into pipelines of 3"):
        stage_of_rank(0, 8, 3)


def test_limits_are_demand_plus_headroom_in_whole_mib():
    costs = layers()
    plan = make_plan("pipeline", topo(4, 4), fleet_inventory("4x80GiB"), layers=costs, num_micro_batches=6,
                     headroom="10%")
    # six micro-batches accumulate: each one's gradients until added (Adam's share of the state; the
    # largest layer's outside TensorFlow)
    part = partition_pipeline(costs, 4, num_micro_batches=6, schedule="1f1b", accumulate=("none", 0.25))
    for a in plan.allocations:
        demand = part.stages[a.stage].total_bytes
        assert a.demand_bytes == demand
        assert a.limit_bytes == math.ceil(demand * 1.1 / MiB) * MiB and a.limit_bytes % MiB == 0
        assert a.mode == "limit" and a.devices[0].enforce and a.devices[0].growth
        assert a.breakdown["planned_bytes"] == a.limit_bytes
    assert plan.extras["pipeline"]["partition"]["max_bytes"] == part.max_bytes
    assert plan.extras["pipeline"]["partition"]["bounds"] == [list(b) for b in part.bounds]


def test_default_headroom_is_five_percent():
    assert ceil_mib(100 * MiB * 1.05) == 105 * MiB
    assert ceil_mib(100 * MiB + 1) == 101 * MiB


def test_first_stage_holds_most_under_1f1b_and_all_under_gpipe():
    costs = [LayerCost(f"l{k}", 0, 100 * MiB, 0) for k in range(8)]
    one = make_plan("pipeline", topo(4, 4), CPU, layers=costs, num_micro_batches=8, schedule="1f1b")
    assert [s["in_flight"] for s in one.extras["pipeline"]["stages"]] == [4, 3, 2, 1]
    gp = make_plan("pipeline", topo(4, 4), CPU, layers=costs, num_micro_batches=8, schedule="gpipe")
    assert [s["in_flight"] for s in gp.extras["pipeline"]["stages"]] == [8, 8, 8, 8]


def test_explicit_stages():
    plan = make_plan("pipeline", topo(4, 4), fleet_inventory("4x16GiB"), stages=["9GiB", "7GiB", "7GiB", "5GiB"],
                     headroom=0)
    assert [a.limit_bytes for a in plan.allocations] == [9 * GiB, 7 * GiB, 7 * GiB, 5 * GiB]
    assert [a.stage for a in plan.allocations] == [0, 1, 2, 3]


def test_explicit_stage_too_large_names_stage_and_share():
    share = 16 * GiB - 256 * MiB - DEFAULT_OVERHEAD_BYTES
    with pytest.raises(DoesNotFitError) as err:
        make_plan("pipeline", topo(4, 4), fleet_inventory("4x16GiB"), stages=["9GiB", "7GiB", "17GiB", "5GiB"])
    msg = str(err.value)
    assert "stage 2 needs 17.0 GiB" in msg and f"offers {share / GiB:.1f} GiB after the reserve" in msg
    # issue 18: bytes the user stated have no schedule or recomputation to change: remedies that apply
    assert "a GPU of at least 18.0 GiB" in msg and "split stage 2 into 2 stages" in msg
    assert "8.5GiB,8.5GiB" in msg and "headroom is not the cause" in msg
    assert "recompute" not in msg and "micro-batches" not in msg


def test_explicit_stage_headroom_is_shown_and_zero_keeps_the_bytes():
    with_head = make_plan("pipeline", topo(2, 2), fleet_inventory("2x16GiB"), stages=["9GiB", "7GiB"], headroom=0.1)
    a = with_head.allocations[0]
    assert a.limit_bytes > 9 * GiB and a.breakdown["headroom_bytes"] == a.limit_bytes - 9 * GiB
    assert "hard limit 9.9 GiB (9.0 GiB + 10% headroom)" in a.describe()
    assert with_head.extras["pipeline"]["headroom"] == 0.1
    exact = make_plan("pipeline", topo(2, 2), fleet_inventory("2x16GiB"), stages=["9GiB", "7GiB"], headroom=0)
    assert [x.limit_bytes for x in exact.allocations] == [9 * GiB, 7 * GiB]
    assert "headroom" not in exact.allocations[0].describe()


def test_stage_does_not_fit_error_carries_breakdown_and_remedies():
    costs = [LayerCost(f"l{k}", GiB, 2 * GiB, 0) for k in range(8)]
    with pytest.raises(DoesNotFitError) as err:
        make_plan("pipeline", topo(4, 4), fleet_inventory("4x16GiB"), layers=costs, num_micro_batches=8,
                  schedule="gpipe")
    msg = str(err.value)
    # every stage: 2 layers -> 2 GiB state, 8 x 4 GiB activations, and one layer's gradients (a
    # quarter of its 1 GiB state) made before they are added to the accumulated ones
    assert "stage 0 needs 34.2 GiB" in msg
    assert "weights+grads+optimizer 2.0 GiB, activations 8 x 4.0 GiB, backward gradients in flight 256.0 MiB" in msg
    for remedy in ("more stages", "fewer micro-batches in flight", "schedule='1f1b'", "recompute=True"):
        assert remedy in msg


def test_shared_gpu_uses_equal_share():
    # 8 ranks on 4 GPUs: two stages per GPU, each gets (16 GiB - reserve - 2 x overhead) / 2
    costs = [LayerCost(f"l{k}", GiB, 0, 0) for k in range(8)]
    share = (16 * GiB - 256 * MiB - 2 * DEFAULT_OVERHEAD_BYTES) // 2 // MiB * MiB
    plan = make_plan("pipeline", topo(8, 8), fleet_inventory("4x16GiB"), layers=costs, num_stages=8)
    assert all(a.devices[0].shared_by == 2 and a.limit_bytes <= share for a in plan.allocations)
    big = [LayerCost(f"l{k}", 8 * GiB, 0, 0) for k in range(8)]
    with pytest.raises(DoesNotFitError, match="shared by 2 ranks"):
        make_plan("pipeline", topo(8, 8), fleet_inventory("4x16GiB"), layers=big, num_stages=8)


def test_gpu_that_cannot_hold_its_ranks_raises():
    with pytest.raises(DoesNotFitError, match="cannot hold 8 ranks"):
        make_plan("pipeline", topo(8, 8), fleet_inventory("1x4GiB"), stages=["1MiB"] * 8)


def test_headroom_is_cut_to_fit_with_a_warning():
    share = 16 * GiB - 256 * MiB - DEFAULT_OVERHEAD_BYTES
    plan = make_plan("pipeline", topo(1, 1), fleet_inventory("1x16GiB"), stages=[share - MiB])
    assert plan.allocations[0].limit_bytes == share
    assert any("headroom cut" in w for w in plan.warnings)


def test_cpu_mode_records_demand():
    plan = make_plan("pipeline", topo(4, 4), CPU, layers=layers(), num_micro_batches=4)
    for a in plan.allocations:
        assert a.mode == "cpu" and not a.devices and a.limit_bytes is None
        assert a.demand_bytes > 0 and a.stage is not None
        assert a.breakdown["state_bytes"] > 0 and a.breakdown["planned_bytes"] >= a.demand_bytes


def test_growth_mode_only_budgets():
    plan = make_plan("pipeline", topo(2, 2), fleet_inventory("2x80GiB"), stages=["1GiB", "1GiB"], memory="growth")
    assert all(a.mode == "growth" and not a.devices[0].enforce for a in plan.allocations)


@pytest.mark.parametrize("kwargs,needle", [
    ({}, "exactly one of"),
    ({"stages": ["1GiB"], "layers": [LayerCost("a", 1, 1)]}, "exactly one of"),
    ({"stages": []}, "is empty"),
    ({"stages": ["1GiB", "1GiB"], "num_stages": 3}, "lists 2 stage"),
    ({"stages": ["1GiB", "1GiB", "1GiB"]}, "do not divide"),
    ({"layers": [LayerCost("a", 1, 1)], "num_stages": 4}, "cannot fill 4 parts"),
    ({"layers": [LayerCost(f"l{k}", 1, 1) for k in range(4)], "schedule": "zb"}, "schedule='zb'"),
    ({"layers": [LayerCost(f"l{k}", 1, 1) for k in range(4)], "num_micro_batches": 0}, "num_micro_batches=0: give a whole number"),
    ({"stages": ["0"]}, "at least 1 MiB"),
    ({"stages": ["4", "4", "4", "4"]}, "the number of stages is num_stages="),
])
def test_bad_input(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        make_plan("pipeline", topo(4, 4), fleet_inventory("4x16GiB"), **kwargs)


def test_every_rank_computes_the_same_plan():
    prints = {make_plan("pipeline", topo(8, 4, rank=r), fleet_inventory("4x80GiB"), layers=layers()).fingerprint()
              for r in range(8)}
    assert len(prints) == 1


def test_plan_serialises_to_json():
    plan = make_plan("pipeline", topo(4, 4), fleet_inventory("4x80GiB"), layers=layers(), recompute=True)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["extras"]["pipeline"]["recompute"] is True and len(d["extras"]["pipeline"]["partition"]["parts"]) == 4


def test_model_without_estimator_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "distmem.estimate", None)
    with pytest.raises(ConfigError, match="layers="):
        make_plan("pipeline", topo(2, 2), CPU, model=object())


def test_cli_options(tmp_path, capsys):
    path = tmp_path / "layers.json"
    path.write_text(json.dumps([l.to_dict() for l in layers(8)]))
    assert cli.main(["plan", "--gpus", "2x80GiB", "--ranks", "2", "--strategy", "pipeline", "--layers", str(path),
                     "--num-stages", "2", "--num-micro-batches", "4", "--schedule", "gpipe", "--recompute",
                     "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    pipe = plan["extras"]["pipeline"]
    assert (pipe["num_stages"], pipe["schedule"], pipe["recompute"], pipe["num_micro_batches"]) == (2, "gpipe", True, 4)
    assert [a["stage"] for a in plan["allocations"]] == [0, 1]
    assert cli.main(["plan", "--gpus", "2x80GiB", "--ranks", "2", "--strategy", "pipeline", "--stages", "3GiB,2GiB",
                     "--json"]) == 0
    assert [s["demand_bytes"] for s in json.loads(capsys.readouterr().out)["extras"]["pipeline"]["stages"]] == \
        [3 * GiB, 2 * GiB]
    assert cli.main(["plan", "--gpus", "2x80GiB", "--ranks", "2", "--strategy", "pipeline"]) == 1
    assert "needs exactly one of stages=" in capsys.readouterr().err


def test_model_goes_through_the_estimator(monkeypatch):
    import sys
    import types

    seen = {}

    class Estimate:
        def layer_costs(self):
            return [LayerCost(f"l{k}", MiB, MiB, MiB) for k in range(4)]

    class FakeKerasModel:
        layers = []

    def estimate(model, **kwargs):
        seen.update(kwargs, model=model)
        return Estimate()

    fake = types.ModuleType("distmem.estimate")
    fake.estimate = estimate
    monkeypatch.setitem(sys.modules, "distmem.estimate", fake)
    model = FakeKerasModel()
    plan = make_plan("pipeline", topo(2, 2), CPU, model=model, micro_batch_size=8, optimizer="adam")
    assert seen == {"batch_size": 8, "optimizer": "adam", "model": model, "input_shape": None, "method": "auto",
                    "measurement": None}
    assert plan.extras["pipeline"]["source"] == "model"
    assert sum(len(p["layers"]) for p in plan.extras["pipeline"]["partition"]["parts"]) == 4


def test_the_stages_own_exchange_is_added_to_every_computed_stage():
    """exchange_bytes: what the stages' activation exchange holds (examples/pipeline.py's all-gather
    input and output) is in every stage's demand and its breakdown; stated stages= already hold
    their whole bytes, so the two together are refused rather than one silently ignored."""
    costs = layers()
    base = make_plan("pipeline", topo(4, 4), fleet_inventory("4x80GiB"), layers=costs, headroom="10%")
    plan = make_plan("pipeline", topo(4, 4), fleet_inventory("4x80GiB"), layers=costs, headroom="10%",
                     exchange_bytes="10MiB")
    for a, b in zip(plan.allocations, base.allocations):
        assert a.demand_bytes == b.demand_bytes + 10 * MiB
        assert a.breakdown["exchange_bytes"] == 10 * MiB and a.breakdown["state_bytes"] == b.breakdown["state_bytes"]
    with pytest.raises(ConfigError, match="exchange_bytes='5MiB'.*stages="):
        make_plan("pipeline", topo(2, 2), fleet_inventory("2x80GiB"), stages=["1GiB", "1GiB"], exchange_bytes="5MiB")
