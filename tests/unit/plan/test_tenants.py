"""strategy="tenants": several named models in one process on one GPU (seed 003). Pure planner tests,
the CLI, and init() without touching a framework."""
import json
import subprocess
import sys

import pytest

from distmem.discover.gpus import Inventory, fleet_inventory
from distmem.errors import ConfigError, DoesNotFitError
from distmem.plan import make_plan
from distmem.plan.types import DEFAULT_OVERHEAD_BYTES
from distmem.plan.strategies.tenants import DEFAULT_MAX_TENANTS, MIN_TENANT_BYTES, parse_tenants, tenant_table
from distmem.discover.identity import Topology
from distmem.units import GiB, MiB

from helpers import ROOT

NO_GPU = Inventory([], "none")


def one():
    return Topology(rank=0, size=1, local_rank=0, local_size=1, host="n")


def plan(tenants, inv="1x16GiB", topo=None, **kw):
    inv = fleet_inventory(inv) if isinstance(inv, str) else inv
    return make_plan("tenants", topo or one(), inv, tenants=tenants, **kw)


def test_seed_scenario_bert_and_resnet_on_one_16gib_card():
    p = plan({"bert": "6GiB", "resnet": "8GiB"})
    assert p.device("bert") == "/GPU:0" and p.device("resnet") == "/GPU:1"
    slots = p.mine.devices
    assert [(s.index, s.label, s.planned_bytes, s.enforce, s.growth) for s in slots] == [
        (0, "bert", 6 * GiB, True, True), (0, "resnet", 8 * GiB, True, True)]
    assert p.mine.mode == "limit" and p.mine.limit_bytes == 14 * GiB
    assert p.mine.breakdown == {"bert": 6 * GiB, "resnet": 8 * GiB}
    assert [t["name"] for t in p.extras["tenants"]] == ["bert", "resnet"]
    assert all(t["enforced"] for t in p.extras["tenants"])
    assert "cpu_logical_devices" not in p.extras and not p.warnings
    assert any("1.0 GiB" in n and "unassigned" in n for n in p.mine.notes)
    assert p.fingerprint() == plan({"bert": "6GiB", "resnet": "8GiB"}).fingerprint()


def test_order_given_is_the_logical_device_order_in_every_form():
    for spec in ({"resnet": "8GiB", "bert": "6GiB"}, [("resnet", "8GiB"), ("bert", "6GiB")], "resnet=8GiB, bert=6GiB"):
        p = plan(spec)
        assert p.extras["devices"] == {"resnet": "/GPU:0", "bert": "/GPU:1"}
        assert [s.planned_bytes for s in p.mine.devices] == [8 * GiB, 6 * GiB]


def test_auto_tenants_share_what_the_sized_ones_leave():
    p = plan({"bert": "6GiB", "a": "auto", "b": None})
    capacity = 16 * GiB - 256 * MiB - DEFAULT_OVERHEAD_BYTES
    each = (capacity - 6 * GiB) // 2 // MiB * MiB
    assert [s.planned_bytes for s in p.mine.devices] == [6 * GiB, each, each]
    assert sum(s.planned_bytes for s in p.mine.devices) <= capacity


def test_percentages_and_fractions_of_the_gpu():
    p = plan({"a": "25%", "b": 0.5})
    assert [s.planned_bytes for s in p.mine.devices] == [4 * GiB, 8 * GiB]


def test_one_per_process_overhead_not_one_per_tenant():
    capacity = 16 * GiB - 256 * MiB - DEFAULT_OVERHEAD_BYTES  # 15360 MiB
    exact = plan({"a": f"{capacity // MiB - 4096}MiB", "b": "4GiB"})
    assert exact.mine.limit_bytes == capacity
    with pytest.raises(DoesNotFitError):
        plan({"a": f"{capacity // MiB - 4096 + 1}MiB", "b": "4GiB"})


def test_does_not_fit_lists_every_tenant_and_the_total():
    with pytest.raises(DoesNotFitError) as err:
        plan({"bert": "6GiB", "resnet": "8GiB", "gpt": "4GiB"})
    msg = str(err.value)
    for part in ("bert 6.0 GiB", "resnet 8.0 GiB", "gpt 4.0 GiB", "= 18.0 GiB", "GPU 0 (16.0 GiB)", "15.0 GiB",
                 "reserve 256.0 MiB", "per-process overhead 768.0 MiB", "shrink or drop a tenant"):
        assert part in msg, (part, msg)


def test_reserve_and_foreign_and_overhead_are_honoured():
    with pytest.raises(DoesNotFitError, match="foreign 2.0 GiB"):
        plan({"bert": "6GiB", "resnet": "8GiB"}, foreign="2GiB")
    ok = plan({"bert": "6GiB", "resnet": "8GiB"}, reserve="0", overhead="512MiB", foreign="1GiB")
    assert ok.mine.limit_bytes == 14 * GiB


def test_too_many_tenants():
    many = {f"m{i}": "1GiB" for i in range(DEFAULT_MAX_TENANTS + 1)}
    with pytest.raises(DoesNotFitError, match=f"{DEFAULT_MAX_TENANTS + 1} tenants .* at most {DEFAULT_MAX_TENANTS}"):
        plan(many, inv="1x80GiB")
    assert len(plan(many, inv="1x80GiB", max_tenants=16).mine.devices) == DEFAULT_MAX_TENANTS + 1
    with pytest.raises(ConfigError, match="max_tenants=0"):
        plan({"a": "1GiB"}, max_tenants=0)


@pytest.mark.parametrize("tenants,match", [
    ({"a": "lots"}, "tenant 'a': cannot read 'lots'"),
    ({"a": -5}, "cannot be negative"),
    ({"a": "0"}, "below the smallest slice"),
    ({"a": "10MiB"}, "below the smallest slice"),
    ({"a": 1.5}, "fraction must lie in"),
    ({"a": True}, "expected a size"),
    ({"": "1GiB"}, "non-empty name"),
    ([("a", "1GiB"), ("a", "2GiB")], "listed twice"),
    ({}, "at least one tenant"),
    ("bert", "name=size pairs"),
    (42, "give a dict"),
])
def test_bad_tenant_specs(tenants, match):
    with pytest.raises(ConfigError, match=match):
        plan(tenants)


def test_tenants_are_required():
    with pytest.raises(ConfigError, match="needs tenants="):
        make_plan("tenants", one(), fleet_inventory("1x16GiB"))


def test_growth_only_for_a_single_tenant():
    with pytest.raises(ConfigError, match="memory_limit on every logical device"):
        plan({"a": "1GiB", "b": "1GiB"}, memory="growth")
    p = plan({"a": "1GiB"}, memory="growth")
    assert p.mine.mode == "growth" and not p.mine.devices[0].enforce


def test_each_rank_splits_its_own_gpu_and_shared_gpus_halve_capacity():
    topo = Topology(rank=1, size=2, local_rank=1, local_size=2, host="n")
    p = plan({"bert": "6GiB", "resnet": "8GiB"}, inv="2x16GiB", topo=topo)
    assert [a.devices[0].index for a in p.allocations] == [0, 1]
    assert p.extras["tenants"][0]["gpu"] == 1 and p.device("bert") == "/GPU:0"
    with pytest.raises(DoesNotFitError, match="2 processes share it"):
        plan({"bert": "6GiB", "resnet": "8GiB"}, inv="1x16GiB", topo=topo)
    small = plan({"a": "3GiB", "b": "3GiB"}, inv="1x16GiB", topo=topo)
    assert [a.devices[0].shared_by for a in small.allocations] == [2, 2]


def test_without_a_gpu_tenants_run_on_logical_cpu_devices_limits_recorded():
    p = plan({"bert": "6GiB", "resnet": "auto"}, inv=NO_GPU)
    assert p.extras["devices"] == {"bert": "/CPU:0", "resnet": "/CPU:1"}
    assert p.extras["cpu_logical_devices"] == 2
    assert p.mine.devices == [] and p.mine.mode == "cpu"
    assert [(t["limit_bytes"], t["enforced"]) for t in p.extras["tenants"]] == [(6 * GiB, False), (None, False)]
    assert any("recorded, not enforced" in w for w in p.warnings)
    assert p.mine.notes[0] == "tenant bert: /CPU:0 (logical CPU device), limit 6.0 GiB recorded, not enforced (no GPU)"
    one_tenant = plan({"bert": "6GiB"}, inv=NO_GPU)
    assert "cpu_logical_devices" not in one_tenant.extras and one_tenant.device("bert") == "/CPU:0"
    with pytest.raises(ConfigError, match="needs a device total"):
        plan({"bert": "45%"}, inv=NO_GPU)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"no device named 'gpt'.*\['bert', 'resnet'\]"):
        plan({"bert": "6GiB", "resnet": "8GiB"}).device("gpt")


def test_parse_tenants_forms():
    assert parse_tenants("a=1GiB,b=auto") == [("a", "1GiB"), ("b", "auto")]
    assert parse_tenants({"a": 1}) == [("a", 1)]


def test_tenant_table_shows_devices_limits_and_enforcement():
    text = tenant_table(plan({"bert": "6GiB", "resnet": "8GiB"}),
                        {"GPU:1": {"current_bytes": 3 * MiB, "peak_bytes": 5 * MiB}})
    lines = text.splitlines()
    assert lines[0].split() == ["tenant", "device", "limit", "enforced", "current", "peak"]
    assert lines[2].split()[:6] == ["bert", "/GPU:0", "(GPU", "0)", "6.0", "GiB"]
    assert "resnet" in lines[3] and "8.0 GiB" in lines[3] and "yes" in lines[3] and "5.0 MiB" in lines[3]
    cpu = tenant_table(plan({"bert": "6GiB", "resnet": "8GiB"}, inv=NO_GPU))
    assert cpu.count("no (recorded)") == 2


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "distmem.cli", "plan", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_cli_plan_tenants():
    res = _cli("--strategy", "tenants", "--gpus", "1x16GiB", "--tenants", "bert=6GiB,resnet=8GiB")
    assert res.returncode == 0, res.stderr
    assert "GPU 0 [bert] hard limit 6.0 GiB; GPU 0 [resnet] hard limit 8.0 GiB" in res.stdout
    js = _cli("--strategy", "tenants", "--gpus", "1x16GiB", "--tenants", "bert=6GiB,resnet=8GiB", "--json")
    data = json.loads(js.stdout)
    assert data["extras"]["devices"] == {"bert": "/GPU:0", "resnet": "/GPU:1"}
    bad = _cli("--strategy", "tenants", "--gpus", "1x16GiB", "--tenants", "bert=12GiB,resnet=8GiB")
    assert bad.returncode == 1 and "do not fit GPU 0" in bad.stderr
    missing = _cli("--strategy", "tenants", "--gpus", "1x16GiB")
    assert missing.returncode == 1 and "--tenants NAME=SIZE" in missing.stderr


def test_init_tenants_without_a_framework(monkeypatch):
    import distmem

    monkeypatch.delenv("DISTMEM_FLEET", raising=False)
    distmem.reset()
    try:
        p = distmem.init(strategy="tenants", framework="none", fleet="1x16GiB", verbose=False,
                         tenants={"bert": "6GiB", "resnet": "8GiB"})
        assert p.device("resnet") == "/GPU:1" and p.options["framework"] == "none"
        with pytest.raises(ConfigError, match="limit= applies to strategy='data'"):
            distmem.init(strategy="tenants", framework="none", limit="1GiB", tenants={"a": "1GiB"})
    finally:
        distmem.reset()


def test_min_slice_constant_is_whole_mib():
    assert MIN_TENANT_BYTES % MiB == 0
