import pytest

from distmem.errors import ConfigError
from distmem.units import GiB, MiB, format_bytes, parse_bytes, to_mib_floor


@pytest.mark.parametrize("text,expected", [
    ("6GiB", 6 * GiB), ("6 gib", 6 * GiB), ("512MB", 512 * 10**6), ("512MiB", 512 * MiB),
    ("1.5TiB", int(1.5 * 1024**4)), ("1024", 1024), ("2G", 2 * 10**9), (4096, 4096),
])
def test_parse_sizes(text, expected):
    assert parse_bytes(text) == expected


def test_percent_and_fraction_need_total():
    assert parse_bytes("45%", total=100 * GiB) == int(45 * GiB)
    assert parse_bytes(0.25, total=8 * GiB, allow_fraction=True) == 2 * GiB
    with pytest.raises(ConfigError, match="needs a device total"):
        parse_bytes("45%")


@pytest.mark.parametrize("bad", ["6 GiBs", "abc", "-1GiB", "150%", "0%", True, [1], -5])
def test_bad_sizes_name_the_value(bad):
    with pytest.raises(ConfigError) as err:
        parse_bytes(bad, total=GiB, what="limit")
    assert "limit" in str(err.value)


def test_fraction_out_of_range():
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        parse_bytes(1.5, total=GiB, allow_fraction=True)


def test_format_and_mib_floor():
    assert format_bytes(1536 * MiB) == "1.5 GiB"
    assert format_bytes(None) == "-"
    assert format_bytes(-2 * MiB) == "-2.0 MiB"
    assert to_mib_floor(MiB * 3 + MiB - 1) == 3
