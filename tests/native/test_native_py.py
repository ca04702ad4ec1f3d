"""distmem.apply.native: status and require_active in a preloaded Python process, the launch environment,
and distmem-exec (dry runs in-process, real execs in subprocesses)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from native_helpers import GiB, MiB, ROOT

from distmem.apply import native
from distmem.cli import exec as exec_cli
from distmem.errors import DistmemError

HERE = os.path.dirname(os.path.abspath(__file__))


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMEM_CAP") and k != "LD_PRELOAD"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["DISTMEM_QUIET"] = "1"
    env.update(extra)
    return env


def _py(built, args, *, cap=None, preload=True, timeout=60, **extra):
    env = _clean_env(LD_LIBRARY_PATH=built.fake_dir, **extra)
    if preload:
        env["LD_PRELOAD"] = built.lib
    if cap is not None:
        env["DISTMEM_CAP_BYTES"] = cap
    proc = subprocess.run([sys.executable, os.path.join(HERE, "pyprog_cap.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], proc.stderr


# ---- in a preloaded process ------------------------------------------------------------------------

def test_status_in_a_capped_python_process(built):
    out, _ = _py(built, ["alloc", str(600 * MiB), "alloc", str(600 * MiB), "status"], cap=str(GiB))
    assert [o["rc"] for o in out if o["op"] == "alloc"] == [0, 2]
    st = out[-1]["status"]
    assert st["active"] is True and st["config_ok"] is True
    assert st["library"] == built.lib
    assert st["cap_bytes"] == GiB and st["used_bytes"] == 600 * MiB and st["peak_bytes"] == 600 * MiB
    assert st["denials"] == 1 and st["last_denied_bytes"] == 600 * MiB and st["live_allocations"] == 1
    assert st["lookups"]["dlsym"] >= 1, "ctypes looks the driver up with dlsym: the XLA road"
    assert st["reports_cap_as_total"] is True
    assert [d["device"] for d in st["devices"]] == [0]


def test_status_without_the_library(built):
    out, _ = _py(built, ["alloc", str(600 * MiB), "status"], preload=False)
    st = out[-1]["status"]
    assert st["active"] is False and st["cap_bytes"] is None and st["library"] is None
    assert native.status()["active"] is False  # and neither is this test process


def test_require_active_accepts_the_matching_cap(built):
    out, _ = _py(built, ["require", str(GiB), "require-any"], cap="1GiB")
    assert out[0]["ok"] is True and out[1]["ok"] is True


def test_require_active_refuses_another_cap_with_both_figures(built):
    out, _ = _py(built, ["require", str(2 * GiB)], cap="1GiB")
    err = out[0]["error"]
    assert out[0]["ok"] is False and out[0]["type"] == "NativeCapError"
    assert "1.0 GiB (1073741824 bytes" in err and "2.0 GiB (2147483648 bytes)" in err
    assert "DISTMEM_CAP_BYTES=2147483648" in err


def test_require_active_refuses_an_uncapped_library(built):
    out, _ = _py(built, ["require", str(GiB)])
    assert out[0]["ok"] is False and "does not cap GPU 0" in out[0]["error"]


def test_require_active_refuses_a_malformed_cap(built):
    out, stderr = _py(built, ["require", str(GiB), "alloc", "1024"], cap="ten gigs")
    assert out[0]["ok"] is False and "is invalid" in out[0]["error"] and "denied" in out[0]["error"]
    assert out[1]["rc"] == 2


def test_require_active_without_the_library_names_the_launch_command(built):
    out, _ = _py(built, ["require", str(GiB)], preload=False)
    err = out[0]["error"]
    assert out[0]["ok"] is False
    assert "distmem-exec -- " in err and "horovodrun -np 4 distmem-exec -- " in err
    assert "pyprog_cap.py require 1073741824" in err  # this very command, ready to paste
    assert "DISTMEM_CAP_BYTES=1073741824" in err and "LD_PRELOAD=" in err


def test_require_active_in_this_process_raises():
    with pytest.raises(native.NativeCapError) as info:
        native.require_active(GiB)
    assert isinstance(info.value, DistmemError) and isinstance(info.value, RuntimeError)


# ---- pure helpers ------------------------------------------------------------------------------------

def test_cap_spec():
    assert native.cap_spec(GiB) == "1073741824"
    assert native.cap_spec("10GiB") == str(10 * GiB)
    assert native.cap_spec({1: "1GiB", 0: 512 * MiB}) == f"0:{512 * MiB},1:{GiB}"
    with pytest.raises(DistmemError, match="0..63"):
        native.cap_spec({64: GiB})
    with pytest.raises(DistmemError, match="empty"):
        native.cap_spec({})
    with pytest.raises(DistmemError, match="cannot read"):
        native.cap_spec("lots")


def test_launch_env_puts_the_library_first_once(tmp_path):
    lib = tmp_path / native.LIBRARY_NAME
    lib.write_bytes(b"")
    base = {"LD_PRELOAD": f"/old/{native.LIBRARY_NAME} /opt/libother.so", "PATH": "/bin"}
    env = native.launch_env({0: GiB}, library=str(lib), env=base)
    assert env["LD_PRELOAD"] == f"{lib} /opt/libother.so"
    assert env["DISTMEM_CAP_BYTES"] == f"0:{GiB}" and env["DISTMEM_CAP_DEVICE"] == "0"
    assert base["LD_PRELOAD"].startswith("/old/"), "the caller's mapping is not modified"


def test_library_path_says_how_to_build(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV_LIB, str(tmp_path / "missing.so"))
    with pytest.raises(native.NativeCapError, match="does not name a file"):
        native.library_path()
    monkeypatch.delenv(native.ENV_LIB)
    monkeypatch.setattr(native, "_PACKAGE_DIR", str(tmp_path))
    with pytest.raises(native.NativeCapError, match="scripts/build_native.sh"):
        native.library_path()


def _fake_plan(slots, rank=0):
    devices = [SimpleNamespace(index=i, planned_bytes=b) for i, b in slots]
    mine = SimpleNamespace(devices=devices, rank=rank)
    return SimpleNamespace(mine=mine, strategy="data", source="fleet:test", fingerprint=lambda: "f00d")


def test_caps_from_plan_adds_slices_of_one_gpu():
    assert native.caps_from_plan(_fake_plan([(0, GiB), (0, GiB), (1, 3 * GiB)])) == {0: 2 * GiB, 1: 3 * GiB}


# ---- distmem-exec ------------------------------------------------------------------------------------

@pytest.fixture
def planned(monkeypatch, built):
    """distmem-exec's plan call answered by a plan we choose; the library is the test build."""
    calls = []

    def plan_for(slots):
        def fake(options):
            calls.append(options)
            return _fake_plan(slots)
        monkeypatch.setattr(exec_cli, "plan_for_exec", fake)
    monkeypatch.setenv(native.ENV_LIB, built.lib)
    monkeypatch.setenv("DISTMEM_QUIET", "1")
    return SimpleNamespace(plan_for=plan_for, calls=calls)


def test_exec_dry_run_one_device(planned, capsys):
    planned.plan_for([(1, 5 * GiB)])
    rc = exec_cli.main(["--strategy", "pipeline", "-o", "stages=9GiB,7GiB", "-o", "reserve=1GiB", "--dry-run", "--",
                        "python", "train.py", "--lr", "3"])
    out = capsys.readouterr().out
    assert rc == 0
    assert planned.calls == [{"strategy": "pipeline", "stages": ["9GiB", "7GiB"], "reserve": "1GiB"}]
    assert f"DISTMEM_CAP_BYTES={5 * GiB} DISTMEM_CAP_DEVICE=1 python train.py --lr 3" in out
    assert out.startswith(f"LD_PRELOAD={native.find_library()}")


def test_exec_dry_run_several_devices(planned, capsys):
    planned.plan_for([(0, 4 * GiB), (1, 6 * GiB)])
    assert exec_cli.main(["--dry-run", "python", "x.py"]) == 0
    assert f"DISTMEM_CAP_BYTES=0:{4 * GiB},1:{6 * GiB} DISTMEM_CAP_DEVICE=0,1 python x.py" in capsys.readouterr().out


def test_exec_without_a_gpu_in_the_plan_runs_uncapped(planned, capsys):
    planned.plan_for([])
    assert exec_cli.main(["--dry-run", "--", "python", "x.py"]) == 0
    assert capsys.readouterr().out.strip() == "python x.py"


def test_exec_usage_errors(planned, capsys):
    assert exec_cli.main([]) == 2
    assert "no command given" in capsys.readouterr().err
    assert exec_cli.main(["--cap", "lots", "--", "true"]) == 2
    assert "cannot read 'lots'" in capsys.readouterr().err
    assert exec_cli.main(["-o", "novalue", "--", "true"]) == 2
    assert "is not KEY=VALUE" in capsys.readouterr().err


# ---- -o KEY=VALUE means what distmem plan's flag of that name means ---------------------------------

def _flag_reading(strategy, key, flag, text):
    """What ``distmem plan --strategy STRATEGY FLAG TEXT`` hands init() for KEY."""
    import argparse

    from distmem.cli.request_args import add_request_arguments, strategy_options
    from distmem.plan import get

    argv = ["--strategy", strategy, flag] + ([] if text is None else [text])
    p = argparse.ArgumentParser()
    add_request_arguments(p, argv, job=False)
    args = p.parse_args(argv)
    opts = strategy_options(get(strategy), args)
    return opts[key] if key in opts else getattr(args, key)


@pytest.mark.parametrize("strategy,key,flag,text", [
    ("pipeline", "stages", "--stages", "9GiB,7GiB"),  # docs/native.md's form, refused before (one string)
    ("pipeline", "num_stages", "--num-stages", "4"),  # what -o stages=4 meant ('int' object is not iterable)
    ("pipeline", "input_shape", "--input-shape", "96,96,3"),
    ("pipeline", "schedule", "--schedule", "gpipe"),
    ("pipeline", "recompute", "--recompute", None),
    ("auto", "pipelines", "--pipelines", "1,2"),
    ("tenants", "tenants", "--tenants", "bert=6GiB,resnet=8GiB"),
    ("data", "limit", "--limit", "45%"),
    ("data", "reserve", "--reserve", "1GiB"),
    ("data", "from_margin", "--from-margin", "0.2"),
    ("data", "from_report", "--from", "runs/last/report.json"),
])
def test_exec_option_means_what_the_flag_means(strategy, key, flag, text):
    item = f"{key}={'true' if text is None else text}"
    got = exec_cli.exec_options(strategy, [item])
    assert got == {key: _flag_reading(strategy, key, flag, text)}, f"-o {item} read as {got}"


@pytest.mark.parametrize("item,words", [
    ("stages", ["is not KEY=VALUE"]),
    ("num_stage=4", ["num_stage is not an option of --strategy pipeline", "num_stages"]),
    ("num_stages=four", ["num_stages='four'", "whole number"]),
    ("recompute=maybe", ["switch", "recompute=true"]),
    ("schedule=zb", ["--schedule", "invalid choice: 'zb'", "1f1b"]),
    ("tenants=a=1GiB", ["--tenants applies to --strategy tenants"]),
    ("from_margin=ten", ["--from-margin", "'ten'"]),
    ("memory=lots", ["--memory", "'lots'", "growth"]),
])
def test_exec_option_errors_name_the_item(item, words):
    with pytest.raises(DistmemError) as info:
        exec_cli.exec_options("pipeline", [item])
    for w in words:
        assert w in str(info.value), f"{w!r} not in: {info.value}"


def test_exec_pipeline_stages_as_docs_show_them(built):
    """docs/native.md's command, run as written on a declared 2-GPU fleet as rank 0 of 2 (SLURM's
    variables without a job id: no exchange to wait for): the cap is stage 0's limit, the one
    distmem plan gives rank 0 for --stages 9GiB,7GiB."""
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "2"}
    proc = _exec(built, ["--strategy", "pipeline", "-o", "stages=9GiB,7GiB", "--fleet", "2x16GiB", "--dry-run",
                         "--", "python", "train.py"], **slurm)
    assert proc.returncode == 0, proc.stderr
    plan = subprocess.run([sys.executable, "-m", "distmem", "plan", "--strategy", "pipeline", "--stages", "9GiB,7GiB",
                           "--gpus", "2x16GiB", "--ranks", "2", "--json"], capture_output=True, text=True, timeout=120,
                          env=_clean_env(), cwd=ROOT)
    assert plan.returncode == 0, plan.stderr
    limit = json.loads(plan.stdout)["allocations"][0]["limit_bytes"]
    assert f"DISTMEM_CAP_BYTES={limit} " in proc.stdout, (limit, proc.stdout)
    refused = _exec(built, ["--strategy", "pipeline", "-o", "stages=4", "--fleet", "2x16GiB", "--dry-run", "--",
                            "python", "train.py"], **slurm)
    assert refused.returncode == 2 and "num_stages=" in refused.stderr, refused.stderr


def _exec(built, args, timeout=60, **extra):
    env = _clean_env(DISTMEM_CAP_LIB=built.lib, LD_LIBRARY_PATH=built.fake_dir, **extra)
    return subprocess.run([sys.executable, "-m", "distmem.cli.exec", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_exec_runs_the_command_under_the_cap(built):
    proc = _exec(built, ["--cap", "1GiB", "--", sys.executable, os.path.join(HERE, "pyprog_cap.py"),
                         "alloc", str(600 * MiB), "alloc", str(600 * MiB), "require", str(GiB), "status"])
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [o["rc"] for o in out if o["op"] == "alloc"] == [0, 2]
    assert out[2] == {"op": "require", "ok": True}
    st = out[3]["status"]
    assert st["active"] and st["cap_bytes"] == GiB and st["spec"] == str(GiB) and st["plan_fingerprint"] is None


def test_exec_reports_a_missing_command(built):
    proc = _exec(built, ["--cap", "1GiB", "--", "no-such-program-distmem"])
    assert proc.returncode == 127 and "cannot run 'no-such-program-distmem'" in proc.stderr


def test_exec_from_the_real_plan_on_a_declared_fleet(built):
    """distmem-exec with no --cap asks distmem.api.plan_from_env; on this CPU machine a declared fleet
    stands in for the GPUs. The child's require_active against the same plan's figure must pass."""
    code = ("import json, distmem; from distmem.apply import native; p = distmem.plan_from_env('data', fleet='1x16GiB'); "
            "native.require_active(p.mine.limit_bytes); "
            "print(json.dumps({'limit': p.mine.limit_bytes, 'status': native.status()}))")
    proc = _exec(built, ["--fleet", "1x16GiB", "--", sys.executable, "-c", code], DISTMEM_FLEET="1x16GiB")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["status"]["active"] and got["status"]["cap_bytes"] == got["limit"] > 0
    assert got["status"]["plan_fingerprint"]
