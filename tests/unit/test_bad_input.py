"""Bad input is a DistmemError naming the argument (or variable) and its value, on a machine without
GPUs and against a declared fleet alike: validation does not depend on the hardware."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import distmem
from distmem.errors import DistmemError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (init keyword arguments, a word the message must name, the value's text it must show)
INIT_CASES = [
    (dict(limit=1.5), "limit", "1.5"),
    (dict(limit=0), "limit", "0"),
    (dict(limit=8), "limit", "8"),
    (dict(limit="8"), "limit", "8"),
    (dict(limit=1024), "limit", "1024"),
    (dict(limit="-2GiB"), "limit", "-2GiB"),
    (dict(limit="12 parsecs"), "limit", "12 parsecs"),
    (dict(limit="150%"), "limit", "150%"),
    (dict(limit="0%"), "limit", "0%"),
    (dict(limit="abc%"), "limit", "abc%"),
    (dict(limit=True), "limit", "True"),
    (dict(limit=[1]), "limit", "[1]"),
    (dict(limit=-0.5), "limit", "-0.5"),
    (dict(limit=float("nan")), "limit", "nan"),
    (dict(reserve="-1GiB"), "reserve", "-1GiB"),
    (dict(reserve="lots"), "reserve", "lots"),
    (dict(reserve="200%"), "reserve", "200%"),
    (dict(reserve=-5), "reserve", "-5"),
    (dict(foreign="x"), "foreign", "x"),
    (dict(foreign="101%"), "foreign", "101%"),
    (dict(overhead="5%"), "overhead", "5%"),
    (dict(overhead="a lot"), "overhead", "a lot"),
    (dict(overhead=-1), "overhead", "-1"),
    (dict(memory="grow"), "memory", "grow"),
    (dict(memory=""), "memory", "''"),
    (dict(strategy="datum"), "strategy", "datum"),
    (dict(strategy=""), "strategy", "''"),
    (dict(framework="jax"), "framework", "jax"),
    (dict(enforce="hard"), "enforce", "hard"),
    (dict(strategy="pipeline", limit="6GiB", stages=["1GiB"]), "limit", "pipeline"),
    (dict(strategy="pipeline", stages=["1GiB"], headroom="abc%"), "headroom", "abc%"),
    (dict(strategy="pipeline", stages=["1GiB"], headroom="-50%"), "headroom", "-50%"),
    (dict(strategy="pipeline", stages=["1GiB"], headroom="lots"), "headroom", "lots"),
    (dict(strategy="pipeline", stages=[]), "stages", "empty"),
    (dict(strategy="pipeline"), "pipeline", "stages"),
    (dict(strategy="pipeline", stages=["1GiB"], schedule="zigzag"), "schedule", "zigzag"),
    (dict(strategy="pipeline", stages=["nope"]), "stage", "nope"),
    (dict(strategy="model"), "model", "layers"),
    (dict(strategy="tenants"), "tenants", "tenants"),
    (dict(strategy="tenants", tenants="bert"), "tenant", "bert"),
    (dict(strategy="tenants", tenants={"a": "1GiB"}, max_tenants=0), "max_tenants", "0"),
    (dict(strategy="data", stratgey="data"), "stratgey", "stratgey"),
    (dict(fleet="4x16"), "fleet", "4x16"),
    (dict(fleet="4x"), "fleet", "4x"),
    (dict(fleet="0x16GiB"), "fleet", "0x16GiB"),
    (dict(fleet="a=;b=2x16GiB"), "fleet", "a="),
    (dict(fleet="other=2x16GiB"), "fleet", "other=2x16GiB"),
]

# (variable, value, a word the message must name)
ENV_CASES = [
    ("DISTMEM_TIMEOUT", "abc", "DISTMEM_TIMEOUT"),
    ("DISTMEM_TIMEOUT", "-5", "DISTMEM_TIMEOUT"),
    ("DISTMEM_TIMEOUT", "0", "DISTMEM_TIMEOUT"),
    ("DISTMEM_TIMEOUT", "inf", "DISTMEM_TIMEOUT"),
    ("DISTMEM_LAYOUT_TIMEOUT", "soon", "DISTMEM_LAYOUT_TIMEOUT"),
    ("DISTMEM_LAUNCH_TIMEOUT", "-1", "DISTMEM_LAUNCH_TIMEOUT"),
    ("DISTMEM_MEMORY", "unlimited", "DISTMEM_MEMORY"),
    ("DISTMEM_COMM", "carrier-pigeon", "DISTMEM_COMM"),
    ("DISTMEM_QUIET", "maybe", "DISTMEM_QUIET"),
    ("DISTMEM_PLAIN", "2", "DISTMEM_PLAIN"),
    ("DISTMEM_TORCH_EXPANDABLE_SEGMENTS", "sometimes", "DISTMEM_TORCH_EXPANDABLE_SEGMENTS"),
    ("DISTMEM_LIMIT", "1.5", "DISTMEM_LIMIT"),
    ("DISTMEM_LIMIT", "12 parsecs", "DISTMEM_LIMIT"),
    ("DISTMEM_OVERHEAD", "5%", "DISTMEM_OVERHEAD"),
    ("DISTMEM_FLEET", "4x16", "DISTMEM_FLEET"),
    ("DISTMEM_FLEET", "2xbig", "DISTMEM_FLEET"),
    ("CUDA_VISIBLE_DEVICES", "0,0", "CUDA_VISIBLE_DEVICES"),
    ("CUDA_VISIBLE_DEVICES", "7", "CUDA_VISIBLE_DEVICES"),
    ("CUDA_VISIBLE_DEVICES", "gpu0", "CUDA_VISIBLE_DEVICES"),
    ("CUDA_VISIBLE_DEVICES", "GPU-zz", "CUDA_VISIBLE_DEVICES"),
]

TF_CONFIGS = [
    ('["not", "an", "object"]', "TF_CONFIG"),
    ('{"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}}', "TF_CONFIG"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "first"}}', "first"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}', "task worker 3"),
    ('{"cluster": [], "task": {"type": "worker", "index": 0}}', "TF_CONFIG"),
    ('{not json', "TF_CONFIG"),
]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("DISTMEM_", "OMPI_", "HOROVOD_", "SLURM_", "PMI", "TORCHELASTIC")) or k in (
                "TF_CONFIG", "CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DISTMEM_QUIET", "1")
    distmem.reset()
    yield
    distmem.reset()


def _expect(call, word, value):
    with pytest.raises(DistmemError) as err:
        call()
    msg = str(err.value)
    assert word.lower() in msg.lower(), msg
    assert value.lower() in msg.lower(), msg
    return msg


@pytest.mark.parametrize("machine", ["cpu", "fleet"])
@pytest.mark.parametrize("kwargs, word, value", INIT_CASES, ids=[str(c[0]) for c in INIT_CASES])
def test_bad_init_arguments(machine, kwargs, word, value, monkeypatch):
    kwargs = dict(kwargs)
    if machine == "fleet" and "fleet" not in kwargs:
        monkeypatch.setenv("DISTMEM_FLEET", "2x16GiB")
    kwargs.setdefault("framework", "none")
    _expect(lambda: distmem.init(verbose=False, **kwargs), word, value)


@pytest.mark.parametrize("machine", ["cpu", "fleet"])
@pytest.mark.parametrize("name, value, word", ENV_CASES, ids=[f"{c[0]}={c[1]}" for c in ENV_CASES])
def test_bad_environment_variables(machine, name, value, word, monkeypatch):
    if name == "CUDA_VISIBLE_DEVICES" and machine == "cpu":
        pytest.skip("without NVML or a fleet there are no GPUs for CUDA_VISIBLE_DEVICES to name")
    if machine == "fleet" and name != "DISTMEM_FLEET":
        monkeypatch.setenv("DISTMEM_FLEET", "2x16GiB")
    monkeypatch.setenv(name, value)
    _expect(lambda: distmem.init(framework="none", verbose=False), word, value)


@pytest.mark.parametrize("raw, word", TF_CONFIGS)
def test_bad_tf_config(raw, word, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", raw)
    with pytest.raises(DistmemError, match="TF_CONFIG") as err:
        distmem.init(framework="none", verbose=False)
    assert word.lower() in str(err.value).lower()


def test_import_never_fails_on_a_bad_variable():
    env = dict(os.environ, DISTMEM_TIMEOUT="abc", DISTMEM_QUIET="maybe")
    res = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); import distmem"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("call, word, value", [
    (lambda: distmem.report(timeout="abc", print_table=False), "timeout", "abc"),
    (lambda: distmem.report(timeout=-1, print_table=False), "timeout", "-1"),
    (lambda: distmem.report(detail="everything", print_table=False), "detail", "everything"),
    (lambda: distmem.ReportEvery(0), "n", "0"),
    (lambda: distmem.ReportEvery(10, detail="some"), "detail", "some"),
    (lambda: distmem.check_plan(timeout="soon"), "timeout", "soon"),
])
def test_bad_report_arguments(call, word, value):
    distmem.init(framework="none", verbose=False)
    _expect(call, word, value)


def test_report_path_that_is_a_folder(tmp_path):
    distmem.init(framework="none", verbose=False)
    _expect(lambda: distmem.report(path=str(tmp_path), print_table=False), "folder", str(tmp_path))


@pytest.mark.parametrize("args, word", [
    (["plan", "--gpus", "4x16"], "4x16"),
    (["plan", "--gpus", "2x16GiB", "--limit", "8"], "limit"),
    (["plan", "--gpus", "2x16GiB", "--reserve", "lots"], "reserve"),
    (["plan", "--gpus", "2x16GiB", "--strategy", "pipeline", "--stages", "9GiB,x"], "x"),
    (["plan", "--gpus", "2x16GiB", "--strategy", "tenants", "--tenants", "bert"], "bert"),
])
def test_bad_cli_flags(args, word):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMEM_")}
    res = subprocess.run([sys.executable, "-m", "distmem.cli", *args], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=dict(env, PYTHONPATH=ROOT))
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert word in res.stderr, res.stderr


def test_the_table_is_large():
    """The issue asks for at least 60 bad inputs: count them."""
    assert len(INIT_CASES) + len(ENV_CASES) + len(TF_CONFIGS) + 6 + 1 + 5 >= 60
