"""What a command says besides its result (issue 35, "silent readings"), run as a user runs it
(``python -m distmem ...``, ``python -c`` for the Python door), a real process each:

* a size in a decimal unit is said back once, in the same words at every door (a flag, a
  ``DISTMEM_*`` setting, an ``init()`` keyword), before the result; ``--json`` stays JSON;
* a per-host fleet names the job's hosts: the ranks go to them, or the command says how to place them;
* long work says its stages on stderr, stdout holds the result alone;
* no framework start-up chatter, and distmem's own Python warnings as one line.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run(args, env=None, cwd=None, timeout=900):
    """``args`` after the interpreter, in a clean environment (no DISTMEM_* of the caller's)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("DISTMEM_", "TF_CPP", "GLOG", "GRPC"))}
    full.update(PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, *args], env=full, cwd=cwd or ROOT, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_a_decimal_size_is_said_back_once_at_every_door(tmp_path):
    """``--gpus 2x16G`` planned 16e9-byte GPUs (14.9 GiB) and ``--reserve 16G`` showed as 14.9 GiB
    with no word. Now every door says the reading once, with the same line, before the result."""
    said = "16G = 16.0e9 B = 14.9 GiB (G is decimal, 1000^3; 16GiB is 16 x 1024^3)"
    flag = run(["-m", "distmem", "plan", "--gpus", "2x16G", "--ranks", "2", "--reserve", "16G"])
    assert flag.returncode == 1  # 14.9 GiB kept free of a 14.9 GiB GPU: the error follows the reading
    lines = flag.stderr.splitlines()
    assert lines[0] == f"distmem plan: --gpus '2x16G': {said}" and flag.stderr.count(said) == 1, flag.stderr
    assert lines[-1].startswith("distmem plan: error: GPU 0 (14.9 GiB) cannot hold")

    setting = run(["-m", "distmem", "plan", "--gpus", "2x16GiB", "--ranks", "2", "--json"],
                  env={"DISTMEM_LIMIT": "4G"})
    assert setting.returncode == 0, setting.stderr
    assert json.loads(setting.stdout)["world_size"] == 2  # stdout is the JSON alone
    assert "distmem plan: DISTMEM_LIMIT: 4G = 4.0e9 B = 3.7 GiB" in setting.stderr

    keyword = run(["-c", "import distmem; distmem.init(fleet='1x16GiB', framework='none', reserve='1G')"])
    assert keyword.returncode == 0, keyword.stderr
    assert keyword.stderr.count("1G = 1.0e9 B = 953.7 MiB") == 1
    assert "[distmem rank 0] reserve: 1G = 1.0e9 B = 953.7 MiB" in keyword.stderr

    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps([{"name": f"l{i}", "state_bytes": 2**26, "activation_bytes": 2**20,
                                   "output_bytes": 2**20} for i in range(4)]))
    fitted = run(["-m", "distmem", "fit", "--layers", str(layers), "--global-batch-size", "8", "--gpus", "2x16G",
                  "--top", "1", "--rejected", "0"])
    assert fitted.returncode == 0, fitted.stderr
    assert fitted.stderr.count(said) == 1 and fitted.stdout.startswith("distmem fit:")

    binary = run(["-m", "distmem", "plan", "--gpus", "2x16GiB", "--ranks", "2"])
    assert binary.returncode == 0 and "decimal" not in binary.stderr  # binary units need no word


def test_a_per_host_fleet_puts_the_ranks_on_its_hosts():
    """``--gpus 'a=2x80GiB;b=2x16GiB' --ranks 6`` put all six ranks on host a. The fleet names the
    job's hosts: the ranks go to them in proportion to their GPUs, or the command says how."""
    fleet = "a=2x80GiB;b=2x16GiB"
    six = run(["-m", "distmem", "plan", "--gpus", fleet, "--ranks", "6"])
    assert six.returncode == 0, six.stderr
    assert "6 ranks, 2 hosts (a: 3, b: 3)" in six.stdout
    assert "rank 5 (local 2): GPU 0 hard limit 7.1 GiB shared by 2 on b" in six.stdout
    per_host = run(["-m", "distmem", "plan", "--gpus", fleet, "--ranks-per-host", "2"])
    assert "4 ranks, 2 hosts (a: 2, b: 2)" in per_host.stdout, per_host.stdout + per_host.stderr
    five = run(["-m", "distmem", "plan", "--gpus", fleet, "--ranks", "5"])
    assert five.returncode == 1 and "Traceback" not in five.stderr
    assert "--ranks 5" in five.stderr and "--hosts a:3,b:2" in five.stderr


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="torchvision is not installed")
def test_long_work_says_its_stages_on_stderr_and_stdout_stays_the_result(tmp_path):
    """``fit`` and ``estimate`` ran 50-85 s without a word. Each stage now says itself on stderr as
    it begins; ``--json`` output on stdout is still one JSON document."""
    est = run(["-m", "distmem", "estimate", "--model", "torchvision:resnet18", "--batch-size", "2",
               "--input-shape", "3,32,32", "--method", "model", "--json"])
    assert est.returncode == 0, est.stderr
    assert json.loads(est.stdout)["batch_size"] == 2
    assert "distmem estimate: estimating torchvision:resnet18 at batch 2 (the model alone)" in est.stderr
    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps([{"name": f"l{i}", "state_bytes": 2**26, "activation_bytes": 2**20,
                                   "output_bytes": 2**20} for i in range(4)]))
    fitted = run(["-m", "distmem", "fit", "--layers", str(layers), "--global-batch-size", "8", "--gpus",
                  "2x16GiB", "--json"])
    assert fitted.returncode == 0, fitted.stderr
    assert json.loads(fitted.stdout)["fits"]
    assert "distmem fit: searching" in fitted.stderr and "layouts of" in fitted.stderr
    quiet = run(["-m", "distmem", "fit", "--layers", str(layers), "--global-batch-size", "8", "--gpus", "2x16GiB"],
                env={"DISTMEM_QUIET": "1"})
    assert quiet.returncode == 0 and quiet.stderr == ""


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed")
def test_a_command_shows_no_framework_chatter():
    """TensorFlow's start-up log (oneDNN, CPU features) filled ``estimate`` / ``fit`` output, from the
    child process that measures: the command line turns it down before any TensorFlow starts, its
    children's included; what stderr holds is distmem's own lines. (No cache: the child runs.)"""
    est = run(["-m", "distmem", "estimate", "--model", "keras:MobileNetV2", "--input-shape", "32,32,3",
               "--batch-size", "2", "--method", "measure"], env={"DISTMEM_MEASURE_CACHE": "off"})
    assert est.returncode == 0, est.stderr
    assert est.stdout.startswith("keras:MobileNetV2: keras, batch 2")
    others = [ln for ln in est.stderr.splitlines() if not ln.startswith(("distmem estimate: ", "warning: "))]
    assert not others, est.stderr


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="torchvision is not installed")
def test_distmem_warnings_are_one_line_without_source_lines():
    """distmem's own ``warnings.warn`` printed Python's ``file:line: UserWarning:`` and the source
    line ``warnings.warn(...)`` of distmem's code. They read as one line, anywhere distmem runs."""
    code = ("import distmem.estimate as e\n"
            "e.estimate('torchvision:resnet18', 2, method='auto', input_shape=(3, 32, 32), device='cuda')\n")
    got = run(["-c", code], env={"CUDA_VISIBLE_DEVICES": ""})
    assert got.returncode == 0, got.stderr
    lines = [ln for ln in got.stderr.splitlines() if "distmem.estimate" in ln]
    assert lines and all(ln.startswith("warning: distmem.estimate: not measured") for ln in lines), got.stderr
    assert "UserWarning" not in got.stderr and "warnings.warn(" not in got.stderr


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="torchvision is not installed")
def test_estimate_says_each_warning_once():
    """The table ends with the estimate's warnings; each was printed a second time on stderr. Once in
    the table; with --json (warnings in the JSON), once on stderr for the terminal."""
    args = ["-m", "distmem", "estimate", "--model", "torchvision:resnet18", "--batch-size", "2",
            "--input-shape", "3,32,32"]
    env = {"CUDA_VISIBLE_DEVICES": "", "DISTMEM_MEASURE_CACHE": "off"}
    text = run(args, env=env)
    assert text.returncode == 0, text.stderr
    said = (text.stdout + text.stderr).count("not measured (")
    assert said == 1, (text.stdout, text.stderr)
    js = run(args + ["--json"], env=env)
    assert js.returncode == 0, js.stderr
    assert js.stderr.count("not measured (") == 1 and json.loads(js.stdout)["warnings"], js.stderr
