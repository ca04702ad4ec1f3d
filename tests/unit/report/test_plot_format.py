"""A plot's format follows its file name (issue 35: ``report --plot out.jpg`` wrote PNG bytes into a
.jpg). Each extension matplotlib writes gives that format's bytes; any other name is refused before
the work, with the list, at every door that draws (``distmem report --plot``, ``plot()``, the
periodic report's ``plot=``)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from distmem.errors import ConfigError  # noqa: E402
from distmem.report.sinks import plot  # noqa: E402
from distmem.report.sinks.png import plot_format  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MAGIC = {"png": b"\x89PNG", "jpg": b"\xff\xd8\xff", "jpeg": b"\xff\xd8\xff", "pdf": b"%PDF", "svg": b"<?xml",
         "webp": b"RIFF", "tif": b"II*\x00"}


@pytest.fixture(scope="module")
def report_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plot") / "report.json"
    code = ("import distmem\ndistmem.init(fleet='1x16GiB', framework='none', verbose=False)\n"
            f"distmem.report(path={str(path)!r}, print_table=False)\n")
    subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT, DISTMEM_QUIET="1"),
                   check=True, timeout=120)
    return str(path)


@pytest.mark.parametrize("ext", sorted(MAGIC))
def test_the_extension_names_the_format(ext, report_file, tmp_path):
    from distmem.report.sinks import read_json

    out = tmp_path / f"out.{ext}"
    plot(read_json(report_file), str(out))
    assert out.read_bytes().startswith(MAGIC[ext])


@pytest.mark.parametrize("name", ["out.xyz", "out", "out.pgf"])
def test_a_name_without_a_known_format_is_refused_with_the_list(name, report_file, tmp_path):
    with pytest.raises(ConfigError) as err:
        plot_format(str(tmp_path / name), "--plot")
    assert "--plot" in str(err.value) and ".png" in str(err.value) and ".svg" in str(err.value)
    cmd = subprocess.run([sys.executable, "-m", "distmem", "report", report_file, "--plot", str(tmp_path / name)],
                         env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert cmd.returncode == 1 and cmd.stdout == ""  # refused before the table is printed
    assert cmd.stderr.startswith("distmem report: error: --plot") and not os.path.exists(tmp_path / name)


def test_the_periodic_report_refuses_the_name_when_it_is_made(tmp_path):
    from distmem.report.periodic import ReportEvery

    with pytest.raises(ConfigError, match="out.gif"):
        ReportEvery(10, plot=str(tmp_path / "out.gif"))
