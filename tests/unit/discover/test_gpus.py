import logging

import pytest

from distmem.discover import gpus as devices
from distmem.discover import nvml as nvml_binding
from distmem.discover.gpus import fleet_inventory, parse_fleet, parse_visible_devices
from distmem.errors import ConfigError
from distmem.units import GiB

UUIDS = ["GPU-8c1f0a11-aaaa-bbbb-cccc-000000000000", "GPU-8c2e0b22-aaaa-bbbb-cccc-111111111111",
         "GPU-99aa0c33-aaaa-bbbb-cccc-222222222222"]


@pytest.mark.parametrize("spec,expected", [
    (None, [0, 1, 2]), ("", []), ("-1", []), ("NoDevFiles", []), ("2,0", [2, 0]), (" 1 ", [1]),
    (UUIDS[1], [1]), ("GPU-99aa", [2]), (f"0,{UUIDS[2]}", [0, 2]),
])
def test_visible_devices_forms(spec, expected):
    assert parse_visible_devices(spec, UUIDS) == expected


def test_visible_devices_mig():
    migs = {"MIG-11111111-2222-3333-4444-555555555555": 0, "MIG-66666666-2222-3333-4444-555555555555": 0}
    assert parse_visible_devices("MIG-6666", UUIDS, migs) == ["MIG-66666666-2222-3333-4444-555555555555"]


@pytest.mark.parametrize("spec,match", [
    ("0,a", "cannot read item 'a'"), ("5", "index 5 does not exist"), ("GPU-8c", "matches 2 GPU"),
    ("0,0", "listed twice"), ("MIG-zz", "matches 0 MIG"), ("0;1", "cannot read item"),
])
def test_malformed_visible_devices(spec, match):
    with pytest.raises(ConfigError, match=match) as err:
        parse_visible_devices(spec, UUIDS)
    assert "CUDA_VISIBLE_DEVICES" in str(err.value)


def test_fleet():
    assert parse_fleet("4x16GiB") == [16 * GiB] * 4
    assert parse_fleet("2x80GiB,1x40GiB") == [80 * GiB] * 2 + [40 * GiB]
    inv = fleet_inventory("2x16GiB")
    assert inv.source == "fleet:2x16GiB" and not inv.real and [g.index for g in inv.gpus] == [0, 1]
    for bad in ("4x", "x16GiB,", "0x16GiB", "4xlots"):
        with pytest.raises(ConfigError):
            parse_fleet(bad)


def test_no_nvml_is_cpu_mode_with_one_line(monkeypatch, caplog):
    monkeypatch.setitem(nvml_binding._state, "init", False)
    monkeypatch.setitem(nvml_binding._state, "error", "NVML Shared Library Not Found")
    with caplog.at_level(logging.INFO, logger="distmem"):
        inv = devices.inventory()
    assert inv.gpus == [] and inv.source == "none" and "CPU mode" in inv.note
    assert sum("CPU mode" in r.getMessage() for r in caplog.records) == 1
    assert devices.nvml_query("nvmlDeviceGetCount", default=-1) == -1
    assert devices.process_usage() == {}


def test_inventory_on_this_machine_never_crashes():
    inv = devices.inventory(quiet=True)
    assert inv.source in ("none", "nvml")
    assert all(g.total_bytes > 0 for g in inv.gpus)


@pytest.mark.parametrize("spec", ["100000x16GiB", "1025x16GiB", "1000x16GiB,25x16GiB", "a=1025x80GiB",
                                  pytest.param("1" * 5000 + "x1GiB", id="5000-digit-count")])
def test_a_fleet_declares_at_most_1024_gpus_per_host(spec):
    """Issue 26, finding 14: a count is bounded before the list is built (aa55a88 returned 100000
    GPUs, and DISTMEM_FLEET=2000000000x16GiB died with MemoryError building 2e9 of them)."""
    with pytest.raises(ConfigError, match="more than 1024 GPUs on one host"):
        parse_fleet(spec, "a")


def test_the_fleet_of_the_finding_fails_at_once_with_the_bound():
    """DISTMEM_FLEET=2000000000x16GiB of the finding: a ConfigError naming the bound, no allocation
    (not run against aa55a88, where it allocates 16 GB before failing)."""
    with pytest.raises(ConfigError, match=r"'2000000000x16GiB' makes more than 1024 GPUs"):
        parse_fleet("2000000000x16GiB")
    assert len(parse_fleet("1024x16GiB")) == 1024 and len(parse_fleet("a=1000x1GiB,24x1GiB", "a")) == 1024


def test_a_fleet_size_beyond_any_machine_names_the_bound():
    with pytest.raises(ConfigError, match="more than any machine holds"):
        parse_fleet("4x99999999999999999999TiB")
