"""Every size, count and wait a user can give is bounded, with a ConfigError naming the value and
the bound (issue 26, finding 14). On aa55a88 ``DISTMEM_LIMIT=1e308TiB`` was an OverflowError
traceback, ``18446744073709551615`` (the native cap's "unlimited" sentinel) and 2**64 were accepted
as sizes, a 5000-digit number was a bare ValueError, and a wait of 1e300 s was accepted (then
``threading`` overflowed)."""
import math

import pytest

from distmem import settings
from distmem.errors import ConfigError
from distmem import units
from distmem.units import check_size, parse_bytes

MAX_BYTES = 2**63 - 1  # 8 EiB less a byte: a signed 64-bit count
MAX_SECONDS = 10 * 365 * 24 * 3600.0  # ten years


@pytest.mark.parametrize("value", ["1e308TiB", "1e308", 1e308, 2**63, 2**64, 2**64 - 1, "18446744073709551615",
                                   "9223372036854775808", "99999999999999999999TiB",
                                   pytest.param(10**400, id="10**400"), pytest.param("1" * 5000, id="5000-digits"),
                                   pytest.param("1" * 5000 + "GiB", id="5000-digits-GiB")])
def test_a_size_beyond_any_machine_is_a_config_error(value):
    with pytest.raises(ConfigError, match="more than any machine holds|a size must be"):
        parse_bytes(value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "nan", "inf", "nan%", "inf%", "1e400", "1e400%",
                                   "-inf"])
def test_nan_and_infinity_are_refused(value):
    with pytest.raises(ConfigError):
        parse_bytes(value, total=16 << 30, allow_fraction=True)


def test_the_bound_itself_is_a_size():
    assert parse_bytes(MAX_BYTES) == MAX_BYTES == units.MAX_BYTES
    assert parse_bytes(str(MAX_BYTES)) == MAX_BYTES
    assert parse_bytes("8TiB") == 8 << 40


@pytest.mark.parametrize("name", ["DISTMEM_LIMIT", "DISTMEM_OVERHEAD"])
def test_size_variables_are_bounded_before_anything_runs(name):
    with pytest.raises(ConfigError, match=name):
        settings.validate({name: "1e308TiB"})


@pytest.mark.parametrize("name", ["DISTMEM_TIMEOUT", "DISTMEM_LAYOUT_TIMEOUT", "DISTMEM_LAUNCH_TIMEOUT"])
@pytest.mark.parametrize("value", ["1e300", "inf", "nan", str(MAX_SECONDS * 2)])
def test_waits_are_bounded(name, value):
    with pytest.raises(ConfigError, match=name):
        settings.validate({name: value})


def test_a_long_wait_within_the_bound_is_accepted():
    assert settings.timeout({"DISTMEM_TIMEOUT": str(30 * 24 * 3600)}) == 30 * 24 * 3600
    assert math.isclose(settings.positive_seconds(MAX_SECONDS, "t"), MAX_SECONDS) and settings.MAX_SECONDS == MAX_SECONDS


def test_check_size_names_the_variable_and_the_bound():
    with pytest.raises(ConfigError, match=r"DISTMEM_LIMIT: 1e308TiB is more than any machine holds.*9223372036854775807"):
        check_size("1e308TiB", what="DISTMEM_LIMIT", allow_fraction=True)
