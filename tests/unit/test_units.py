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


def test_a_decimal_unit_is_said_back_once_and_a_binary_one_never():
    """Issue 35: ``--gpus 2x16G`` was 16e9 bytes, 14.9 GiB, with no word. A size in a decimal unit is
    read as powers of 1000 and said back once per text, wherever it was read; a binary one is not."""
    from distmem.units import said_back

    said_back()  # what earlier tests read
    assert parse_bytes("17G", what="--gpus '2x17G'") == 17 * 10**9
    assert parse_bytes("17G", what="reserve") == 17 * 10**9  # the same text: said once
    assert parse_bytes("6GiB", what="limit") == 6 * GiB
    assert parse_bytes("513 MB", what="DISTMEM_LIMIT") == 513 * 10**6
    lines = said_back()
    assert lines == [
        "--gpus '2x17G': 17G = 17.0e9 B = 15.8 GiB (G is decimal, 1000^3; 17GiB is 17 x 1024^3)",
        "DISTMEM_LIMIT: 513 MB = 513.0e6 B = 489.2 MiB (MB is decimal, 1000^2; 513MiB is 513 x 1024^2)"]
    assert said_back() == []  # each line is handed out once
    parse_bytes("17G")
    assert said_back() == []  # and each text is said once per process


@pytest.mark.parametrize("value, ratio", [("10%", 0.1), ("0.1", 0.1), (0.1, 0.1), (0, 0.0), ("0", 0.0), (1, 1.0),
                                          ("150%", 1.5), (" 25 % ".strip(), 0.25)])
def test_a_ratio_is_a_percentage_or_a_fraction(value, ratio):
    from distmem.units import parse_ratio

    assert parse_ratio(value, what="headroom") == pytest.approx(ratio)


@pytest.mark.parametrize("value", [10, "10", 1.5, "2.5"])
def test_a_ratio_above_1_given_as_a_number_is_refused_with_both_readings(value):
    """Issue 35: ``--from-margin 10`` meant +1000%. One rule for every ratio: a bare number above 1
    looks like a percentage and is refused, the message giving both ways to write what was meant."""
    from distmem.units import parse_ratio

    with pytest.raises(ConfigError) as err:
        parse_ratio(value, what="from_margin")
    n = float(value)
    text = str(err.value)
    assert f"from_margin={value}" in text and f"'{n:g}%'" in text and f"'{n * 100:g}%'" in text


@pytest.mark.parametrize("door", ["headroom", "from_margin", "fit_headroom"])
def test_every_ratio_option_follows_the_one_rule(door, tmp_path):
    """The rule reaches every ratio a user gives: a strategy's headroom, fit's headroom and the
    margin over a last run's peak refuse ``10`` and take ``10%``."""
    from distmem.plan import PlanRequest
    from distmem.plan.fit import fit
    from distmem.costs import LayerCost

    def ask(value):
        if door == "headroom":
            from distmem.plan import JobLayout
            return PlanRequest(strategy="pipeline", options=dict(stages=["1GiB", "1GiB"], headroom=value),
                               fleet="2x16GiB", framework="none",
                               job=JobLayout.declare(ranks=2, fleet="2x16GiB")).plan()
        if door == "fit_headroom":
            return fit(layers=[LayerCost("a", 64 * MiB, MiB, MiB), LayerCost("b", 64 * MiB, MiB, MiB)],
                       layers_batch_size=1, global_batch_size=8, gpus="2x16GiB", headroom=value, top=1, rejected=0)
        import json
        report = tmp_path / "report.json"
        report.write_text(json.dumps({"world_size": 1, "strategy": "data", "ranks": [
            {"rank": 0, "local_rank": 0, "host": "h", "peak_bytes": GiB, "limit_bytes": 2 * GiB}]}))
        return PlanRequest(strategy="data", fleet="1x16GiB", framework="none", from_report=str(report),
                           from_margin=value).plan()

    with pytest.raises(ConfigError, match="a ratio above 1"):
        ask(10)
    assert ask("10%") is not None


@pytest.mark.parametrize("value", [0.5, "0.5", "2.5", 1.25])
def test_a_number_of_bytes_that_is_not_whole_is_refused_not_truncated(value):
    """``--reserve 0.5`` planned a reserve of 0 B (0.5 bytes, truncated) with no word: a number
    without a unit is bytes, and a fraction of a byte is a share or GiB meant. Refused, both named;
    where fractions are taken (a limit) 0.5 is still half a GPU."""
    with pytest.raises(ConfigError) as err:
        parse_bytes(value, what="reserve")
    assert "not a whole number of bytes" in str(err.value) and f"'{float(value):g}GiB'" in str(err.value)
    assert parse_bytes(0.5, total=8 * GiB, what="limit", allow_fraction=True) == 4 * GiB
    assert parse_bytes(1536.5, what="layer bytes") == 1536  # a computed byte count keeps its reading
