"""Issue 18, "what a new user trips on": each point through the real entry points - the ``distmem``
command (run as a process, as a user runs it) and ``distmem.init()`` in a fresh interpreter where
the order of framework start and ``init()`` matters (a framework cannot be un-started in-process)."""
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest

import distmem
from distmem.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER_VARS = ("OMPI_", "PMI_", "PMIX_", "HOROVOD_", "SLURM_", "TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "MPI_LOCAL", "TORCHELASTIC_", "MASTER_")


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCHER_VARS) and not k.startswith("DISTMEM_")}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="3")
    env.update(extra)
    return env


def distmem_cli(*args, env=None, timeout=120):
    """The real ``distmem`` entry point (distmem.cli:main, as the console script runs it)."""
    code = "import sys; from distmem.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=_env(**(env or {})), cwd=ROOT)


def python(code, env=None, timeout=300):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=_env(**(env or {})), cwd=ROOT)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("DISTMEM_FLEET", raising=False)
    distmem.reset()
    yield
    distmem.reset()


# ------------------------------------------------------------------------------ too late, in dry runs too

TF_ORDER = """
    import json, sys
    import tensorflow as tf
    import distmem
    from distmem.errors import TooLateError
    scenario = sys.argv[1] if len(sys.argv) > 1 else "{scenario}"
    options = {options}
    out = {{}}
    if scenario == "model_first":
        tf.keras.Sequential([tf.keras.Input((64, 64, 3)), tf.keras.layers.Conv2D(4, 3)])
    try:
        plan = distmem.init(verbose=False, **options)
        out["init"] = plan.mine.describe()
        tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
        out["again"] = distmem.init(verbose=False, **options) is plan   # the same call: the plan stands
    except TooLateError as exc:
        out["error"] = str(exc)
    print("RESULT " + json.dumps(out))
"""


def _tf_order(scenario, options=None, env=None):
    pytest.importorskip("tensorflow")
    res = python(TF_ORDER.format(scenario=scenario, options=repr(options or {})), env=env)
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert res.returncode == 0 and line, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(line[-1][len("RESULT "):])


def test_keras_model_before_init_is_too_late_on_cpu():
    out = _tf_order("model_first")
    assert "error" in out, out
    msg = out["error"]
    assert "TensorFlow already initialised its devices before distmem.init()" in msg
    assert "live configuration: CPU:0" in msg and "no GPU, no declared fleet" in msg
    assert "call distmem.init() right after the imports" in msg


def test_keras_model_before_init_is_too_late_against_a_declared_fleet():
    out = _tf_order("model_first", env={"DISTMEM_FLEET": "2x16GiB"})
    msg = out.get("error", "")
    assert "planned: rank 0 (local 0): GPU 0 growth, budget 15.0 GiB" in msg and "fleet:2x16GiB" in msg, out
    tenants = _tf_order("model_first", {"strategy": "tenants", "tenants": {"a": "2GiB", "b": "3GiB"}},
                        env={"DISTMEM_FLEET": "1x16GiB"})
    assert "GPU 0 [a] hard limit 2.0 GiB; GPU 0 [b] hard limit 3.0 GiB" in tenants.get("error", ""), tenants
    assert "None" not in tenants["error"]


def test_init_first_then_model_and_the_same_init_again_is_fine():
    out = _tf_order("in_order", env={"DISTMEM_FLEET": "2x16GiB"})
    assert "error" not in out and out["again"] is True, out


TORCH_ORDER = """
    import json, sys
    sys.path.insert(0, "tests")
    from fake_torch_cuda import FakeCudaBase
    import distmem
    from distmem.apply import torch as tadapter
    from distmem.errors import TooLateError

    class Started(FakeCudaBase):
        version = "2.14.1"

    tadapter.set_backend(Started(count=2, initialised=True, contexts=[int(sys.argv[1])]))
    try:
        out = {"init": distmem.init(framework="torch", fleet="2x16GiB", verbose=False).mine.describe()}
    except TooLateError as exc:
        out = {"error": str(exc)}
    print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("context", [1, 0])
def test_torch_cuda_started_before_init_is_too_late_in_a_dry_run(context):
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(TORCH_ORDER), str(context)], capture_output=True,
                         text=True, timeout=300, env=_env(), cwd=ROOT)
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert res.returncode == 0 and line, res.stdout[-2000:] + res.stderr[-3000:]
    out = json.loads(line[-1][len("RESULT "):])
    if context == 1:  # a context on a GPU this rank was not planned for: what a GPU node refuses
        assert "CUDA already started" in out.get("error", ""), out
        assert "context(s) on cuda:1" in out["error"] and "planned cuda:0" in out["error"]
        assert "fleet:2x16GiB" in out["error"]
    else:  # a context on the planned GPU itself is accepted, as on a GPU node
        assert out.get("init", "").startswith("rank 0 (local 0): GPU 0"), out


# ------------------------------------------------------------------------------ twice, and alone

def test_second_init_with_other_options_names_what_changed():
    plan = distmem.init(memory="growth", fleet="2x16GiB", framework="none", verbose=False)
    assert distmem.init(memory="growth", fleet="2x16GiB", framework="none", verbose=False) is plan
    with pytest.raises(ConfigError, match="memory='growth' then 'limit'"):
        distmem.init(memory="limit", fleet="2x16GiB", framework="none", verbose=False)


def test_plain_python_says_no_launcher_once_and_quiet_silences_it():
    code = "import distmem; distmem.init(framework='none', fleet='1x16GiB')"
    res = python(code)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("no launcher detected: 1 rank") == 1, res.stderr
    quiet = python(code, env={"DISTMEM_QUIET": "1"})
    assert quiet.returncode == 0 and "no launcher" not in quiet.stderr, quiet.stderr


# ------------------------------------------------------------------------------ options and commands

def test_unknown_argument_says_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown argument 'stratgey' \(did you mean 'strategy'\?\)"):
        distmem.init(stratgey="data", fleet="2x16GiB", framework="none", verbose=False)
    with pytest.raises(ConfigError, match=r"unknown argument 'stage' \(did you mean 'stages'\?\).*stages"):
        distmem.init(strategy="pipeline", stage=["1GiB"], fleet="2x16GiB", framework="none", verbose=False)


def test_integer_limit_says_it_is_bytes():
    with pytest.raises(ConfigError, match="integer limit is bytes.*'8GiB'"):
        distmem.init(limit=8, fleet="2x16GiB", framework="none", verbose=False)
    res = distmem_cli("plan", "--gpus", "2x16GiB", "--limit", "8")
    assert res.returncode == 1 and "integer limit is bytes" in res.stderr and "'8GiB'" in res.stderr


@pytest.mark.parametrize("fleet", ["4x16", "4x", "4x16Gx"])
def test_fleet_errors_name_the_setting_the_item_and_the_form(fleet):
    res = distmem_cli("plan", env={"DISTMEM_FLEET": fleet})
    assert res.returncode == 1, res.stdout
    assert f"DISTMEM_FLEET={fleet!r}" in res.stderr and "4x16GiB" in res.stderr, res.stderr
    assert "percentage" not in res.stderr and "Traceback" not in res.stderr


def test_plan_honours_the_fleet_variable_and_flag_with_plural_wording():
    res = distmem_cli("plan", "--ranks", "4", env={"DISTMEM_FLEET": "2x16GiB"})
    assert res.returncode == 0 and "devices from fleet:2x16GiB" in res.stdout and "4 ranks," in res.stdout
    one = distmem_cli("plan", "--fleet", "2x16GiB", "--ranks", "1")
    assert one.returncode == 0 and "1 rank," in one.stdout, one.stderr
    assert "(s)" not in one.stdout and "1 GPU visible on host0 but no rank uses it: it stays idle" in one.stdout


def test_pipeline_of_stated_bytes_shows_its_headroom_and_zero_keeps_them():
    res = distmem_cli("plan", "--strategy", "pipeline", "--gpus", "4x16GiB", "--stages", "9GiB,7GiB")
    assert res.returncode == 0, res.stderr
    assert "2 pipelines of 2 stages side by side" in res.stdout
    assert "+ 10% headroom for the allocator's cache" in res.stdout and "--headroom 0 keeps" in res.stdout
    assert "hard limit 9.9 GiB (9.0 GiB + 10% headroom)" in res.stdout
    exact = distmem_cli("plan", "--strategy", "pipeline", "--gpus", "4x16GiB", "--stages", "9GiB,7GiB",
                        "--headroom", "0")
    assert "hard limit 9.0 GiB  demand 9.0 GiB" in exact.stdout and "headroom" not in exact.stdout, exact.stdout
    big = distmem_cli("plan", "--strategy", "pipeline", "--gpus", "2x16GiB", "--stages", "17GiB,7GiB")
    assert big.returncode == 1
    assert "a GPU of at least 18.0 GiB" in big.stderr and "split stage 0 into 2 stages" in big.stderr
    assert "recompute" not in big.stderr and "micro-batches" not in big.stderr


def test_help_texts_cover_every_option_and_name_distmem_exec():
    res = distmem_cli("plan", "--help")
    assert res.returncode == 0
    body = res.stdout.split("options:", 1)[1].split("examples:", 1)
    assert len(body) == 2 and "distmem plan --gpus 4x80GiB --ranks 8" in body[1]
    lines = body[0].splitlines()
    for i, line in enumerate(lines):  # an option line without text on it must be followed by its text
        if line.startswith("  -") and "  " not in line.strip():
            assert i + 1 < len(lines) and lines[i + 1].startswith(" " * 10), f"no help text for {line.strip()}"
    top = distmem_cli("--help")
    assert "distmem-exec" in top.stdout


def test_json_into_a_closed_pipe_ends_quietly():
    code = ("import sys; from distmem.cli import main; sys.exit(main(['plan', '--gpus', '4x16GiB', '--ranks', "
            "'4096', '--ranks-per-host', '4', '--json']))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env(), cwd=ROOT)
    proc.stdout.read(64)  # `| head -c 64`: read a little, then leave
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


# ------------------------------------------------------------------------------ output hygiene

class _Writes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.calls, self.flushes = [], 0

    def write(self, text):
        self.calls.append(text)
        return super().write(text)

    def flush(self):
        self.flushes += 1


def test_messages_and_the_table_are_one_write_each_with_the_newline():
    from distmem.console import say
    from distmem.report.sinks import print_report

    w = _Writes()
    say("[distmem rank 1] one line", file=w)
    assert w.calls == ["[distmem rank 1] one line\n"] and w.flushes == 1
    distmem.init(fleet="2x16GiB", framework="none", verbose=False)
    rep = distmem.report(print_table=False)
    t = _Writes()
    print_report(rep, file=t, use_rich=False)
    assert len(t.calls) == 1 and t.calls[0].endswith("\n") and t.flushes >= 1, t.calls
    assert t.calls[0].startswith("distmem report: 1 rank, strategy data")


def test_dry_run_ranks_are_not_enforced_and_the_star_is_explained():
    distmem.init(fleet="2x16GiB", framework="none", memory="limit", verbose=False)
    snap = distmem.snapshot()
    assert snap.enforced is False and snap.plan_source == "fleet:2x16GiB"
    rep = distmem.report(print_table=False)
    from distmem.report.sinks import table

    text = table(rep)
    assert "limit*" in text and "*: limit planned, not enforced" in text and "dry run: limits planned" in text
