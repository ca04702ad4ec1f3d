"""Sharded data parallel: strategy='sharded' gives each rank its shard's demand plus headroom, and fit
searches sharded layouts."""
import pytest

from distmem.costs import LayerCost
from distmem.discover.gpus import Inventory, fleet_inventory
from distmem.discover.identity import Topology
from distmem.errors import ConfigError, DoesNotFitError
from distmem.plan import get, make_plan, names
from distmem.plan.budget import ceil_mib
from distmem.plan.fit import solve_fit
from distmem.plan.fit.costs import LayerListCosts
from distmem.plan.wrappers import ModelState, Wrapper, rank_peak
from distmem.units import GiB, MiB


def topo(size, local_size, rank=0):
    return Topology(rank=rank, size=size, local_rank=rank % local_size, local_size=local_size, host="n")


def layers(n=8, state=400 * MiB, act=200 * MiB):
    return [LayerCost(f"l{k}", state, act, 20 * MiB) for k in range(n)]


def test_registered():
    assert "sharded" in names() and get("sharded").derives_limits


@pytest.mark.parametrize("sharding", ["zero1", "zero2", "fsdp2", "fsdp2_keep"])
def test_each_rank_gets_its_shard_demand_plus_headroom(sharding):
    plan = make_plan("sharded", topo(8, 8), fleet_inventory("8x80GiB"), layers=layers(), batch_size=8,
                     sharding=sharding)
    c = LayerListCosts(layers(), 8)
    state = c.model_state()
    w = Wrapper("fsdp2" if sharding.startswith("fsdp2") else sharding, 8,
                reshard_after_forward=sharding != "fsdp2_keep")
    parts, phase, kept = c.peak_parts(8, False)
    want, _, _ = rank_peak(parts, phase, state, w, activation_bytes=kept)
    for a in plan.allocations:
        assert a.demand_bytes == want
        assert a.devices[0].planned_bytes == ceil_mib(want * 1.10)
        assert a.mode == "limit"
    # sharding saves what it should against the replicated state: 8 x 400 MiB of Adam's state
    replicated = c.whole_peak(8, False)[0]
    # (fsdp2_keep: this step's peak is the backward's end, every gradient made: by then every unit
    # but the first has been resharded, so the first unit's buffers alone)
    saved = {"zero1": 7 / 8 * 1600, "zero2": 7 / 8 * 2400, "fsdp2": 7 / 8 * 3200 - 4 * 100,
             "fsdp2_keep": 7 / 8 * 3200 - 2 * 100}[sharding]
    assert replicated - want == pytest.approx(saved * MiB, rel=1e-6)


def test_the_degree_divides_the_job_and_defaults_to_it():
    plan = make_plan("sharded", topo(8, 8), fleet_inventory("8x80GiB"), layers=layers(), batch_size=8, degree=4)
    assert plan.extras["sharded"]["degree"] == 4 and plan.extras["sharded"]["groups"] == 2
    with pytest.raises(ConfigError, match="degree=3 does not divide"):
        make_plan("sharded", topo(8, 8), fleet_inventory("8x80GiB"), layers=layers(), batch_size=8, degree=3)


def test_what_does_not_fit_says_by_how_much_and_what_to_do():
    with pytest.raises(DoesNotFitError, match="zero1 over 2 needs .* shard over more ranks"):
        make_plan("sharded", topo(2, 2), fleet_inventory("2x4GiB"), layers=layers(), batch_size=8, sharding="zero1")
    # the same job fits once FSDP2 shards it over 8
    make_plan("sharded", topo(8, 8), fleet_inventory("8x4GiB"), layers=layers(), batch_size=1, sharding="fsdp2")


def test_needs_one_source():
    with pytest.raises(ConfigError, match="exactly one of model="):
        make_plan("sharded", topo(2, 2), fleet_inventory("2x80GiB"))


def test_fit_finds_a_sharded_layout_where_replicas_do_not_fit():
    # 8 blocks of 1.25 GiB of Adam state on 8 GPUs of 10 GiB: the replicated state (10 GiB + activations)
    # does not fit at any micro-batch; ZeRO/FSDP2 over the 8 replicas do, and beat the pipelines
    c = {"float32": LayerListCosts(layers(8, state=5 * GiB // 4, act=64 * MiB), 1)}
    res = solve_fit(c, global_batch_size=64, gpus=fleet_inventory("8x10GiB").gpus, pipelines=[1], overhead=0)
    assert res.chosen is not None and res.chosen.layout.shard, res.table()
    assert not solve_fit(c, global_batch_size=64, gpus=fleet_inventory("8x10GiB").gpus, pipelines=[1], overhead=0,
                         shardings="none").fits
    # ties go to the layout that moves fewer bytes: ZeRO-1 before FSDP2 where both fit
    shards = [f.layout.shard for f in res.fits if f.layout.micro_batch == res.chosen.layout.micro_batch]
    assert shards == sorted(shards, key=["", "zero1", "zero2", "fsdp2_keep", "fsdp2"].index)
    assert "shard" in res.table()


def test_auto_plans_the_sharded_layout():
    c = {"float32": LayerListCosts(layers(8, state=5 * GiB // 4, act=64 * MiB), 1)}
    plan = make_plan("auto", topo(8, 8), fleet_inventory("8x10GiB"), layers=layers(8, state=5 * GiB // 4, act=64 * MiB),
                     layers_batch_size=1, global_batch_size=64, costs=c, pipelines=[1], overhead=0)
    assert plan.extras["fit"]["shard"]
