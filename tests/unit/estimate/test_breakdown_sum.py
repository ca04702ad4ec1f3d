"""``distmem estimate``'s "of which" lines add up to the training peak, for Keras and torch, in the
table and in ``--json`` alike: every byte of the peak belongs to one named part (issue #18)."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
NAMED = {"weights", "gradients", "optimizer state", "inputs", "activations", "temporaries", "workspaces",
         "allocator rounding"}
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}

CASES = {
    "keras": ["--model", "keras:MobileNetV2", "--input-shape", "32,32,3", "--batch-size", "4",
              "--optimizer", "adam", "--method", "model"],
    "torch": ["--model", "torchvision:resnet18", "--input-shape", "3,32,32", "--batch-size", "4",
              "--optimizer", "adam", "--method", "model"],
}
#: the measured path's breakdown adds what the measurement showed beyond the model
MEASURED = "measured, not modelled"


def _distmem(args):
    """The installed ``distmem`` console script (the real entry point), else ``python -m distmem.cli``."""
    script = shutil.which("distmem", path=os.path.dirname(sys.executable))
    cmd = [script] if script else [sys.executable, "-m", "distmem.cli"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(cmd + ["estimate", *args], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _needs(framework):
    if framework == "keras":
        pytest.importorskip("tensorflow")
    else:
        pytest.importorskip("torch")
        pytest.importorskip("torchvision")


def _bytes(text):
    num, unit = text.split()
    return float(num) * UNITS[unit]


@pytest.mark.parametrize("framework", sorted(CASES) + ["keras measured"])
def test_json_breakdown_sums_to_the_peak(framework):
    _needs(framework.split()[0])
    args = CASES[framework] if framework in CASES else CASES["keras"][:-1] + ["measure"]
    out = json.loads(_distmem(args + ["--json"]))
    parts = out["breakdown"]
    assert set(parts) <= NAMED | {MEASURED}, f"unnamed parts: {set(parts) - NAMED}"
    # measured beyond the model: its own part; the model over-counting: its batch-dependent parts less
    assert MEASURED not in parts or framework == "keras measured", parts
    assert all(v >= 0 for v in parts.values()), parts
    assert sum(parts.values()) == out["peak_bytes"], parts
    # what the totals say is held for the whole step is in the peak under its own name, not another's
    assert parts["weights"] >= out["param_bytes"]  # torch's buffers (BatchNorm statistics) are stored weights too
    assert parts["optimizer state"] <= out["optimizer_bytes"]
    assert parts["gradients"] <= out["grad_bytes"]


@pytest.mark.parametrize("framework", sorted(CASES))
def test_table_of_which_lines_sum_to_the_peak(framework):
    _needs(framework)
    text = _distmem(CASES[framework])
    peak = re.search(r"^training peak \(allocator\)\s+(\S+ \S+)$", text, re.M)
    assert peak, text
    lines = re.findall(r"^  of which (.+?)\s{2,}(\S+ \S+)$", text, re.M)
    names = [n for n, _ in lines]
    assert {"weights", "optimizer state", "activations", "gradients"} <= set(names), text
    assert set(names) <= NAMED, text
    # each figure is printed to 0.1 of its unit: the sum may differ by half of that per line
    total = sum(_bytes(v) for _, v in lines)
    slack = sum(0.05 * UNITS[v.split()[1]] for _, v in lines) + 0.05 * UNITS[peak.group(1).split()[1]]
    assert abs(total - _bytes(peak.group(1))) <= slack, text
